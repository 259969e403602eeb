#!/usr/bin/env bash
# Side-by-side CPU training throughput: `titan bench train` and the PyTorch eager reference
# (../shared/bench/torch_llama_cpu.py) on the same debug model, shapes and thread count, alternating
# runs so machine noise hits both. Prints one markdown table of medians.
#   scripts/bench_vs_torch.sh [PYTHON_WITH_TORCH] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:-python3}
rounds=${2:-3}
ref=../shared/bench/torch_llama_cpu.py
[ -f "$ref" ] || { echo "missing $ref" >&2; exit 1; }
cargo build --release -q
out=$(mktemp -d)
for r in $(seq "$rounds"); do
  for shape in "8 256" "4 1024" "1 2048"; do
    set -- $shape
    ./target/release/titan bench train --batch "$1" --seq "$2" --threads 2 --steps 7 --warmup 3 --json >> "$out/titan_$1_$2" 2>> "$out/titan.log"
    "$py" "$ref" --one --batch "$1" --seq "$2" --threads 2 --steps 7 --warmup 3 | grep '^RESULT ' | cut -c8- >> "$out/torch_$1_$2"
  done
done
"$py" - "$out" <<'PY'
import json, statistics, sys, os
d = sys.argv[1]
print("| batch × seq | titan tok/s | PyTorch eager tok/s | ratio | titan GFLOP/s | titan peak RSS MiB | PyTorch peak RSS MiB |")
print("|---|---|---|---|---|---|---|")
for b, s in [(8, 256), (4, 1024), (1, 2048)]:
    t = [json.loads(l) for l in open(os.path.join(d, f"titan_{b}_{s}"))]
    p = [json.loads(l) for l in open(os.path.join(d, f"torch_{b}_{s}"))]
    tt = statistics.median(x["tokens_per_s"] for x in t)
    pt = statistics.median(x["tokens_per_s"] for x in p)
    print(f"| {b} × {s} | {tt:.0f} | {pt:.0f} | {tt/pt:.2f}× | {statistics.median(x['gflops'] for x in t):.0f} | "
          f"{max(x['peak_rss_mib'] for x in t):.0f} | {max(x['peak_rss_mib'] for x in p):.0f} |")
PY
