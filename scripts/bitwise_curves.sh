#!/usr/bin/env bash
# Records, or compares bit for bit, the per-step loss and grad-norm curves of every layout, the
# validation losses and sampled generations: the check that a refactor changed no number.
#
#   scripts/bitwise_curves.sh record BIN OUT_DIR     # run every case with BIN, write OUT_DIR/<case>.txt
#   scripts/bitwise_curves.sh compare BEFORE AFTER   # diff two recorded folders; non-zero on any difference
#   scripts/bitwise_curves.sh check BIN_BEFORE BIN_AFTER   # record both (in /tmp) and compare
#
# Each case's file holds one line per step: `step loss grad_norm` exactly as metrics.jsonl wrote
# them (shortest round-trip decimal of the f64, so equal text means equal bits), then the
# validation lines, and for the generation cases the generated token ids.
set -euo pipefail

steps=20
# A port of its own, so that two recordings (or a test run) can share the machine.
port=${TITAN_CURVES_PORT:-$((30000 + RANDOM % 20000))}

# name | nproc | config | extra flags
cases=(
  "readme|1|configs/debug_model.toml|"
  "fsdp2|2|configs/debug_model.toml|"
  "hsdp2x2|4|configs/debug_model.toml|--parallelism.data_parallel_replicate_degree 2"
  "tp2|2|configs/debug_model.toml|--parallelism.tensor_parallel_degree 2"
  "async_tp2|2|configs/debug_model.toml|--parallelism.tensor_parallel_degree 2 --parallelism.enable_async_tensor_parallel true"
  "pp2_1f1b|2|configs/debug_model.toml|--parallelism.pipeline_parallel_degree 2 --training.global_batch_size 16 --training.local_batch_size 8 --parallelism.pipeline_parallel_microbatch_size 2"
  "pp2_interleaved|2|configs/debug_model.toml|--parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule Interleaved1F1B --training.local_batch_size 8 --parallelism.pipeline_parallel_microbatch_size 2 --model.n_layers 4"
  "pp2_zbv|2|configs/debug_model.toml|--parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule ZBVZeroBubble --training.local_batch_size 8 --parallelism.pipeline_parallel_microbatch_size 2 --model.n_layers 4"
  "pp2_izb|2|configs/debug_model.toml|--parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule InterleavedZeroBubble --training.local_batch_size 8 --parallelism.pipeline_parallel_microbatch_size 2 --model.n_layers 4"
  "cp2|2|configs/debug_model.toml|--parallelism.context_parallel_degree 2"
  "ep2_moe|2|configs/qwen3_debugmodel.toml|--model.flavor debugmodel_moe --parallelism.expert_parallel_degree 2 --model.load_balance_coeff 0.001 --model.router_aux_loss_coef 0.001"
  "moe_1proc|1|configs/qwen3_debugmodel.toml|--model.flavor debugmodel_moe --model.load_balance_coeff 0.001"
  "ac_full|1|configs/debug_model.toml|--activation_checkpoint.mode full"
  "ac_op|1|configs/debug_model.toml|--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op"
  "ac_op_tp2|2|configs/debug_model.toml|--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op --parallelism.tensor_parallel_degree 2"
  "validation|1|configs/debug_model.toml|--validation.enabled true --validation.freq 5 --validation.steps 2"
  "validation_fsdp_pp|4|configs/debug_model.toml|--validation.enabled true --validation.freq 5 --validation.steps 2 --parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_microbatch_size 4"
  "ddp2_accum|2|configs/debug_model.toml|--parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 1 --training.local_batch_size 4 --training.global_batch_size 16"
  "fsdp2_accum_bf16|2|configs/debug_model.toml|--training.local_batch_size 4 --training.global_batch_size 16 --training.mixed_precision_param bfloat16"
  "bf16_1proc|1|configs/debug_model.toml|--training.mixed_precision_param bfloat16"
  "fsdp_pp_bf16_ac_op|4|configs/debug_model.toml|--training.mixed_precision_param bfloat16 --parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule Interleaved1F1B --model.n_layers 4 --parallelism.pipeline_parallel_microbatch_size 2 --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op"
  "pp2_ddp2_accum|4|configs/debug_model.toml|--parallelism.pipeline_parallel_degree 2 --parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 1 --training.local_batch_size 4 --training.global_batch_size 16 --parallelism.pipeline_parallel_microbatch_size 2"
  "tied_pp2_accum|2|configs/debug_model.toml|--model.flavor 1B --model.dim 128 --model.n_layers 4 --model.n_heads 4 --model.n_kv_heads 2 --model.vocab_size 2048 --parallelism.pipeline_parallel_degree 2 --training.local_batch_size 4 --training.global_batch_size 8 --parallelism.pipeline_parallel_microbatch_size 2 --training.seq_len 128"
  "tied_fsdp_pp|4|configs/debug_model.toml|--model.flavor 1B --model.dim 128 --model.n_layers 4 --model.n_heads 4 --model.n_kv_heads 2 --model.vocab_size 2048 --parallelism.pipeline_parallel_degree 2 --training.local_batch_size 4 --training.global_batch_size 16 --parallelism.pipeline_parallel_microbatch_size 2 --training.seq_len 128"
  "ep2_fsdp_ac_full|4|configs/qwen3_debugmodel.toml|--model.flavor debugmodel_moe --parallelism.expert_parallel_degree 2 --activation_checkpoint.mode full --training.seq_len 128 --model.router_aux_loss_coef 0.001"
  "fsdp2_reshard_never_ac2|2|configs/debug_model.toml|--parallelism.fsdp_reshard_after_forward never --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option 2"
  "float8_rowwise_tp2|2|configs/debug_model.toml|--model.converters quantize.linear.float8 --parallelism.tensor_parallel_degree 2"
  "float8_tensorwise_fsdp2_ag|2|configs/debug_model.toml|--model.converters quantize.linear.float8 --quantize.linear.float8.recipe_name tensorwise --quantize.linear.float8.enable_fsdp_float8_all_gather true"
  "mx_rceil_cp2|2|configs/debug_model.toml|--model.converters quantize.linear.mx --quantize.linear.mx.recipe_name mxfp8_cublas_rceil --parallelism.context_parallel_degree 2"
  "float8_head_tp2|2|configs/debug_model.toml|--model.converters quantize.linear.float8 --quantize.linear.float8.filter_fqns , --parallelism.tensor_parallel_degree 2"
  "mx_experts_ep2|2|configs/qwen3_debugmodel.toml|--model.flavor debugmodel_moe --model.converters quantize.grouped_mm.mx --parallelism.expert_parallel_degree 2 --training.seq_len 128"
  "muon_fsdp2|2|configs/debug_model.toml|--optimizer.name Muon"
  "muon_tp2_hsdp|4|configs/debug_model.toml|--optimizer.name Muon --parallelism.tensor_parallel_degree 2 --parallelism.data_parallel_replicate_degree 2"
  "pp2_zbv_ac_op|2|configs/debug_model.toml|--parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule ZBVZeroBubble --training.local_batch_size 8 --parallelism.pipeline_parallel_microbatch_size 2 --model.n_layers 4 --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op"
  "gpt_oss_1proc|1|configs/gpt_oss_debugmodel.toml|--training.seq_len 128"
  "float8_experts_1proc|1|configs/qwen3_debugmodel.toml|--model.flavor debugmodel_moe --model.converters quantize.grouped_mm.float8 --training.seq_len 128"
  "moe_bf16_1proc|1|configs/qwen3_debugmodel.toml|--model.flavor debugmodel_moe --training.mixed_precision_param bfloat16 --training.seq_len 128"
  "llama4_1proc|1|configs/llama4_debugmodel.toml|--training.seq_len 128"
  "pp2_mla_moe_ac_full|2|configs/deepseek_v3_debugmodel.toml|--parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule Interleaved1F1B --training.local_batch_size 8 --parallelism.pipeline_parallel_microbatch_size 2 --activation_checkpoint.mode full --training.seq_len 128"
  "mistral_window_cp2|2|configs/mistral_debugmodel.toml|--model.sliding_window_size 48 --parallelism.context_parallel_degree 2"
)
# TITAN_CURVES_ONLY="name ...": record only those cases (and no generation).
only=${TITAN_CURVES_ONLY:-}

record() {
  local bin=$1 out=$2 work
  mkdir -p "$out"
  work=$(mktemp -d)
  for spec in "${cases[@]}"; do
    IFS='|' read -r name nproc config extra <<<"$spec"
    if [ -n "$only" ] && [[ " $only " != *" $name "* ]]; then continue; fi
    local dump="$work/$name"
    # shellcheck disable=SC2086
    if ! "$bin" train --config "$config" --nproc "$nproc" --master-port "$port" --job.dump_folder "$dump" \
      --training.steps "$steps" --metrics.log_freq 1 --checkpoint.interval "$steps" \
      $extra >"$work/$name.log" 2>&1; then
      echo "FAILED: $name (log: $work/$name.log)" >&2
      tail -n 20 "$work/$name.log" >&2
      exit 1
    fi
    python3 - "$dump/metrics.jsonl" >"$out/$name.txt" <<'EOF'
import json, re, sys
# Keep the numbers' text exactly as written (json.loads would re-format them).
def raw(line, key):
    m = re.search(r'"%s":([^,}]+)' % key, line)
    return m.group(1) if m else "-"
for line in open(sys.argv[1]):
    m = json.loads(line)
    if "validation_loss" in m:
        print("validation", m["step"], raw(line, "validation_loss"))
    elif "loss" in m:
        print("step", m["step"], raw(line, "loss"), raw(line, "grad_norm"), raw(line, "moe_aux_loss"))
EOF
    echo "recorded $name: $(grep -c '^step' "$out/$name.txt") steps"
  done
  if [ -n "$only" ]; then rm -rf "$work"; return; fi
  # Generation from the README run's checkpoint: greedy, and sampled (sensitive to every logit).
  "$bin" generate --checkpoint "$work/readme" --prompt "The cat" --max-new-tokens 40 \
    --temperature 0 --json >"$out/generate_greedy.txt"
  "$bin" generate --checkpoint "$work/readme" --prompt "The cat" --max-new-tokens 40 \
    --temperature 0.8 --top-k 20 --seed 7 --json >"$out/generate_sampled.txt"
  "$bin" generate --checkpoint "$work/moe_1proc" --prompt "Once" --max-new-tokens 40 \
    --temperature 0.8 --seed 3 --json >"$out/generate_moe.txt"
  echo "recorded generation"
  rm -rf "$work"
}

compare() {
  local a=$1 b=$2 bad=0
  for f in "$a"/*.txt; do
    local name
    name=$(basename "$f")
    if [ ! -s "$f" ] || ! grep -q . "$f"; then
      echo "EMPTY  $name in $a"; bad=1; continue
    fi
    if cmp -s "$f" "$b/$name"; then
      echo "same   $name ($(wc -l <"$f") lines)"
    else
      # (diff exits 1 on a difference: under pipefail that must not end the comparison.)
      echo "DIFFER $name"; { diff "$f" "$b/$name" || true; } | head -n 6; bad=1
    fi
  done
  if [ "$bad" = 0 ]; then echo "all curves identical bit for bit"; fi
  return "$bad"
}

case "${1:-}" in
  record) record "$2" "$3" ;;
  compare) compare "$2" "$3" ;;
  check)
    record "$2" /tmp/titan-curves-before
    record "$3" /tmp/titan-curves-after
    compare /tmp/titan-curves-before /tmp/titan-curves-after
    ;;
  *) sed -n 2,11p "$0"; exit 2 ;;
esac
