#!/usr/bin/env bash
# One call on a lent GPU machine (NVIDIA driver + the pip nvidia-* libraries of its PyTorch, no
# network, maybe no Rust): every op's CUDA-vs-CPU check in fp32 and bf16, the debug model trained 20
# steps on GPU and CPU (and with head_dim 64 and 128 in bf16), FSDP on the GPU against one process,
# bitwise resume and greedy generation on the GPU, a per-op profile of a Llama 3 1B step, the 1B
# benchmark of titan and PyTorch side by side at seq 2048 and 8192, attention alone against
# PyTorch's FlashAttention, and last the fused attention backward (checked, then timed alone and in
# the 1B step). Every stage has its own timeout, cut to the script's budget, so the script ends
# within 8 minutes (about 4 on an H200); the summary is last.
#
# The titan binary is built on the CPU machine and carried with the call:
#   cargo build --release          # then run this script with target/release/titan carried
# Logs and JSON are written to a work folder; at the end they are packed into gpu_check_logs.tar.gz
# and the summary into summary.txt, both in $OUT when set (the device tool's folder, which takes at
# most 8 files), else in ./gpu_check_out. GPU_CHECK_STAGES="check_fp32 titan_1b_s2048" runs only
# the named stages (a rerun after a fix).
set -uo pipefail
cd "$(dirname "$0")/.."

BIN=${TITAN_BIN:-target/release/titan}
if [ ! -x "$BIN" ]; then
  echo "gpu_check: no titan binary at $BIN. Build it on a machine with Rust (cargo build --release)" >&2
  echo "and bring target/release/titan along (the device tool: carry [\"target/release/titan\"])." >&2
  exit 2
fi
RESULT_DIR=${OUT:-./gpu_check_out}
OUT_DIR=$(mktemp -d /tmp/titan_gpu_check.XXXXXX)
mkdir -p "$RESULT_DIR"
STAGES=${GPU_CHECK_STAGES:-all}

. scripts/gpu_env.sh
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
{ echo "python: $PY"; echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"; } | tee "$OUT_DIR/env.txt"

declare -A status
# Whole-script budget: a stage's limit is cut to what is left, and a stage with under 10 s left is
# skipped, so the script (summary included) ends within 8 minutes whatever hangs.
BUDGET_S=${GPU_CHECK_BUDGET_S:-450}
stage() { # name timeout_s command...
  local name=$1 limit=$2; shift 2
  if [ "$STAGES" != all ] && [[ " $STAGES " != *" $name "* ]]; then
    return
  fi
  local left=$((BUDGET_S - SECONDS))
  if [ "$left" -lt 10 ]; then
    status[$name]="SKIPPED (out of time)"
    echo "--- $name: skipped, ${left}s of the ${BUDGET_S}s budget left"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s): $*"
  timeout --kill-after=5 "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT_DIR/$name.log"
  case $rc in
    0) status[$name]="ok" ;;
    124|137) status[$name]="TIMEOUT" ;;
    *) status[$name]="FAILED (rc $rc)" ;;
  esac
  echo "--- $name: ${status[$name]} in $((SECONDS - t0))s"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT_DIR/nvidia-smi.txt" 2>&1 || true
stage info 15 "$BIN" cuda info
stage ptxas 15 "$BIN" cuda compile --arch sm_90 --verbose
# Launches block here so that a failing kernel is reported by its own launch.
stage check_fp32 110 env CUDA_LAUNCH_BLOCKING=1 "$BIN" cuda check --precision float32 --train-steps 20 --json-out "$OUT_DIR/check_fp32.json"
stage nccl 20 "$BIN" cuda nccl-check
# FSDP on CUDA (two ranks sharing the GPU, collectives through host copies) against one process.
common="--quiet --training.device cuda --training.mixed_precision_param float32 --training.steps 10 --checkpoint.enable false --metrics.log_freq 1"
rm -rf "$OUT_DIR/one" "$OUT_DIR/fsdp2"
stage fsdp_cuda 45 sh -c "'$BIN' train $common --training.local_batch_size 8 --job.dump_folder '$OUT_DIR/one' && '$BIN' train --nproc 2 $common --training.local_batch_size 4 --job.dump_folder '$OUT_DIR/fsdp2'"
# DDP the same way (host path: NCCL refuses two ranks on one GPU).
rm -rf "$OUT_DIR/ddp2"
stage ddp_cuda 30 "$BIN" train --nproc 2 $common --training.local_batch_size 4 --parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 1 --job.dump_folder "$OUT_DIR/ddp2"
# TP 2 on one GPU: the blocks in one rank's shapes on CUDA (ids of the other rank's vocabulary give
# zero embedding rows), the TP collectives through the host; same loss as the `one` run above.
rm -rf "$OUT_DIR/tp2"
stage tp_cuda 30 "$BIN" train --nproc 2 $common --training.local_batch_size 8 --parallelism.tensor_parallel_degree 2 --parallelism.data_parallel_shard_degree 1 --job.dump_folder "$OUT_DIR/tp2"
# Async TP: chunked gathers and reduce-scatters (strided row copies on the GPU) on a host queue.
# With two GPUs or more the TP rows would go through NCCL instead; one GPU cannot check that path.
rm -rf "$OUT_DIR/tp2_async"
stage tp_async_cuda 30 "$BIN" train --nproc 2 $common --training.local_batch_size 8 --parallelism.tensor_parallel_degree 2 --parallelism.data_parallel_shard_degree 1 --parallelism.enable_async_tensor_parallel true --job.dump_folder "$OUT_DIR/tp2_async"
# PP 2 on one GPU: two stages (each rank its stages' weights on the GPU), ZBV zero-bubble schedule
# with the deferred weight-gradient GEMMs, activations and gradients between ranks through the
# host; 8 sequences in 8 microbatches, same loss as the `one` run above.
rm -rf "$OUT_DIR/pp2"
stage pp_cuda 40 "$BIN" train --nproc 2 $common --training.local_batch_size 8 --parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule ZBVZeroBubble --parallelism.data_parallel_shard_degree 1 --job.dump_folder "$OUT_DIR/pp2"
# CP 2 on one GPU: each rank half of every sequence (head-tail chunks), ring attention blocks
# (attention with a query offset, the fp32 kernels' backward of a block, attention_merge) on CUDA,
# K/V exchanged through the host (allgather, then alltoall); same loss as the `one` run above.
rm -rf "$OUT_DIR/cp2" "$OUT_DIR/cp2_a2a"
stage cp_cuda 50 sh -c "'$BIN' train --nproc 2 $common --training.local_batch_size 8 --parallelism.context_parallel_degree 2 --parallelism.data_parallel_shard_degree 1 --job.dump_folder '$OUT_DIR/cp2' && '$BIN' train --nproc 2 $common --training.local_batch_size 8 --parallelism.context_parallel_degree 2 --parallelism.context_parallel_rotate_method alltoall --parallelism.data_parallel_shard_degree 1 --job.dump_folder '$OUT_DIR/cp2_a2a'"
# Qwen3-MoE on CUDA (QK-norm, 8 experts top-2: the routing kernels of kernels/routing.cu, the
# dispatch order, the gathers, the grouped expert GEMMs of kernels/grouped_gemm.cu and the combine
# on the device, no host copy in a block) against the same run on the CPU; `deepseek_cuda` below routes DeepSeek-V3's
# biased, group-limited sigmoid router on the device too.
rm -rf "$OUT_DIR/moe_gpu" "$OUT_DIR/moe_cpu"
moe="--quiet --training.mixed_precision_param float32 --training.steps 10 --checkpoint.enable false --metrics.log_freq 1 --model.name qwen3 --model.flavor debugmodel_moe --training.local_batch_size 4"
stage moe_cuda 60 sh -c "'$BIN' train $moe --training.device cuda --job.dump_folder '$OUT_DIR/moe_gpu' && '$BIN' train $moe --training.device cpu --job.dump_folder '$OUT_DIR/moe_cpu'"
# The host↔device copies a step makes (`host_device_copies_per_step`): the MoE debug model against
# the dense one of the same shapes; the difference must be none (routing, dispatch order, grouped
# expert GEMMs, combine and the load count stay on the GPU), and with the sequence-wise auxiliary
# loss (its figures, balance and gradient kernels of kernels/moe_aux.cu) none either.
stage moe_copies_cuda 60 sh -c "for f in debugmodel debugmodel_moe; do '$BIN' bench train --device cuda --precision float32 --config configs/qwen3_debugmodel.toml --flavor \$f --batch 2 --seq 128 --warmup 1 --steps 2 --json > '$OUT_DIR'/copies_\$f.json || exit 1; done && '$BIN' bench train --device cuda --precision float32 --config configs/qwen3_debugmodel.toml --flavor debugmodel_moe --batch 2 --seq 128 --warmup 1 --steps 2 --json --model.router_aux_loss_coef 0.01 > '$OUT_DIR'/copies_debugmodel_moe_aux.json"
# Two GPUs or more (issue 45): the device road between GPUs, NCCL attached to the mesh groups,
# each layout against one process (`one`, `moe_cpu` above). PP 2 (1F1B and ZBV) sends its stage
# transfers over the pipeline group's NCCL channels (one communicator and stream per direction);
# CP 2 `alltoall` shifts the ring through NCCL's all-to-all; EP 2 moves the rows the same way.
# Each run must say its collectives went through NCCL. One GPU skips these stages.
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "${ngpu:-0}" -ge 2 ]; then
  gpus=$(echo "$common" | sed 's/--quiet //')
  rm -rf "$OUT_DIR"/nccl_*
  nccl_cmd() { # folder, then train flags: the command line of a run that must take NCCL
    local folder=$1; shift
    echo "'$BIN' train --nproc 2 $gpus --job.dump_folder '$OUT_DIR/$folder' $* > '$OUT_DIR/$folder.train.log' 2>&1 && grep -q 'collectives on the GPUs through NCCL' '$OUT_DIR/$folder.train.log'"
  }
  stage nccl_fsdp2 40 sh -c "$(nccl_cmd nccl_fsdp2 --training.local_batch_size 4)"
  stage nccl_tp2 40 sh -c "$(nccl_cmd nccl_tp2 --training.local_batch_size 8 --parallelism.tensor_parallel_degree 2 --parallelism.data_parallel_shard_degree 1)"
  stage nccl_pp2 40 sh -c "$(nccl_cmd nccl_pp2 --training.local_batch_size 8 --parallelism.pipeline_parallel_degree 2 --parallelism.data_parallel_shard_degree 1)"
  stage nccl_pp2_zbv 40 sh -c "$(nccl_cmd nccl_pp2_zbv --training.local_batch_size 8 --parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule ZBVZeroBubble --parallelism.data_parallel_shard_degree 1)"
  stage nccl_cp2 40 sh -c "$(nccl_cmd nccl_cp2 --training.local_batch_size 8 --parallelism.context_parallel_degree 2 --parallelism.context_parallel_rotate_method alltoall --parallelism.data_parallel_shard_degree 1)"
  moe_gpus=$(echo "$moe" | sed 's/--quiet //; s/--training.local_batch_size 4//')
  gpus="$moe_gpus --training.device cuda"
  stage nccl_ep2 60 sh -c "$(nccl_cmd nccl_ep2 --training.local_batch_size 2 --parallelism.expert_parallel_degree 2)"
fi
# Block-causal attention over packed documents on CUDA (issue 43: per-token RoPE tables, the
# one-warp-per-row attention kernels with document positions), alone and under CP 2 (blocks wholly
# before a query's document), against the same run on the CPU; seq 256 holds several documents.
# Then in bf16 with head_dim 64, where the tensor-core kernels take the documents (their forward,
# dQ and dK/dV passes; the check_bf16 stages' `documents` rows compare them op by op).
rm -rf "$OUT_DIR/docs_gpu" "$OUT_DIR/docs_cpu" "$OUT_DIR/docs_cp2_gpu" "$OUT_DIR"/docs_tc_*
docs="--quiet --training.mixed_precision_param float32 --training.steps 10 --checkpoint.enable false --metrics.log_freq 1 --model.attn_mask_type block_causal --training.local_batch_size 4"
stage documents_cuda 60 sh -c "'$BIN' train $docs --training.device cuda --job.dump_folder '$OUT_DIR/docs_gpu' && '$BIN' train $docs --training.device cpu --job.dump_folder '$OUT_DIR/docs_cpu' && '$BIN' train --nproc 2 $docs --training.device cuda --parallelism.context_parallel_degree 2 --parallelism.data_parallel_shard_degree 1 --job.dump_folder '$OUT_DIR/docs_cp2_gpu'"
docs_tc="--quiet --training.steps 10 --checkpoint.enable false --metrics.log_freq 1 --model.attn_mask_type block_causal --training.local_batch_size 4 --model.n_heads 4 --model.n_kv_heads 2"
stage documents_tc_cuda 60 sh -c "'$BIN' train $docs_tc --training.mixed_precision_param bfloat16 --training.device cuda --job.dump_folder '$OUT_DIR/docs_tc_gpu' && '$BIN' train $docs_tc --training.mixed_precision_param float32 --training.device cpu --job.dump_folder '$OUT_DIR/docs_tc_cpu'"
# LoRA on CUDA (issue 43: the adapters' GEMMs beside each projection's, frozen weights without
# gradients: the fused loss skips the output weight's), in fp32 and bf16, against the CPU.
rm -rf "$OUT_DIR/lora_gpu" "$OUT_DIR/lora_cpu" "$OUT_DIR/lora_bf16_gpu"
lora="--quiet --training.steps 10 --checkpoint.enable false --metrics.log_freq 1 --model.converters lora --optimizer.lr 1e-2 --training.local_batch_size 4"
stage lora_cuda 60 sh -c "'$BIN' train $lora --training.mixed_precision_param float32 --training.device cuda --job.dump_folder '$OUT_DIR/lora_gpu' && '$BIN' train $lora --training.mixed_precision_param float32 --training.device cpu --job.dump_folder '$OUT_DIR/lora_cpu' && '$BIN' train $lora --training.mixed_precision_param bfloat16 --training.device cuda --job.dump_folder '$OUT_DIR/lora_bf16_gpu'"
# bf16 residual stream (issue 41): block outputs stored as bf16 pairs through the pack/unpack
# kernels FSDP's gathers use, read back for the recompute under full AC; one process and FSDP 2,
# against the same bf16 run on the CPU (which computes the blocks' GEMMs in f32: bf16 tolerance).
rm -rf "$OUT_DIR"/resid_bf16_*
resid="--quiet --training.mixed_precision_param bfloat16 --training.steps 10 --checkpoint.enable false --metrics.log_freq 1 --activation_checkpoint.mode full --training.local_batch_size 4"
stage residual_bf16_cuda 60 sh -c "'$BIN' train $resid --training.device cuda --job.dump_folder '$OUT_DIR/resid_bf16_gpu' && '$BIN' train $resid --training.device cpu --job.dump_folder '$OUT_DIR/resid_bf16_cpu' && '$BIN' train --nproc 2 $resid --training.local_batch_size 2 --training.device cuda --job.dump_folder '$OUT_DIR/resid_bf16_fsdp2_gpu'"
# bf16 kept activations (issue 41): each block's activations rounded where produced and kept as
# bf16 pairs, unpacked into the shared set before the backward (bf16-alone GEMM operands copied
# as they are); no AC and per-op AC (kept and recomputed ones mixed), against the CPU's same run.
rm -rf "$OUT_DIR"/kept_bf16_*
kept="--quiet --training.mixed_precision_param bfloat16 --training.steps 10 --checkpoint.enable false --metrics.log_freq 1 --training.local_batch_size 4"
stage kept_bf16_cuda 60 sh -c "'$BIN' train $kept --activation_checkpoint.mode none --training.device cuda --job.dump_folder '$OUT_DIR/kept_bf16_gpu' && '$BIN' train $kept --activation_checkpoint.mode none --training.device cpu --job.dump_folder '$OUT_DIR/kept_bf16_cpu' && '$BIN' train $kept --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op --training.device cuda --job.dump_folder '$OUT_DIR/kept_bf16_op_gpu'"
# Muon (issue 46) on CUDA: the Newton-Schulz iteration through the device's GEMMs (the check
# stages' `muon newton_schulz` rows compare it alone), fp32 and bf16 state, against the CPU; and
# FSDP 2 on one GPU (the matrices exchanged through the host, each orthogonalised by one rank).
rm -rf "$OUT_DIR"/muon_*
muon="--quiet --training.mixed_precision_param float32 --training.steps 10 --checkpoint.enable false --metrics.log_freq 1 --optimizer.name Muon --optimizer.lr 2e-2 --optimizer.adamw_lr 1e-3 --optimizer.ns_dtype float32 --training.local_batch_size 4"
stage muon_cuda 75 sh -c "'$BIN' train $muon --training.device cuda --job.dump_folder '$OUT_DIR/muon_gpu' && '$BIN' train $muon --training.device cpu --job.dump_folder '$OUT_DIR/muon_cpu' && '$BIN' train $muon --optimizer.state_dtype bfloat16 --training.device cuda --job.dump_folder '$OUT_DIR/muon_bf16_state_gpu' && '$BIN' train $muon --optimizer.state_dtype bfloat16 --training.device cpu --job.dump_folder '$OUT_DIR/muon_bf16_state_cpu' && '$BIN' train --nproc 2 $muon --training.local_batch_size 2 --training.device cuda --job.dump_folder '$OUT_DIR/muon_fsdp2_gpu'"
# Expert parallelism on CUDA: 2 ranks (on one GPU: rows and collectives through the host), each
# with 4 of the 8 experts and half the batch, against the one-process CPU run above.
rm -rf "$OUT_DIR/ep2_gpu"
stage ep_cuda 60 "$BIN" train --nproc 2 $moe --training.device cuda --training.local_batch_size 2 --parallelism.expert_parallel_degree 2 --job.dump_folder "$OUT_DIR/ep2_gpu"
# DeepSeek-V3 on CUDA (issue 29): multi-head latent attention (heads padded to 192, the latents'
# norms, strided head copies, the shared rotated key's gradient summed over heads), shared experts
# after a dense block, YaRN; alone and under TP 2 (heads split, latents replicated), against the
# same run on the CPU.
rm -rf "$OUT_DIR/ds_gpu" "$OUT_DIR/ds_cpu" "$OUT_DIR/ds_tp2_gpu"
ds="--quiet --training.mixed_precision_param float32 --training.steps 10 --checkpoint.enable false --metrics.log_freq 1 --model.name deepseek_v3 --model.n_layers 2 --training.local_batch_size 4 --training.seq_len 128 --model.router_aux_loss_coef 0.01"
stage deepseek_cuda 75 sh -c "'$BIN' train $ds --training.device cuda --job.dump_folder '$OUT_DIR/ds_gpu' && '$BIN' train $ds --training.device cpu --job.dump_folder '$OUT_DIR/ds_cpu' && '$BIN' train --nproc 2 $ds --training.device cuda --parallelism.tensor_parallel_degree 2 --parallelism.data_parallel_shard_degree 1 --job.dump_folder '$OUT_DIR/ds_tp2_gpu'"
# gpt-oss on CUDA (issue 45): attention sinks over sliding windows, biased projections, the
# experts' biases as grouped GEMMs of depth one and the clamped SwiGLU's kernels, against the
# same run on the CPU; and its copies per step against the dense Qwen3's of `moe_copies_cuda`
# (the difference must be none).
rm -rf "$OUT_DIR/gptoss_gpu" "$OUT_DIR/gptoss_cpu"
gptoss="--quiet --training.mixed_precision_param float32 --training.steps 10 --checkpoint.enable false --metrics.log_freq 1 --model.name gpt_oss --model.flavor debugmodel --training.local_batch_size 4 --training.seq_len 128"
stage gpt_oss_cuda 60 sh -c "'$BIN' train $gptoss --training.device cuda --job.dump_folder '$OUT_DIR/gptoss_gpu' && '$BIN' train $gptoss --training.device cpu --job.dump_folder '$OUT_DIR/gptoss_cpu' && '$BIN' bench train --device cuda --precision float32 --config configs/gpt_oss_debugmodel.toml --batch 2 --seq 128 --warmup 1 --steps 2 --json > '$OUT_DIR'/copies_gpt_oss.json"
# Float8 linears, emulated on CUDA (issue 28: the casts run in the NVRTC kernels of
# kernels/float8.cu, whose numbers the `cuda check` stages' float8 rows hold to the CPU's bit for
# bit; the GEMMs multiply the dequantised values in fp32): rowwise and tensorwise, 5 steps each,
# against the CPU's runs (same numerics; the fp32 GEMMs differ only in summation order).
rm -rf "$OUT_DIR"/f8_* "$OUT_DIR"/mx_*
low="--quiet --training.mixed_precision_param float32 --training.steps 5 --checkpoint.enable false --metrics.log_freq 1"
f8="$low --model.converters quantize.linear.float8"
stage float8_emulated_cuda 60 sh -c "for r in rowwise tensorwise; do for d in cuda cpu; do '$BIN' train $f8 --quantize.linear.float8.emulate true --quantize.linear.float8.recipe_name \$r --training.device \$d --job.dump_folder '$OUT_DIR'/f8_\${r}_\$d || exit 1; done; done"
# The same with float8 GEMMs (emulate = false, sm_89+): cuBLASLt multiplies the casts' codes on
# float8 tensor cores and float8_scale_product scales the products back (the GEMM rows of the
# check_fp32 stage compare each GEMM and count which ran in float8); the losses against the CPU's.
stage float8_cuda 45 sh -c "for r in rowwise tensorwise; do '$BIN' train $f8 --quantize.linear.float8.emulate false --quantize.linear.float8.recipe_name \$r --training.device cuda --job.dump_folder '$OUT_DIR'/f8_\${r}_fp8 || exit 1; done"
# The output head in float8 too (filter_fqns empty): its whole logits through a float8 GEMM and the
# loss kernel over them (Backend::cross_entropy_of_logits), rowwise, against the CPU's run.
stage float8_head_cuda 45 sh -c "for d in cuda cpu; do '$BIN' train $f8 --quantize.linear.float8.filter_fqns , --training.device \$d --job.dump_folder '$OUT_DIR'/f8_head_\$d || exit 1; done"
# FSDP 2 gathering the weights in float8 (tensorwise) with float8 GEMMs on CUDA (each gathered
# weight cast again for its codes), against the same layout on the CPU.
f8ag="$f8 --quantize.linear.float8.recipe_name tensorwise --quantize.linear.float8.enable_fsdp_float8_all_gather true --training.local_batch_size 4"
stage float8_fsdp_cuda 60 sh -c "for d in cuda cpu; do '$BIN' train --nproc 2 $f8ag --training.device \$d --job.dump_folder '$OUT_DIR'/f8_fsdp_\$d || exit 1; done"
# MXFP8 emulated on CUDA (the casts in kernels/float8.cu's mx_fake_quantize, which the check_fp32
# stage's mx rows hold to the CPU's bit for bit), RCEIL linears 5 steps against the CPU's run; and
# an MXFP8 GEMM recipe must be refused naming the GPU (titan has no block-scaled GEMMs yet).
mx="$low --model.converters quantize.linear.mx --quantize.linear.mx.recipe_name mxfp8_emulated_rceil"
stage mx_emulated_cuda 60 sh -c "for d in cuda cpu; do '$BIN' train $mx --training.device \$d --job.dump_folder '$OUT_DIR'/mx_\$d || exit 1; done; ! '$BIN' train $low --model.converters quantize.linear.mx --training.device cuda --job.dump_folder '$OUT_DIR'/mx_refused > '$OUT_DIR'/mx_refused.txt 2>&1 && grep -q 'MXFP8 GEMMs on CUDA' '$OUT_DIR'/mx_refused.txt"
# bf16: attention on tensor cores, trained with head_dim 64 (4 heads, GQA) and 128 (2 heads).
stage check_bf16 60 "$BIN" cuda check --precision bfloat16 --train-steps 20 --model-heads 4 --model-kv-heads 2 --json-out "$OUT_DIR/check_bf16.json"
stage check_bf16_hd128 60 "$BIN" cuda check --precision bfloat16 --train-steps 20 --model-heads 2 --model-kv-heads 1 --json-out "$OUT_DIR/check_bf16_hd128.json"
# A failed bf16 check: retry without the bf16 activation copies, then with the 16-row attention
# forward, then with the fp32 attention kernels and no copies, and run the benchmarks below with
# the first that passes (so one broken kernel does not waste the call). Each retry reruns the
# failed checks (every op, then the model with head_dim 64 and/or 128).
if [ "${status[check_bf16]:-ok}" != ok ] || [ "${status[check_bf16_hd128]:-ok}" != ok ]; then
  for fallback in nocopies narrow exact; do
    case $fallback in
      nocopies) settings="TITAN_CUDA_BF16_COPIES=off" ;;
      narrow) settings="TITAN_CUDA_ATTENTION=narrow" ;;
      exact) settings="TITAN_CUDA_ATTENTION=exact TITAN_CUDA_BF16_COPIES=off" ;;
    esac
    retry="env $settings '$BIN' cuda check --precision bfloat16 --train-steps 20"
    checks="true"
    [ "${status[check_bf16]:-ok}" != ok ] && checks="$checks && $retry --model-heads 4 --model-kv-heads 2 --json-out '$OUT_DIR/check_bf16_$fallback.json'"
    [ "${status[check_bf16_hd128]:-ok}" != ok ] && checks="$checks && $retry --model-heads 2 --model-kv-heads 1 --json-out '$OUT_DIR/check_bf16_hd128_$fallback.json'"
    stage "check_bf16_$fallback" 70 sh -c "$checks"
    if [ "${status[check_bf16_$fallback]:-}" = ok ]; then
      export $settings
      echo "gpu_check: benchmarks run with $settings"
      break
    fi
  done
fi
# Bitwise resume on the GPU (20 steps straight against 10 + resume + 10), then greedy generation
# from the result on the GPU and on the CPU. GPU_CHECK_DEVICE=cpu dry-runs these two stages.
dev=${GPU_CHECK_DEVICE:-cuda}
rc="--quiet --training.device $dev --training.mixed_precision_param float32 --lr_scheduler.warmup_steps 2 --lr_scheduler.decay_ratio 0 --checkpoint.interval 10 --metrics.log_freq 1 --training.local_batch_size 4 --training.seq_len 128"
rm -rf "$OUT_DIR/straight" "$OUT_DIR/resumed"
stage resume_cuda 40 sh -c "'$BIN' train $rc --training.steps 20 --job.dump_folder '$OUT_DIR/straight' && '$BIN' train $rc --training.steps 10 --job.dump_folder '$OUT_DIR/resumed' && '$BIN' train $rc --training.steps 20 --job.dump_folder '$OUT_DIR/resumed'"
gen="'$BIN' generate --checkpoint '$OUT_DIR/straight' --prompt 'The ' --max-new-tokens 40 --json"
stage generate_cuda 30 sh -c "$gen --device $dev > '$OUT_DIR/generate_gpu.json' && $gen --device cpu > '$OUT_DIR/generate_cpu.json'"
# Where a step goes: every op timed on its own (the GPU waits after each, so slower than the bench).
stage titan_1b_profile 60 "$BIN" bench train --device cuda --precision bfloat16 --flavor 1B --batch 8 --seq 2048 --warmup 1 --steps 1 --profile-ops
stage titan_1b_s2048 70 sh -c "'$BIN' bench train --device cuda --precision bfloat16 --flavor 1B --batch 8 --seq 2048 --warmup 1 --steps 4 --json > '$OUT_DIR/titan_1b_s2048.json'"
# Float8 linears with float8 GEMMs against the bf16 step above (TorchTitan: +28% on 8B, H100).
stage titan_1b_s2048_float8 90 sh -c "for r in rowwise tensorwise; do '$BIN' bench train --device cuda --precision bfloat16 --flavor 1B --batch 8 --seq 2048 --warmup 1 --steps 4 --json --float8 \$r > '$OUT_DIR'/titan_float8_\${r}_1b_s2048.json || exit 1; done"
stage torch_1b_s2048 45 sh -c "'$PY' scripts/torch_llama_gpu.py --flavor 1B --batch 8 --seq 2048 --warmup 3 --steps 10 > '$OUT_DIR/torch_1b_s2048.json'"
stage titan_1b_s8192 70 sh -c "'$BIN' bench train --device cuda --precision bfloat16 --flavor 1B --batch 2 --seq 8192 --warmup 1 --steps 2 --json > '$OUT_DIR/titan_1b_s8192.json'"
stage torch_1b_s8192 45 sh -c "'$PY' scripts/torch_llama_gpu.py --flavor 1B --batch 2 --seq 8192 --warmup 3 --steps 10 > '$OUT_DIR/torch_1b_s8192.json'"
# Attention alone against PyTorch's FlashAttention: Llama 3 1B's shape, and 8B's (head_dim 128) at 8192.
attn_shapes="'--batch 8 --seq 2048 --heads 32 --kv-heads 8 --head-dim 64' '--batch 1 --seq 8192 --heads 32 --kv-heads 8 --head-dim 128'"
stage attn_titan 40 sh -c "for s in $attn_shapes; do '$BIN' bench attention --device cuda --precision bfloat16 --iters 10 --json \$s || exit 1; done > '$OUT_DIR/attn_titan.jsonl'"
stage attn_torch 40 sh -c "for s in $attn_shapes; do '$PY' scripts/torch_attention_gpu.py --iters 10 \$s || exit 1; done > '$OUT_DIR/attn_torch.jsonl'"
# The head_dim 64 forward with 16 rows per warp instead of 32 (TITAN_CUDA_ATTENTION=narrow), to compare.
stage attn_titan_narrow 20 sh -c "TITAN_CUDA_ATTENTION=narrow '$BIN' bench attention --device cuda --precision bfloat16 --iters 10 --json --batch 8 --seq 2048 --heads 32 --kv-heads 8 --head-dim 64 > '$OUT_DIR/attn_titan_narrow.jsonl'"
# The fused attention backward (one pass, dQ added by turns; TITAN_CUDA_ATTENTION=fused: 64 keys
# per block, fused8: 128; `unordered`: racing additions), checked like the default kernels at
# head_dim 64 and 128, then timed alone and in the 1B step.
fused_check="'$BIN' cuda check --precision bfloat16 --train-steps 20"
fused_checks="true"
for variant in fused fused8; do
  fused_checks="$fused_checks && TITAN_CUDA_ATTENTION=$variant $fused_check --model-heads 4 --model-kv-heads 2 --json-out '$OUT_DIR/check_bf16_$variant.json'"
  fused_checks="$fused_checks && TITAN_CUDA_ATTENTION=$variant $fused_check --model-heads 2 --model-kv-heads 1 --json-out '$OUT_DIR/check_bf16_hd128_$variant.json'"
done
stage check_bf16_fused 120 sh -c "$fused_checks"
if [ "${status[check_bf16_fused]:-}" = ok ]; then
  attn="--device cuda --precision bfloat16 --iters 10 --json"
  stage attn_titan_fused 80 sh -c "for v in fused fused8 fused8,unordered; do for s in $attn_shapes; do TITAN_CUDA_ATTENTION=\$v '$BIN' bench attention $attn \$s >> '$OUT_DIR'/attn_titan_\$(echo \$v | tr , _).jsonl || exit 1; done; done"
  stage titan_1b_s2048_fused8 70 sh -c "TITAN_CUDA_ATTENTION=fused8 '$BIN' bench train --device cuda --precision bfloat16 --flavor 1B --batch 8 --seq 2048 --warmup 1 --steps 4 --json > '$OUT_DIR/titan_fused8_1b_s2048.json'"
  stage titan_1b_s8192_fused8 70 sh -c "TITAN_CUDA_ATTENTION=fused8 '$BIN' bench train --device cuda --precision bfloat16 --flavor 1B --batch 2 --seq 8192 --warmup 1 --steps 2 --json > '$OUT_DIR/titan_fused8_1b_s8192.json'"
fi
# Without the bf16 copies that norm, attention and SwiGLU kernels write for the GEMMs (7.5 GiB at
# this shape), to see what they buy.
stage titan_1b_s2048_nocopies 70 sh -c "TITAN_CUDA_BF16_COPIES=off '$BIN' bench train --device cuda --precision bfloat16 --flavor 1B --batch 8 --seq 2048 --warmup 1 --steps 4 --json > '$OUT_DIR/titan_nocopies_1b_s2048.json'"
# Activation checkpointing at the same shape: the time each mode's recompute costs and the memory
# it saves (peak device memory beside the estimate).
stage titan_1b_s2048_ac_full 70 sh -c "'$BIN' bench train --device cuda --precision bfloat16 --flavor 1B --batch 8 --seq 2048 --warmup 1 --steps 4 --json --activation_checkpoint.mode full > '$OUT_DIR/titan_acfull_1b_s2048.json'"
stage titan_1b_s2048_ac_op 70 sh -c "'$BIN' bench train --device cuda --precision bfloat16 --flavor 1B --batch 8 --seq 2048 --warmup 1 --steps 4 --json --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op > '$OUT_DIR/titan_acop_1b_s2048.json'"
stage titan_1b_s2048_ac_every2 70 sh -c "'$BIN' bench train --device cuda --precision bfloat16 --flavor 1B --batch 8 --seq 2048 --warmup 1 --steps 4 --json --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option 2 > '$OUT_DIR/titan_acevery2_1b_s2048.json'"

summarize() {
echo
echo "================ titan GPU check summary ($(date -u +%Y-%m-%dT%H:%MZ)) ================"
echo "GPU: $(cat "$OUT_DIR/nvidia-smi.txt" 2>/dev/null | head -n 1)"
for s in info ptxas check_fp32 nccl fsdp_cuda ddp_cuda tp_cuda tp_async_cuda pp_cuda cp_cuda moe_cuda moe_copies_cuda gpt_oss_cuda documents_cuda documents_tc_cuda lora_cuda residual_bf16_cuda kept_bf16_cuda muon_cuda ep_cuda deepseek_cuda float8_emulated_cuda float8_cuda float8_head_cuda float8_fsdp_cuda mx_emulated_cuda check_bf16 check_bf16_hd128 check_bf16_nocopies check_bf16_narrow check_bf16_exact resume_cuda generate_cuda titan_1b_profile titan_1b_s2048 titan_1b_s2048_float8 torch_1b_s2048 titan_1b_s8192 torch_1b_s8192 attn_titan attn_torch attn_titan_narrow check_bf16_fused attn_titan_fused titan_1b_s2048_fused8 titan_1b_s2048_nocopies titan_1b_s8192_fused8 titan_1b_s2048_ac_full titan_1b_s2048_ac_op titan_1b_s2048_ac_every2; do
  printf '  %-16s %s\n' "$s" "${status[$s]:-not run}"
  case ${status[$s]:-} in
    ok|"") ;;
    *) grep -v '^\s*$' "$OUT_DIR/$s.log" 2>/dev/null | tail -n 3 | cut -c1-300 | sed 's/^/      | /' ;;
  esac
done
grep -h "NCCL one-rank" "$OUT_DIR/nccl.log" 2>/dev/null
[ -n "${TITAN_CUDA_ATTENTION:-}${TITAN_CUDA_BF16_COPIES:-}" ] && echo "benchmarks ran with TITAN_CUDA_ATTENTION=${TITAN_CUDA_ATTENTION:-} TITAN_CUDA_BF16_COPIES=${TITAN_CUDA_BF16_COPIES:-}"
if [ -s "$OUT_DIR/titan_1b_profile.log" ]; then
  echo "titan 1B step by op (profiled: the GPU waits after each op):"
  sed -n '/^op  /,$p' "$OUT_DIR/titan_1b_profile.log" | head -n 26 | sed 's/^/    /'
fi
"$PY" - "$OUT_DIR" <<'PYEOF'
# Each section reports on its own: a missing or odd result (a NaN written as null, a run that
# stopped early) prints "no result" or FAIL for that section and the rest still print.
import json, math, os, sys
out = sys.argv[1]
def num(x):
    return float("nan") if x is None else float(x)
def first_last(xs):
    return (f"{xs[0]:.4f}->{xs[-1]:.4f}") if xs else "none"
def load(name):
    try:
        with open(os.path.join(out, name)) as f:
            text = f.read().strip()
        return json.loads(text.splitlines()[-1]) if name.endswith("s2048.json") or name.endswith("s8192.json") else json.loads(text)
    except Exception:
        return None
def section(report):
    try:
        report()
    except Exception as e:
        print(f"  (summary section failed: {e!r})")
def ops_report(prec):
    c = load(f"check_{prec}.json")
    if not c:
        print(f"ops ({prec}): no result")
        return
    ops = c["ops"]
    bad = [o for o in ops if not o["passed"]]
    worst = max(ops, key=lambda o: math.inf if math.isnan(num(o["rel_err"])) else num(o["rel_err"]))
    print(f"ops ({prec}): {len(ops) - len(bad)}/{len(ops)} within tolerance; worst {worst['op']} {num(worst['rel_err']):.2e}")
    for o in bad:
        print(f"    FAIL {o['op']}: {num(o['rel_err']):.2e} > {num(o['tolerance']):.0e}")
    t = c.get("training")
    if t:
        print(f"training ({prec}): {t['steps']} steps, loss CPU {first_last(t['cpu'])}, "
              f"CUDA {first_last(t['cuda'])}, max rel diff {num(t['max_rel_diff']):.2e} "
              f"({'ok' if t['passed'] else 'FAIL'})")
        if t.get("cuda_error"):
            print(f"    CUDA run failed: {t['cuda_error']}")
for prec in ("fp32", "bf16", "bf16_hd128", "bf16_nocopies", "bf16_hd128_nocopies", "bf16_narrow", "bf16_hd128_narrow", "bf16_exact", "bf16_hd128_exact",
             "bf16_fused", "bf16_hd128_fused", "bf16_fused8", "bf16_hd128_fused8"):
    # The fallback checks run only after a failed bf16 check; the fused ones at the end.
    if prec in ("fp32", "bf16", "bf16_hd128") or os.path.exists(os.path.join(out, f"check_{prec}.json")):
        section(lambda: ops_report(prec))
def curve(d):
    try:
        with open(os.path.join(out, d, "metrics.jsonl")) as f:
            return [json.loads(l)["loss"] for l in f]
    except Exception:
        return None
def resume_report():
    straight, resumed = curve("straight"), curve("resumed")
    if straight and resumed and len(straight) == len(resumed) == 20:
        same = straight[10:] == resumed[10:]
        print(f"resume on the GPU: steps 11-20 after resuming at 10 {'bitwise equal (ok)' if same else 'DIFFER (FAIL)'} "
              f"to the straight run (loss {straight[-1]:.4f})")
    else:
        print("resume on the GPU: no result")
def generate_report():
    try:
        gpu_ids = json.load(open(os.path.join(out, "generate_gpu.json")))["generated_ids"]
        cpu_ids = json.load(open(os.path.join(out, "generate_cpu.json")))["generated_ids"]
    except Exception:
        print("generation on the GPU: no result")
        return
    agree = sum(1 for a, b in zip(gpu_ids, cpu_ids) if a == b)
    print(f"greedy generation, 40 tokens: GPU and CPU agree on {agree} of {len(cpu_ids)} "
          f"({'ok' if gpu_ids == cpu_ids else 'FAIL'})")
def fsdp_report():
    one = curve("one")
    layouts = [("FSDP", "fsdp2"), ("DDP", "ddp2"), ("TP", "tp2"), ("async TP", "tp2_async"), ("PP (ZBV)", "pp2"), ("CP allgather", "cp2"), ("CP alltoall", "cp2_a2a")]
    if os.path.isdir(os.path.join(out, "nccl_fsdp2")):
        layouts += [("FSDP over NCCL, two GPUs,", "nccl_fsdp2"), ("TP over NCCL, two GPUs,", "nccl_tp2"),
                    ("PP 1F1B over NCCL channels, two GPUs,", "nccl_pp2"), ("PP ZBV over NCCL channels, two GPUs,", "nccl_pp2_zbv"),
                    ("CP alltoall over NCCL, two GPUs,", "nccl_cp2")]
    for layout, folder in layouts:
        two = curve(folder)
        if one and two and len(one) == len(two):
            diff = max(abs(a - b) / abs(a) for a, b in zip(one, two))
            print(f"{layout} 2 ranks on CUDA vs 1 process, {len(one)} steps fp32: max rel loss diff {diff:.2e} "
                  f"({'ok' if diff <= 1e-4 else 'FAIL'})")
        else:
            print(f"{layout} on CUDA: no result")
def bench_report():
    print()
    print(f"{'Llama 3 1B, bf16':<22} {'impl':<14} {'tok/s':>9} {'TFLOP/s':>8} {'MFU %':>6} {'peak MiB':>9} {'step s':>7}")
    for seq, batch in ((2048, 8), (8192, 2)):
        optional = ("titan_fused8", "titan_nocopies", "titan_acop", "titan_acevery2", "titan_acfull", "titan_float8_rowwise", "titan_float8_tensorwise")
        for impl in ("titan", *optional, "torch"):
            r = load(f"{impl}_1b_s{seq}.json")
            label = f"batch {batch} x seq {seq}"
            if not r and impl in optional:
                continue
            if not r:
                print(f"{label:<22} {impl:<14} {'no result':>9}")
                continue
            print(f"{label:<22} {impl:<14} {r['tokens_per_s']:>9.0f} {r['tflops']:>8.1f} {r['mfu_pct']:>6.1f} "
                  f"{num(r.get('peak_device_mib') or 0):>9.0f} {r['step_s_median']:>7.3f}")
def attention_report():
    print()
    print(f"{'attention, bf16':<30} {'impl':<22} {'fwd ms':>8} {'TFLOP/s':>8} {'bwd ms':>8} {'TFLOP/s':>8}")
    rows = {}
    variants = ("titan", "titan_narrow", "titan_fused", "titan_fused8", "titan_fused8_unordered", "torch")
    for impl in variants:
        rows[impl] = []
        try:
            with open(os.path.join(out, f"attn_{impl}.jsonl")) as f:
                for line in f:
                    try:
                        rows[impl].append(json.loads(line))
                    except ValueError:
                        pass
        except OSError:
            pass
    def cell(r, key, digits):
        v = r.get(key)
        return f"{v:>8.{digits}f}" if isinstance(v, (int, float)) else f"{'?':>8}"
    for i in range(max(len(rows["titan"]), len(rows["torch"]), 1)):
        for impl in variants:
            if i >= len(rows[impl]):
                if impl in ("titan", "torch"):
                    print(f"{'shape ' + str(i + 1):<30} {impl:<22} {'no result':>8}")
                continue
            r = rows[impl][i]
            label = f"{r.get('batch')}x{r.get('seq')} h{r.get('heads')}/{r.get('kv_heads')} d{r.get('head_dim')}"
            print(f"{label:<30} {impl:<22} {cell(r, 'forward_ms', 2)} {cell(r, 'forward_tflops', 1)} "
                  f"{cell(r, 'backward_ms', 2)} {cell(r, 'backward_tflops', 1)}")
def against_cpu(folder, cpu_folder, what, precision="fp32", tolerance=1e-3):
    """A GPU run's losses against the CPU's (fp32, same job): the largest relative difference."""
    run, cpu = curve(folder), curve(cpu_folder)
    if run and cpu and len(run) == len(cpu):
        diff = max(abs(a - b) / abs(b) for a, b in zip(run, cpu))
        print(f"{what} vs one CPU process, {len(cpu)} steps {precision}: max rel loss diff {diff:.2e} "
              f"({'ok' if diff <= tolerance else 'FAIL'})")
    else:
        print(f"{what}: no result")
def extra_copies(name, what, failure):
    """The host-device copies per step of bench JSON `name` beyond the dense Qwen3's (must be 0)."""
    run, dense = load(name), load("copies_debugmodel.json")
    if run and dense:
        extra = run["host_device_copies_per_step"] - dense["host_device_copies_per_step"]
        print(f"{what}: {extra:.0f} host-device copies per step beyond the dense model's "
              f"({dense['host_device_copies_per_step']:.0f}) ({'ok' if extra == 0 else 'FAIL: ' + failure})")
    else:
        print(f"{what}, copies per step: no result")
def moe_report():
    against_cpu("moe_gpu", "moe_cpu", "Qwen3-MoE on CUDA")
    extra_copies("copies_debugmodel_moe.json", "Qwen3-MoE on CUDA", "its MoE blocks copy")
    extra_copies("copies_debugmodel_moe_aux.json", "Qwen3-MoE with the auxiliary loss on CUDA",
                 "its auxiliary loss copies")
    against_cpu("ep2_gpu", "moe_cpu", "Qwen3-MoE EP 2 on CUDA")
    if os.path.isdir(os.path.join(out, "nccl_ep2")):
        against_cpu("nccl_ep2", "moe_cpu", "Qwen3-MoE EP 2 on two GPUs over NCCL")
def muon_report():
    against_cpu("muon_gpu", "muon_cpu", "Muon on CUDA")
    against_cpu("muon_bf16_state_gpu", "muon_bf16_state_cpu", "Muon with bf16 state on CUDA")
    against_cpu("muon_fsdp2_gpu", "muon_cpu", "Muon FSDP 2 on CUDA")
def documents_report():
    against_cpu("docs_gpu", "docs_cpu", "block-causal documents on CUDA")
    against_cpu("docs_cp2_gpu", "docs_cpu", "block-causal documents CP 2 on CUDA")
    against_cpu("docs_tc_gpu", "docs_tc_cpu", "block-causal documents on tensor cores",
                "bf16 (CPU fp32)", 2e-2)
def lora_report():
    against_cpu("resid_bf16_gpu", "resid_bf16_cpu", "bf16 residual stream, full AC, on CUDA", "bf16", 2e-2)
    against_cpu("resid_bf16_fsdp2_gpu", "resid_bf16_cpu", "bf16 residual stream, full AC, FSDP 2 on CUDA", "bf16", 2e-2)
    against_cpu("kept_bf16_gpu", "kept_bf16_cpu", "bf16 kept activations, no AC, on CUDA", "bf16", 2e-2)
    against_cpu("kept_bf16_op_gpu", "kept_bf16_cpu", "bf16 kept activations, per-op AC, on CUDA", "bf16", 2e-2)
    against_cpu("lora_gpu", "lora_cpu", "LoRA on CUDA")
    against_cpu("lora_bf16_gpu", "lora_cpu", "LoRA bf16 on CUDA", "bf16 (CPU fp32)", 2e-2)
def deepseek_report():
    against_cpu("ds_gpu", "ds_cpu", "DeepSeek-V3 on CUDA")
    against_cpu("ds_tp2_gpu", "ds_cpu", "DeepSeek-V3 TP 2 on CUDA")
    against_cpu("gptoss_gpu", "gptoss_cpu", "gpt-oss on CUDA")
    extra_copies("copies_gpt_oss.json", "gpt-oss on CUDA", "its blocks copy")
def float8_report():
    for r in ("rowwise", "tensorwise"):
        against_cpu(f"f8_{r}_cuda", f"f8_{r}_cpu", f"float8 {r} on CUDA (emulated)")
        against_cpu(f"f8_{r}_fp8", f"f8_{r}_cpu", f"float8 {r} on CUDA (float8 GEMMs)")
    against_cpu("f8_head_cuda", "f8_head_cpu", "float8 rowwise with a float8 head on CUDA (float8 GEMMs)")
    against_cpu("f8_fsdp_cuda", "f8_fsdp_cpu", "float8 tensorwise FSDP 2, float8 all-gather, on CUDA (float8 GEMMs)")
    against_cpu("mx_cuda", "mx_cpu", "MXFP8 RCEIL on CUDA (emulated)")
    bf16 = load("titan_1b_s2048.json")
    for r in ("rowwise", "tensorwise"):
        f8 = load(f"titan_float8_{r}_1b_s2048.json")
        if bf16 and f8:
            print(f"Llama 3 1B b8 s2048: float8 {r} {f8['tokens_per_s']:.0f} tok/s vs bf16 {bf16['tokens_per_s']:.0f} "
                  f"({f8['tokens_per_s'] / bf16['tokens_per_s']:.2f}x; {f8.get('float8_gemms')} float8 GEMMs, "
                  f"{f8.get('float8_gemms_dequantised')} dequantised)")
for report in (resume_report, generate_report, fsdp_report, moe_report, documents_report, lora_report, muon_report, deepseek_report, float8_report, bench_report, attention_report):
    section(report)
PYEOF
}
summarize 2>&1 | tee "$OUT_DIR/summary.txt"
cp "$OUT_DIR/summary.txt" "$RESULT_DIR/summary.txt"
tar czf "$RESULT_DIR/gpu_check_logs.tar.gz" --exclude=checkpoint -C "$OUT_DIR" . && echo "logs: $RESULT_DIR/gpu_check_logs.tar.gz"
