"""Writes PyTorch's DualPipeV schedule as its `_dump_csv` would, with the gradient reductions
`_add_reduce_grad` adds (REDUCE_GRAD / WAIT_REDUCE_GRAD) and its OVERLAP_F_B cells, without a
process group: only the V placement that the rank's action list depends on is set.

    python scripts/pytorch_dualpipev_csv.py OUT.csv PIPELINE_DEGREE MICROBATCHES

tests/fixtures/dualpipev_pp2_mb4.csv was written by this script with PyTorch 2.15 (pp 2, 4
microbatches); titan's `--parallelism.pipeline_parallel_schedule_csv` reads it.
"""
import sys

from torch.distributed.pipelining.schedules import ScheduleDualPipeV, _add_reduce_grad

out, pp, n_mb = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
num_stages = 2 * pp


class Placed(ScheduleDualPipeV):
    def __init__(self):
        # What `_calculate_single_rank_operations` reads: the V placement and the counts.
        self.pp_group_size = pp
        self._num_stages = self.num_stages = num_stages
        self.n_local_stages = 2
        self._n_microbatches = n_mb
        self.stage_index_to_group_rank = {
            s: s if s < pp else num_stages - 1 - s for s in range(num_stages)
        }


schedule = Placed()
rows = []
for rank in range(pp):
    schedule.rank = rank
    actions = _add_reduce_grad(schedule._calculate_single_rank_operations(rank), n_mb)
    rows.append(",".join("" if a is None else str(a) for a in actions))
with open(out, "w") as f:
    f.write("\n".join(rows) + "\n")
