#!/usr/bin/env bash
# Hardware-counter profile of titan's CUDA kernels, for a lent GPU machine whose Nsight Compute
# (`ncu`) and compute-sanitizer work (Firecracker machines; see the device tool's KINDS.md). Run it
# after scripts/gpu_check.sh has passed, with the same carried binary:
#
#   cargo build --release             # on the CPU machine; carry target/release/titan
#   scripts/gpu_profile.sh            # on the GPU machine: about 3 minutes
#
# 1. compute-sanitizer racecheck and memcheck over `titan cuda check` in bf16 (small shapes: every
#    kernel, the tensor-core attention at head_dim 64 and 128 included).
# 2. ncu on the tensor-core attention kernels (`titan bench attention`, head_dim 64 and 128): speed
#    of light, occupancy, warp stalls and pipe use; then the first GEMMs of a Llama 3 1B step.
# Text reports are written to a work folder and packed into gpu_profile.tar.gz in $OUT (the device
# tool's folder, which returns at most 8 files) when set, else in ./gpu_profile_out; each report's
# last lines are also printed. Not yet run on a GPU: the first session that runs it should fix what
# fails.
set -uo pipefail
cd "$(dirname "$0")/.."

BIN=${TITAN_BIN:-target/release/titan}
if [ ! -x "$BIN" ]; then
  echo "gpu_profile: no titan binary at $BIN (cargo build --release, then carry target/release/titan)" >&2
  exit 2
fi
RESULT_DIR=${OUT:-./gpu_profile_out}
mkdir -p "$RESULT_DIR"
OUT_DIR=$(mktemp -d /tmp/titan_gpu_profile.XXXXXX)
. scripts/gpu_env.sh
export PATH="$PATH:/usr/local/cuda/bin"
NCU=${NCU:-$(command -v ncu || true)}
SANITIZER=${SANITIZER:-$(command -v compute-sanitizer || true)}

run() { # name timeout_s command...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s)"
  timeout --kill-after=5 "$limit" "$@" > "$OUT_DIR/$name.txt" 2>&1
  echo "--- $name: rc $? ($(wc -l < "$OUT_DIR/$name.txt") lines in $OUT_DIR/$name.txt)"
  tail -n 30 "$OUT_DIR/$name.txt"
}

if [ -n "$SANITIZER" ]; then
  check=("$BIN" cuda check --precision bfloat16 --train-steps 0)
  run racecheck 90 "$SANITIZER" --tool racecheck --racecheck-report analysis "${check[@]}"
  run memcheck 90 "$SANITIZER" --tool memcheck "${check[@]}"
else
  echo "gpu_profile: compute-sanitizer not found; skipping race and memory checks"
fi

if [ -n "$NCU" ]; then
  step=("$BIN" bench train --device cuda --precision bfloat16 --flavor 1B --batch 2 --seq 2048 --warmup 0 --steps 1)
  sections=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
            --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis)
  # Each attention kernel's first launch in `titan bench attention` (no model to build): Llama 3
  # 1B's shape for head_dim 64, 8B's for 128. Then the first GEMMs of a training step.
  attn=("$BIN" bench attention --device cuda --precision bfloat16 --warmup 0 --iters 1 --heads 32 --kv-heads 8)
  # (The default head_dim 64 forward is the 32-row one.) The fused backward kernels run with
  # TITAN_CUDA_ATTENTION set to pick them.
  for k in attention_forward_tc64x2 attention_backward_dq_tc64 attention_backward_dkdv_tc64 \
    fused8:attention_backward_fused_tc64w8 fused:attention_backward_fused_tc64; do
    variant=${k%%:*}; [ "$variant" = "$k" ] && variant=""; k=${k#*:}
    run "ncu_$k" 60 env TITAN_CUDA_ATTENTION="$variant" "$NCU" --clock-control none -k "$k" \
      --launch-count 1 "${sections[@]}" "${attn[@]}" --batch 2 --seq 2048 --head-dim 64
  done
  for k in attention_forward_tc128 attention_backward_dk_tc128 attention_backward_dv_tc128 \
    fused8:attention_backward_fused_tc128w8; do
    variant=${k%%:*}; [ "$variant" = "$k" ] && variant=""; k=${k#*:}
    run "ncu_$k" 60 env TITAN_CUDA_ATTENTION="$variant" "$NCU" --clock-control none -k "$k" \
      --launch-count 1 "${sections[@]}" "${attn[@]}" --batch 1 --seq 4096 --head-dim 128
  done
  run ncu_gemm 90 "$NCU" --clock-control none -k 'regex:(gemm|nvjet|xmma)' --launch-count 6 \
    --section SpeedOfLight "${step[@]}"
else
  echo "gpu_profile: ncu not found; skipping the hardware-counter profile"
fi
tar czf "$RESULT_DIR/gpu_profile.tar.gz" -C "$OUT_DIR" . && echo "reports: $RESULT_DIR/gpu_profile.tar.gz"
