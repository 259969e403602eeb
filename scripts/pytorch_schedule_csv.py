"""Writes the action order PyTorch's single-stage schedules (Schedule1F1B, ScheduleGPipe) dump,
with the gradient reductions `_add_reduce_grad` adds (REDUCE_GRAD / WAIT_REDUCE_GRAD), without a
process group or a stage: only the counts `_get_pipeline_order` reads are set.

    python scripts/pytorch_schedule_csv.py 1F1B|GPipe PIPELINE_DEGREE MICROBATCHES OUT.csv

tests/fixtures/pytorch_{1f1b,gpipe}_pp4_mb8.csv were written by this script with PyTorch 2.15.
titan reads the GPipe one as its own GPipe; PyTorch 2.15's 1F1B order numbers the last stage's
forwards from 1 (1..M against backwards 0..M-1), which titan refuses naming that stage.
"""
import csv
import sys

from torch.distributed.pipelining import schedules

kind, pp, n_mb, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
cls = {"1F1B": schedules.Schedule1F1B, "GPipe": schedules.ScheduleGPipe}[kind]
schedule = cls.__new__(cls)  # what `_get_pipeline_order` reads, nothing more
schedule._num_stages = pp
schedule._n_microbatches = n_mb
order = schedule._get_pipeline_order()
with open(out, "w", newline="") as f:
    writer = csv.writer(f)
    for rank in sorted(order):
        writer.writerow(["" if a is None else str(a) for a in order[rank]])
