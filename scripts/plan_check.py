#!/usr/bin/env python3
"""Checks `titan plan`'s cost model against measured runs on this CPU (issue 31).

For each layout below, `titan plan --nproc N --json` predicts tokens/s and `titan bench train`
measures it (the candidate's own `overrides`, so the measured run is the planned layout and the
overrides round-trip into a config titan accepts). Prints a markdown table, the median relative
error and Spearman's rank correlation; exits 1 when the median error exceeds 20% or Spearman is
below 0.8. The two-rank TP and CP layouts and DDP 2 × TP 2 are calibration points (`titan plan
--calibrate` runs them, as it runs one process of each model) and are marked so.

Usage: scripts/plan_check.py [--titan target/release/titan] [--repeats 2] [--only LABEL_PART]
"""
import argparse
import json
import statistics
import subprocess
import sys

DEBUG = []  # the built-in debug job: llama3 debugmodel, batch 8, seq 256
MOE = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"]
FLOAT8 = ["--model.converters", "quantize.linear.float8"]  # rowwise, emulated on the CPU

# (model overrides, ranks, the layout's keys that pick the candidate, label)
LAYOUTS = [
    (DEBUG, 2, {"data_parallel_shard_degree": "2"}, "FSDP 2"),
    (DEBUG, 2, {"data_parallel_replicate_degree": "2"}, "DDP 2"),
    (DEBUG, 2, {"tensor_parallel_degree": "2"}, "TP 2 (calibration)"),
    (DEBUG, 2, {"context_parallel_degree": "2"}, "CP 2 (calibration)"),
    (DEBUG, 2, {"pipeline_parallel_degree": "2", "pipeline_parallel_schedule": "1F1B",
                "pipeline_parallel_microbatch_size": "1"}, "PP 2 1F1B, 8 mb"),
    (DEBUG, 4, {"data_parallel_shard_degree": "4"}, "FSDP 4"),
    (DEBUG, 4, {"data_parallel_shard_degree": "2", "tensor_parallel_degree": "2"}, "FSDP 2 × TP 2"),
    (DEBUG, 4, {"data_parallel_replicate_degree": "2", "data_parallel_shard_degree": "2"}, "HSDP 2×2"),
    (DEBUG, 4, {"tensor_parallel_degree": "4"}, "TP 4"),
    (DEBUG, 4, {"data_parallel_replicate_degree": "2", "tensor_parallel_degree": "2"}, "DDP 2 × TP 2 (calibration)"),
    (DEBUG, 4, {"data_parallel_shard_degree": "2", "context_parallel_degree": "2"}, "FSDP 2 × CP 2"),
    (DEBUG, 4, {"pipeline_parallel_degree": "2", "data_parallel_shard_degree": "2",
                "pipeline_parallel_schedule": "Interleaved1F1B",
                "pipeline_parallel_microbatch_size": "2"}, "PP 2 × FSDP 2 interleaved, 4 mb"),
    # The schedules told apart (issue 45): the transfers on a crowded host, a "V"'s slow rank.
    (DEBUG, 4, {"pipeline_parallel_degree": "2", "data_parallel_shard_degree": "2",
                "pipeline_parallel_schedule": "1F1B",
                "pipeline_parallel_microbatch_size": "2"}, "PP 2 × FSDP 2 1F1B, 4 mb"),
    (DEBUG, 4, {"pipeline_parallel_degree": "2", "data_parallel_shard_degree": "2",
                "pipeline_parallel_schedule": "ZBVZeroBubble",
                "pipeline_parallel_microbatch_size": "2"}, "PP 2 × FSDP 2 ZBV, 4 mb"),
    (DEBUG, 2, {"pipeline_parallel_degree": "2", "pipeline_parallel_schedule": "ZBVZeroBubble",
                "pipeline_parallel_microbatch_size": "1"}, "PP 2 ZBV, 8 mb"),
    (DEBUG, 8, {"data_parallel_shard_degree": "8"}, "FSDP 8"),
    (DEBUG, 8, {"pipeline_parallel_degree": "2", "data_parallel_shard_degree": "2",
                "tensor_parallel_degree": "2", "pipeline_parallel_schedule": "1F1B",
                "pipeline_parallel_microbatch_size": "2"}, "PP 2 × FSDP 2 × TP 2"),
    (MOE, 2, {"data_parallel_shard_degree": "2"}, "MoE FSDP 2"),
    (MOE, 2, {"data_parallel_shard_degree": "2", "expert_parallel_degree": "2"}, "MoE FSDP 2, EP 2"),
    (MOE, 4, {"data_parallel_shard_degree": "4", "expert_parallel_degree": "4"}, "MoE FSDP 4, EP 4"),
    (FLOAT8, 1, {}, "float8 rowwise, 1 process (calibration)"),
    (FLOAT8, 2, {"data_parallel_shard_degree": "2"}, "float8 rowwise FSDP 2"),
    (FLOAT8, 2, {"tensor_parallel_degree": "2"}, "float8 rowwise TP 2"),
    (FLOAT8, 4, {"data_parallel_shard_degree": "2", "tensor_parallel_degree": "2"}, "float8 rowwise FSDP 2 × TP 2"),
]

DEFAULTS = {"pipeline_parallel_degree": "1", "data_parallel_replicate_degree": "1",
            "data_parallel_shard_degree": "1", "context_parallel_degree": "1",
            "tensor_parallel_degree": "1", "expert_parallel_degree": "1"}


def run(cmd):
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{out.stderr[-3000:]}")
    return out.stdout


def keys(overrides):
    pairs = dict(zip(overrides[0::2], overrides[1::2]))
    return {k.split(".", 1)[1]: v for k, v in pairs.items()}


def pick(candidates, want):
    want = {**DEFAULTS, **want}
    for c in candidates:
        k = keys(c["overrides"])
        if c["fits"] and all(k.get(n) == v for n, v in want.items()) and k.get("mode") == "none":
            return c
    return None


def spearman(xs, ys):
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for pos, i in enumerate(order):
            r[i] = float(pos)
        return r
    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    d2 = sum((a - b) ** 2 for a, b in zip(rx, ry))
    return 1 - 6 * d2 / (n * (n * n - 1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--titan", default="target/release/titan")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--only", default="", help="only the layouts whose label contains this")
    a = ap.parse_args()
    rows = []
    plans = {}
    for model, n, want, label in LAYOUTS:
        if a.only not in label:
            continue
        key = (tuple(model), n)
        if key not in plans:
            plans[key] = json.loads(run([a.titan, "plan", "--nproc", str(n), "--json", "--top", "100000", *model]))
        c = pick(plans[key], want)
        if c is None:
            sys.exit(f"{label}: no fitting candidate with {want} in titan plan's list")
        measured = []
        for _ in range(a.repeats):
            out = run([a.titan, "bench", "train", "--json", "--nproc", str(n), "--steps", str(a.steps),
                       "--warmup", "2", *model, *c["overrides"]])
            measured.append(json.loads([l for l in out.splitlines() if l.startswith("{")][-1])["tokens_per_s"])
        m = statistics.median(measured)
        p = c["tokens_per_s"]
        rows.append((label, n, p, m, (p - m) / m))
        print(f"{label}: predicted {p:.0f}, measured {m:.0f} tokens/s ({(p - m) / m:+.1%})", file=sys.stderr)
    errors = [abs(r[4]) for r in rows]
    rho = spearman([r[2] for r in rows], [r[3] for r in rows])
    print("| layout | ranks | predicted tokens/s | measured tokens/s | error |")
    print("|---|---|---|---|---|")
    for label, n, p, m, e in rows:
        print(f"| {label} | {n} | {p:.0f} | {m:.0f} | {e:+.1%} |")
    med = statistics.median(errors)
    print(f"\nmedian |error| {med:.1%}, Spearman {rho:.3f} over {len(rows)} layouts")
    if med > 0.20 or rho < 0.8:
        sys.exit("the cost model misses the bar (median error ≤ 20%, Spearman ≥ 0.8)")


if __name__ == "__main__":
    main()
