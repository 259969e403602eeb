#!/usr/bin/env bash
# Soak under faults (issue 42), three legs, each ending with nothing of its job left (no process,
# no socket folder: every job gets a temp folder of its own):
#
# chaos    A 4-rank job (FSDP 2 × TP 2, asynchronous checkpoints every few steps) under
#          --max-restarts while a chaos loop SIGKILLs a random worker and, now and then, SIGSTOPs
#          one past [comm] train_timeout_seconds; one save fails as on a full disk (under
#          on_save_failure = "warn"). The last checkpoint's weights and AdamW moments must equal,
#          byte for byte, the same job's run without faults, and the steps lost stay within one
#          checkpoint interval per restart.
# elastic  The same job as two "nodes" of 2 ranks (`--nnodes 2:2`, node 0 hosting the store): the
#          chaos loop SIGKILLs node 1's launcher (its workers must go with it) and starts it
#          again, or SIGKILLs a random worker of either node. Same weights, byte for byte.
# ft       Replica-group fault tolerance: a lighthouse and two groups of 2 ranks (FSDP 2); the chaos
#          loop SIGKILLs group 1's launcher and starts it again, or SIGKILLs one of its workers.
#          Group 0 must never restart; both groups' final weights and moments must be the same
#          bytes (the restarted group catches up from the live one).
#
#   scripts/soak.sh [--short] [--minutes M] [--legs chaos,elastic,ft] [--titan BIN]
#
# --short (CI, tests/distributed.rs): a few faults per leg on a tiny model, well under 3 minutes in
# all. Without it each leg's chaos goes on for M minutes (default 120) on a job long enough to
# outlast them. Prints one line per leg: faults injected, restarts, steps lost, wall-clock.
set -euo pipefail
cd "$(dirname "$0")/.."

titan=target/release/titan
minutes=120
short=0
legs=chaos,elastic,ft
while [ $# -gt 0 ]; do
  case $1 in
    --short) short=1 ;;
    --minutes) minutes=$2; shift ;;
    --legs) legs=$2; shift ;;
    --titan) titan=$2; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
titan=$(realpath "$titan")

interval=4
if [ "$short" = 1 ]; then
  steps=800; chaos_s=60; gap_ms=(1500 3000); ft_steps=1500
else
  steps=$((minutes * 60 * 50)); chaos_s=$((minutes * 60)); gap_ms=(3000 10000)
  ft_steps=$((minutes * 60 * 60))
fi
work=$(mktemp -d)
# SOAK_KEEP=1 keeps the logs and checkpoints (the folder is named on exit).
trap 'pkill -KILL -f -- "$work" 2>/dev/null || true; if [ -n "${SOAK_KEEP:-}" ]; then echo "soak: kept $work" >&2; else rm -rf "$work"; fi' EXIT
secret=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
printf '%s' "$secret" >"$work/secret"
chmod 600 "$work/secret"
model=(--model.dim 64 --model.n_layers 2 --model.n_heads 4 --model.n_kv_heads 2 --model.vocab_size 300
  --training.local_batch_size 2 --training.seq_len 32 --lr_scheduler.warmup_steps 3 --metrics.log_freq 1)
job=("${model[@]}" --parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 2
  --training.steps "$steps" --checkpoint.interval "$interval" --checkpoint.keep_latest_k 2
  --checkpoint.async_mode async --comm.train_timeout_seconds 5)
mkdir -p "$work/tmp"
export RAYON_NUM_THREADS=1 TITAN_JOB_SECRET=$secret TMPDIR=$work/tmp TITAN_HOST=127.0.0.1

now() { date +%s.%N; }
fail() { echo "soak: $*" >&2; exit 1; }
# A random pause between faults.
pause() {
  sleep "$(awk -v a="${gap_ms[0]}" -v b="${gap_ms[1]}" 'BEGIN{srand(); printf "%.3f", (a + rand() * (b - a)) / 1000}')"
}
# A random worker of launcher $1 (empty when it has none now).
worker_of() {
  local workers
  mapfile -t workers < <(pgrep -P "$1" || true)
  [ "${#workers[@]}" -gt 0 ] && echo "${workers[$((RANDOM % ${#workers[@]}))]}" || true
}
# The last step logged in metrics file $1 (0 before any).
progress() {
  local step
  step=$({ tail -n 2 "$1" 2>/dev/null || true; } | grep -o '"step": *[0-9]*' | tail -1 | tr -dc '0-9')
  echo "${step:-0}"
}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# Nothing of the job in $1 left: no process, no socket folder.
nothing_left() {
  sleep 1
  ! pgrep -f -- "$1" >/dev/null || fail "a process of $1 is still running: $(pgrep -af -- "$1" | head -3)"
  local left
  left=$(ls -A "$work/tmp")
  [ -z "$left" ] || fail "the job left socket folders behind: $left"
}
# The tensor files of checkpoint folders $1 and $2 are the same bytes (at least $3 files).
same_tensors() {
  local files=0 f
  compgen -G "$1/*.safetensors" >/dev/null || fail "no tensor files in $1"
  for f in "$1"/*.safetensors; do
    cmp -s "$f" "$2/$(basename "$f")" || fail "$2/$(basename "$f") differs from $f"
    files=$((files + 1))
  done
  [ "$files" -ge "$3" ] || fail "only $files tensor files in $1"
}
# Steps lost over restarts (rank 0's "(N lost)"), checked against one interval per restart.
steps_lost() {
  local lost
  lost=$({ grep -o "([0-9]* lost)" "$1" || true; } | tr -dc '0-9\n' | awk '{s += $1} END {print s + 0}')
  [ "$lost" -le $(( ($2 + 1) * interval )) ] || fail "$lost steps lost over $2 restarts (checkpoint interval $interval)"
  echo "$lost"
}

straight_s=""
# The uninterrupted reference of the chaos and elastic legs (once).
straight() {
  [ -z "$straight_s" ] || return 0
  local t0
  t0=$(now)
  "$titan" train --nproc 4 "${job[@]}" --job.dump_folder "$work/straight" >"$work/straight.log" 2>&1 \
    || { tail -20 "$work/straight.log" >&2; fail "the uninterrupted run failed"; }
  straight_s=$(awk -v a="$t0" -v b="$(now)" 'BEGIN {printf "%.1f", b - a}')
}

leg_chaos() {
  straight
  rm -rf "$work/chaos" "$work/chaos.log"
  # One save fails as on a full disk (writer 1's files of step 8·interval; the drill stands in for
  # the disk), under [checkpoint] on_save_failure = "warn": every rank warns and trains on.
  local full_disk_step=$((8 * interval)) t1 launcher faults=0 stops=0 victim end
  t1=$(now)
  TITAN_CHECKPOINT_WRITE_FAILS=1:$full_disk_step "$titan" train --nproc 4 "${job[@]}" --max-restarts 1000 \
    --checkpoint.on_save_failure warn --job.dump_folder "$work/chaos" >"$work/chaos.log" 2>&1 &
  launcher=$!
  end=$(( $(date +%s) + chaos_s ))
  while kill -0 "$launcher" 2>/dev/null && [ "$(date +%s)" -lt "$end" ]; do
    pause
    victim=$(worker_of "$launcher")
    [ -n "$victim" ] || continue
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
  wait "$launcher" || { tail -30 "$work/chaos.log" >&2; fail "the chaos run failed"; }
  [ "$faults" -gt 0 ] || fail "the chaos job ended before any fault was injected"
  grep -q "could not write its step-$full_disk_step files" "$work/chaos.log" \
    || fail "the full-disk save at step $full_disk_step did not fail"
  local t2 restarts lost
  t2=$(now)
  same_tensors "$work/straight/checkpoint/step-$steps" "$work/chaos/checkpoint/step-$steps" 8
  nothing_left "$work/chaos"
  restarts=$(grep -c "restarting all" "$work/chaos.log" || true)
  lost=$(steps_lost "$work/chaos.log" "$restarts")
  awk -v f="$faults" -v s="$stops" -v r="$restarts" -v l="$lost" -v a="$straight_s" -v b="$t1" -v c="$t2" \
    'BEGIN {printf "soak chaos: %d faults (%d SIGSTOP) and a full disk for one save, %d restarts, %d steps lost; uninterrupted %.1f s, under faults %.1f s (%.2fx); final weights and moments identical; no process or socket folder left\n", f, s, r, l, a, c - b, (c - b) / a}'
}

leg_elastic() {
  straight
  local port t1 node0 node1 faults=0 kills=0 end victim
  rm -rf "$work/elastic" "$work"/elastic-node*.log
  port=$(free_port)
  # exec: the background job's pid is the launcher's own, which the chaos loop kills.
  node() {
    exec "$titan" train --nproc 2 --nnodes 2:2 --rdzv-timeout 60 --node-rank "$1" --master-addr 127.0.0.1 \
      --master-port "$port" --max-restarts 1000 "${job[@]}" --job.dump_folder "$work/elastic" \
      >>"$work/elastic-node$1.log" 2>&1
  }
  t1=$(now)
  node 0 &
  node0=$!
  node 1 &
  node1=$!
  end=$(( $(date +%s) + chaos_s ))
  # Faults stop at 70% of the steps: a node started again after the job ended would wait for a
  # generation that never comes.
  while kill -0 "$node0" 2>/dev/null && [ "$(date +%s)" -lt "$end" ] \
    && [ "$(progress "$work/elastic/metrics.jsonl")" -lt $((steps * 7 / 10)) ]; do
    pause
    if [ $((faults % 2)) = 0 ]; then
      # Node 1's launcher dies (its workers must go with it) and a new one takes its place.
      kill -KILL "$node1" 2>/dev/null || continue
      wait "$node1" 2>/dev/null || true
      kills=$((kills + 1))
      sleep 1
      node 1 &
      node1=$!
    else
      victim=$(worker_of "$([ $((RANDOM % 2)) = 0 ] && echo "$node0" || echo "$node1")")
      [ -n "$victim" ] || continue
      kill -KILL "$victim" 2>/dev/null || continue
    fi
    faults=$((faults + 1))
  done
  wait "$node0" || { tail -30 "$work/elastic-node0.log" >&2; fail "the elastic job's node 0 failed"; }
  wait "$node1" || { tail -30 "$work/elastic-node1.log" >&2; fail "the elastic job's node 1 failed"; }
  [ "$kills" -gt 0 ] || fail "the elastic job ended before node 1's launcher was killed"
  local t2 restarts lost
  t2=$(now)
  same_tensors "$work/straight/checkpoint/step-$steps" "$work/elastic/checkpoint/step-$steps" 8
  nothing_left "$work/elastic"
  restarts=$(grep -c "restarting all" "$work/elastic-node0.log" || true)
  lost=$(steps_lost "$work/elastic-node0.log" "$restarts")
  awk -v f="$faults" -v k="$kills" -v r="$restarts" -v l="$lost" -v a="$straight_s" -v b="$t1" -v c="$t2" \
    'BEGIN {printf "soak elastic: %d faults (%d of node 1'"'"'s launcher, restarted), %d restarts, %d steps lost; uninterrupted %.1f s, under faults %.1f s (%.2fx); final weights and moments identical; no process or socket folder left\n", f, k, r, l, a, c - b, (c - b) / a}'
}

leg_ft() {
  local lh_log="$work/lighthouse.log" lighthouse addr t1 group0 group1 faults=0 kills=0 victim
  rm -rf "$work"/ft0* "$work"/ft1* "$lh_log"
  "$titan" lighthouse --port 0 --min-replicas 1 --join-timeout-ms 1000 --job-secret-file "$work/secret" \
    >"$lh_log" 2>&1 &
  lighthouse=$!
  # The first whole line names the address.
  for _ in $(seq 100); do [ "$(wc -l <"$lh_log")" -ge 1 ] && break; sleep 0.1; done
  addr=$(head -1 "$lh_log" | awk '{print $4}')
  [ -n "$addr" ] || fail "the lighthouse did not start: $(cat "$lh_log")"
  group() {
    exec "$titan" train --nproc 2 --max-restarts 1000 --job-secret-file "$work/secret" "${model[@]}" \
      --parallelism.data_parallel_shard_degree 2 --training.steps "$ft_steps" --checkpoint.interval 100000 \
      --fault_tolerance.enable true --fault_tolerance.group_size 2 --fault_tolerance.replica_id "$1" \
      --fault_tolerance.lighthouse "$addr" --fault_tolerance.process_group_timeout_ms 1500 \
      --job.dump_folder "$work/ft$1" >>"$work/ft$1.log" 2>&1
  }
  t1=$(now)
  group 0 &
  group0=$!
  group 1 &
  group1=$!
  local end=$(( $(date +%s) + chaos_s ))
  # Faults stop at 70% of the steps: a group restarted after the live one has finished would find
  # nobody to catch up from and train alone.
  while kill -0 "$group0" 2>/dev/null && [ "$(date +%s)" -lt "$end" ] \
    && [ "$(progress "$work/ft0/metrics.jsonl")" -lt $((ft_steps * 7 / 10)) ]; do
    pause
    if [ $((faults % 2)) = 0 ]; then
      kill -KILL "$group1" 2>/dev/null || continue
      wait "$group1" 2>/dev/null || true
      kills=$((kills + 1))
      sleep 1
      group 1 &
      group1=$!
    else
      victim=$(worker_of "$group1")
      [ -n "$victim" ] || continue
      kill -KILL "$victim" 2>/dev/null || continue
    fi
    faults=$((faults + 1))
  done
  wait "$group0" || { tail -30 "$work/ft0.log" >&2; fail "replica group 0 failed"; }
  wait "$group1" || { tail -30 "$work/ft1.log" >&2; fail "replica group 1 failed"; }
  kill "$lighthouse" 2>/dev/null || true
  wait "$lighthouse" 2>/dev/null || true
  [ "$kills" -gt 0 ] || fail "the replica groups ended before group 1's launcher was killed"
  ! grep -q "restarting" "$work/ft0.log" || fail "replica group 0 restarted: $(grep restarting "$work/ft0.log" | head -3)"
  same_tensors "$work/ft0/checkpoint/step-$ft_steps" "$work/ft1/checkpoint/step-$ft_steps" 4
  nothing_left "$work/ft"
  local t2 recovered dropped restarts
  t2=$(now)
  recovered=$(grep -c "^\[rank 0\].*recovered step" "$work/ft1.log" || true)
  restarts=$(grep -c "restarting all" "$work/ft1.log" || true)
  dropped=$(grep -c "^\[rank 0\].*this step is dropped" "$work/ft0.log" || true)
  awk -v f="$faults" -v k="$kills" -v r="$restarts" -v c="$recovered" -v d="$dropped" -v a="$t1" -v b="$t2" \
    'BEGIN {printf "soak ft: %d faults on replica group 1 (%d of its launcher, restarted), %d restarts of its workers, %d catch-ups from group 0 (its starts included), %d steps group 0 dropped, never restarting; %.1f s; both groups'"'"' final weights and moments identical; no process or socket folder left\n", f, k, r, c, d, b - a}'
}

for leg in ${legs//,/ }; do
  case $leg in
    chaos) leg_chaos ;;
    elastic) leg_elastic ;;
    ft) leg_ft ;;
    *) fail "unknown leg $leg (chaos, elastic, ft)" ;;
  esac
done
