#!/usr/bin/env python3
"""`titan plan`'s GPU model against TorchTitan's published Llama 3.1 runs on H100s (issue 31).

Each row plans the published job (model, GPU count, seq_len 8192, global batch, the published
activation checkpointing) with `titan plan --gpu h100 --gpu-memory-gib 95 --keep-ac --json`
(TorchTitan's H100s have 95 GiB) and reads the prediction for the published layout; the table
gives predicted and published tokens/s per GPU, the error, and the layout the planner ranks first
for that job. Sources (pytorch/torchtitan): benchmarks/llama3_h100_202412_torchtitan.md (was
docs/performance.md), benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md, and the Aug 2024
docs/performance.md (commit 3faaa1a) for 405B on 128 GPUs. Row A is the anchor the H100's compute
efficiency was set from; rows F compare bf16 predictions with Float8 + async TP runs, so only
which schedule wins is compared there; rows F1-8 and F2-8 are the same layouts with the Float8
linears as published, for their memory. A layout that does not fit 95 GiB in titan is predicted
as if the GPU had room, and its note says how much it needs. Exits 1 when a compared row is off
by more than 25%.

Usage: scripts/plan_gpu_tables.py [--titan target/release/titan]
"""
import argparse
import json
import subprocess
import sys

# (row, flavor, gpus, global batch, AC mode, published layout, schedule, microbatch size,
#  published tokens/s per GPU, compared, note)
ROWS = [
    ("A", "8B", 8, 16, "selective", "dp_shard 8", None, None, 5762, True,
     "FSDP, no compile (Table 1; the anchor)"),
    ("B", "8B", 128, 256, "selective", "dp_shard 128", None, None, 5605, True,
     "FSDP, no compile (Table 3)"),
    ("A8", "8B", 8, 16, "selective", "dp_shard 8", None, None, 8532, True,
     "FSDP, Float8 + compile (Table 1; titan's float8 speedup was read off it against the compiled bf16 run, 6,667)"),
    ("C", "8B", 64, 96, "selective", "dp_shard 8 × tp 8", None, None, 4378, True,
     "FSDP 8 × TP 8, compile, bf16 (async-TP table, vanilla TP)"),
    ("D", "70B", 256, 512, "full", "dp_shard 32 × tp 8", None, None, 597.3, True,
     "FSDP 32 × TP 8, compile, bf16 (async-TP table, vanilla TP)"),
    ("E", "405B", 128, 32, "full", "dp_shard 16 × tp 8", None, None, 109, True,
     "FSDP 16 × TP 8, bf16 (Aug 2024 performance.md)"),
    ("F1", "405B", 512, 256, "full", "pp 8 × dp_shard 8 × tp 8", "1F1B", 1, 100, False,
     "3-D, 1F1B; published with Float8 + compile + async TP (Table 5)"),
    ("F2", "405B", 512, 256, "full", "pp 8 × dp_shard 8 × tp 8", "Interleaved1F1B", 1, 128, False,
     "3-D, Interleaved 1F1B; published with Float8 + compile + async TP (Table 5)"),
    ("F1-8", "405B", 512, 256, "full", "pp 8 × dp_shard 8 × tp 8", "1F1B", 1, 100, True,
     "row F1 with Float8 linears, as published (Table 5)"),
    ("F2-8", "405B", 512, 256, "full", "pp 8 × dp_shard 8 × tp 8", "Interleaved1F1B", 1, 128, False,
     "row F2 with Float8 linears, as published (Table 5)"),
]


# Extra flags of a row (float8 linears: titan's float8 GEMM rate, `Device::float8_speedup`).
FLOAT8 = ["--model.converters", "quantize.linear.float8"]
FLAGS = {"A8": FLOAT8, "F1-8": FLOAT8, "F2-8": FLOAT8}


def plan(titan, flavor, gpus, batch, ac, memory="95", extra=()):
    cmd = [titan, "plan", *extra, "--gpu", "h100", "--gpu-memory-gib", memory, "--ngpu", str(gpus),
           "--keep-ac", "--json", "--top", "1000000", "--model.flavor", flavor,
           "--training.seq_len", "8192", "--training.global_batch_size", str(batch),
           "--activation_checkpoint.mode", ac, "--activation_checkpoint.selective_ac_option", "op"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{out.stderr[-2000:]}")
    return json.loads(out.stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--titan", default="target/release/titan")
    a = ap.parse_args()
    plans = {}
    rows = []
    bad = []
    for row, flavor, gpus, batch, ac, layout, sched, mbs, published, compared, note in ROWS:
        extra = tuple(FLAGS.get(row, ()))
        key = (flavor, gpus, batch, ac, extra)
        if key not in plans:
            plans[key] = plan(a.titan, flavor, gpus, batch, ac, extra=extra)
        cands = plans[key]
        name = layout + (f" ({sched}, {batch // 8 // mbs} mb)" if sched else "")
        match = [c for c in cands if c["layout"] == name]
        if not match:
            sys.exit(f"row {row}: layout {name} not among titan plan's candidates")
        c = match[0]
        best = next((x for x in cands if x["fits"]), None)
        if not c["fits"]:
            # titan needs more memory for this layout than TorchTitan did: predict it on a GPU
            # large enough, to compare the schedules at least.
            roomy = plan(a.titan, flavor, gpus, batch, ac, memory="1000", extra=extra)
            c = next(x for x in roomy if x["layout"] == name)
            note += f"; titan needs {c['memory_gib']:.0f} GiB/GPU for it, predicted as if it had them"
        pred = c["tokens_per_s"] / gpus
        err = (pred - published) / published
        if compared and abs(err) > 0.25:
            bad.append(row)
        rows.append((row, flavor, gpus, name, pred, published, err, best, note, c["memory_gib"]))
    print("| row | model | GPUs | layout (published) | titan GiB/GPU | predicted tok/s/GPU | published | error | planner's best | source |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row, flavor, gpus, name, pred, pub, err, best, note, mem in rows:
        p = "does not fit" if pred is None else f"{pred:.0f}"
        e = "" if err is None else f"{err:+.1%}"
        b = "none fits" if best is None else f"{best['layout']} ({best['tokens_per_s'] / gpus:.0f})"
        print(f"| {row} | {flavor} | {gpus} | {name} | {mem:.1f} | {p} | {pub} | {e} | {b} | {note} |")
    if bad:
        sys.exit(f"rows off by more than 25%: {', '.join(bad)}")


if __name__ == "__main__":
    main()
