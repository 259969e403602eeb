#!/usr/bin/env bash
# Soak under faults (issue 42): a 4-rank job (FSDP 2 × TP 2, asynchronous checkpoints every few
# steps) runs under --max-restarts while a chaos loop SIGKILLs a random worker and, now and then,
# SIGSTOPs one past [comm] train_timeout_seconds, and one save fails as on a full disk. At the end the weights and AdamW moments of the
# last checkpoint must equal, byte for byte, those of the same job run without faults; no worker
# and no socket folder of the job may be left, and the steps lost must stay within one checkpoint
# interval per restart.
#
#   scripts/soak.sh [--short] [--minutes M] [--titan BIN]
#
# --short (CI, tests/distributed.rs): a few faults on a tiny model, well under 3 minutes. Without it the
# chaos goes on for M minutes (default 120) on a job long enough to outlast them. Prints one line:
# faults injected, restarts, steps lost, the wall-clock of both runs and the overhead.
# Not covered yet (issue 42): a node's launcher killed in a 2-node elastic job, replica-group
# fault tolerance under the same loop.
set -euo pipefail
cd "$(dirname "$0")/.."

titan=target/release/titan
minutes=120
short=0
while [ $# -gt 0 ]; do
  case $1 in
    --short) short=1 ;;
    --minutes) minutes=$2; shift ;;
    --titan) titan=$2; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done

interval=4
if [ "$short" = 1 ]; then
  steps=800; chaos_s=60; gap_ms=(1500 3000)
else
  steps=$((minutes * 60 * 50)); chaos_s=$((minutes * 60)); gap_ms=(3000 10000)
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
secret=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
job=(train --nproc 4
  --parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 2
  --model.dim 64 --model.n_layers 2 --model.n_heads 4 --model.n_kv_heads 2 --model.vocab_size 300
  --training.local_batch_size 2 --training.seq_len 32 --lr_scheduler.warmup_steps 3
  --training.steps "$steps" --checkpoint.interval "$interval" --checkpoint.keep_latest_k 2
  --checkpoint.async_mode async --comm.train_timeout_seconds 5 --metrics.log_freq 1)

# The job's socket folders go to a temp folder of its own, so that what it leaves is its own.
mkdir -p "$work/tmp"
export RAYON_NUM_THREADS=1 TITAN_JOB_SECRET=$secret TMPDIR=$work/tmp
t0=$(date +%s.%N)
"$titan" "${job[@]}" --job.dump_folder "$work/straight" >"$work/straight.log" 2>&1
t1=$(date +%s.%N)

# One save fails as on a full disk (writer 1's files of step 8·interval; the drill stands in for the
# disk), under [checkpoint] on_save_failure = "warn": every rank warns and trains on.
full_disk_step=$((8 * interval))
TITAN_CHECKPOINT_WRITE_FAILS=1:$full_disk_step "$titan" "${job[@]}" --max-restarts 1000 \
  --checkpoint.on_save_failure warn --job.dump_folder "$work/chaos" >"$work/chaos.log" 2>&1 &
launcher=$!
faults=0
stops=0
end=$(( $(date +%s) + chaos_s ))
while kill -0 "$launcher" 2>/dev/null && [ "$(date +%s)" -lt "$end" ]; do
  sleep "$(awk -v a="${gap_ms[0]}" -v b="${gap_ms[1]}" 'BEGIN{srand(); printf "%.3f", (a + rand() * (b - a)) / 1000}')"
  mapfile -t workers < <(pgrep -P "$launcher" || true)
  [ "${#workers[@]}" -gt 0 ] || continue
  victim=${workers[$((RANDOM % ${#workers[@]}))]}
  if [ $((faults % 3)) = 1 ]; then
    # Hung, not dead: the others' collectives time out and the launcher restarts the group.
    kill -STOP "$victim" 2>/dev/null || continue
    sleep 7
    kill -CONT "$victim" 2>/dev/null || true
    stops=$((stops + 1))
  else
    kill -KILL "$victim" 2>/dev/null || continue
  fi
  faults=$((faults + 1))
done
wait "$launcher" || { echo "soak: the chaos run failed" >&2; tail -30 "$work/chaos.log" >&2; exit 1; }
[ "$faults" -gt 0 ] || { echo "soak: the job ended before any fault was injected" >&2; exit 1; }
grep -q "could not write its step-$full_disk_step files" "$work/chaos.log" \
  || { echo "soak: the full-disk save at step $full_disk_step did not fail" >&2; exit 1; }
t2=$(date +%s.%N)

# The last checkpoint's tensors (weights and moments, every writer's shard) byte for byte.
last="step-$steps"
for f in "$work/straight/checkpoint/$last"/*.safetensors; do
  name=$(basename "$f")
  if ! cmp -s "$f" "$work/chaos/checkpoint/$last/$name"; then
    echo "soak: $last/$name differs from the uninterrupted run's" >&2
    exit 1
  fi
done
files=$(ls "$work/straight/checkpoint/$last"/*.safetensors | wc -l)
[ "$files" -ge 4 ] || { echo "soak: only $files tensor files in $last" >&2; exit 1; }

# Nothing of the job left: no worker, no socket folder.
sleep 1
if pgrep -f -- "--job.dump_folder $work/chaos" >/dev/null; then
  echo "soak: a process of the job is still running" >&2
  exit 1
fi
left=$(ls -A "$work/tmp")
if [ -n "$left" ]; then
  echo "soak: the job left socket folders behind: $left" >&2
  exit 1
fi

restarts=$(grep -c "restarting all" "$work/chaos.log" || true)
lost=$({ grep -o "([0-9]* lost)" "$work/chaos.log" || true; } | tr -dc '0-9\n' | awk '{s += $1} END {print s + 0}')
if [ "$lost" -gt $(( (restarts + 1) * interval )) ]; then
  echo "soak: $lost steps lost over $restarts restarts (checkpoint interval $interval)" >&2
  exit 1
fi
awk -v f="$faults" -v s="$stops" -v r="$restarts" -v l="$lost" -v a="$t0" -v b="$t1" -v c="$t2" \
  'BEGIN {
  printf "soak: %d faults (%d SIGSTOP) and a full disk for one save, %d restarts, %d steps lost; uninterrupted %.1f s, under faults %.1f s (%.2fx); final weights and moments identical; no process or socket folder left\n",
    f, s, r, l, b - a, c - b, (c - b) / (b - a) }'
