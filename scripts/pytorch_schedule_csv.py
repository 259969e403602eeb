"""Writes the action order PyTorch's schedules dump, without a process group or a model.

    python scripts/pytorch_schedule_csv.py SCHEDULE PIPELINE_DEGREE MICROBATCHES OUT.csv

SCHEDULE is one of TorchTitan's names: 1F1B and GPipe (one stage per rank; the order
`_get_pipeline_order` returns, with the gradient reductions `_add_reduce_grad` adds:
REDUCE_GRAD / WAIT_REDUCE_GRAD), Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble, LoopedBFS
and DualPipeV (two stages per rank; what `_dump_csv` writes by default, the order with its
transfers, UNSHARD/RESHARD and gradient reductions). A multi-stage schedule computes every rank's
order from the counts and the placement alone, so stand-in stages carrying those counts are enough.

tests/fixtures/pytorch_*_pp*_mb*.csv were written by this script with PyTorch 2.15. titan reads
them all; its own schedules equal PyTorch's action for action except ZBVZeroBubble (titan's list
scheduler; its bubble is PyTorch's or smaller) and 1F1B, whose PyTorch 2.15 dump numbers the last
stage's forwards from 1 (1..M against backwards 0..M-1) and is refused naming that stage.
"""
import csv
import sys

import torch
from torch.distributed.pipelining import schedules

SINGLE = {"1F1B": schedules.Schedule1F1B, "GPipe": schedules.ScheduleGPipe}
MULTI = {
    "Interleaved1F1B": schedules.ScheduleInterleaved1F1B,
    "InterleavedZeroBubble": schedules.ScheduleInterleavedZeroBubble,
    "ZBVZeroBubble": schedules.ScheduleZBVZeroBubble,
    "LoopedBFS": schedules.ScheduleLoopedBFS,
    "DualPipeV": schedules.ScheduleDualPipeV,
}


class StandInStage:
    """What a multi-stage schedule's constructor reads of a stage: counts, place, a module."""

    def __init__(self, num_stages, group_size, stage_index):
        self.num_stages = num_stages
        self.group_size = group_size
        self.group_rank = 0
        self.stage_index = stage_index
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.submod = torch.nn.Identity()


def single_stage_order(cls, pp, n_mb):
    schedule = cls.__new__(cls)  # what `_get_pipeline_order` reads, nothing more
    schedule._num_stages = pp
    schedule._n_microbatches = n_mb
    order = schedule._get_pipeline_order()
    return [order[rank] for rank in sorted(order)]


def main():
    kind, pp, n_mb, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    if kind in SINGLE:
        rows = single_stage_order(SINGLE[kind], pp, n_mb)
        with open(out, "w", newline="") as f:
            writer = csv.writer(f)
            for row in rows:
                writer.writerow(["" if a is None else str(a) for a in row])
    elif kind in MULTI:
        stages = [StandInStage(2 * pp, pp, s) for s in (0, 1)]
        MULTI[kind](stages, n_mb)._dump_csv(out)
    else:
        sys.exit(f"unknown schedule {kind}: one of {', '.join([*SINGLE, *MULTI])}")


if __name__ == "__main__":
    main()
