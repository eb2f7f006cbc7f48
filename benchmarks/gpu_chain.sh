# Sourced by the detached device chains (gpu_long_rollout_ablation.sh, gpu_switch_rerender.sh): a chain is started
# under setsid so that it outlives the device call that starts it and no GPU waits for a call boundary.
#   chain_modes SCRIPT MODE OUT [SEC]   start: launch "SCRIPT chain OUT" detached and exit; wait: wait up to SEC s for
#                                       it to end, print its progress, archive logs, reports, teacher gates and p30/
#                                       as $OUT/chain.tgz (with OUT set) and exit;
#                                       chain: return (the caller runs its stages)
#   note TEXT                           a timed line in OUT/progress.txt
#   stage GPU DIR NAME FLAGS...         one long_streaming_quality run (with $E) pinned to a GPU, logged to log/NAME.txt
#   padded GPU NAME PARTS...            gpu_padded_text.sh parts, results under OUT/p30/NAME
#   optimizer_gpu_tests                 the EMA (one GPU; two over NCCL where two are visible) and one-rank ZeRO GPU
#                                       tests, logged to log/optimizer_gpu_tests.txt
#   lone_nccl_check                     a lone process's NCCL group (init_distributed's in-memory store): an
#                                       all-reduce, a subgroup and a barrier, before any stage depends on it

chain_modes() {
  local script=$1 mode=$2
  out=$3
  mkdir -p "$out/log"
  case $mode in
    wait)
      local limit=${4:-540}
      for _ in $(seq "$limit"); do [ -e "$out/done" ] && break; sleep 1; done
      cat "$out/progress.txt"
      grep -h -E "trained in|reusing|   evaluated |Error|error:|Killed" "$out"/log/*.txt 2>/dev/null | tail -n 12
      if [ -n "${OUT:-}" ]; then  # one archive: a device call brings back 8 files at most
        # the printed tables are log/eval_*.txt and log/switch_*.txt (report.partial.json: an evaluation still
        # running or cut, rewritten as each student's part ends, its "pending" naming the rest); gate.json:
        # --teacher-gate's checks; best.json: a student's validation scores by step (--student-checkpoint best);
        # metrics.jsonl: every logged step and validation window (the training curves); long_clips: its first long
        # clips as mp4
        mkdir -p "$OUT" && (cd "$out" && tar czf "$OUT/chain.tgz" log progress.txt $(ls -d */report*.json */teacher/gate.json */*/best.json */*/metrics.jsonl */*/long_clips p30 2>/dev/null))
      fi
      [ -e "$out/done" ] && echo "chain done" || echo "chain still running"
      exit 0 ;;
    start)
      # once per machine: a second chain started beside a running one must not rewrite the packages it imports
      [ -d .pysite/colossalai ] || python3 -m pip install -q --no-index --no-deps --no-compile --target .pysite \
        .whl/*.whl > /dev/null 2>&1
      rm -f "$out/done"
      setsid nohup bash "$script" chain "$out" > "$out/log/chain.txt" 2>&1 < /dev/null &
      echo "chain started: $out"
      exit 0 ;;
    chain) ;;
    *) echo "unknown mode $mode (start|wait)" >&2; exit 2 ;;
  esac
  export PYTHONPATH=$PWD/.pysite:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
  chain_t0=$(date +%s)
  : > "$out/progress.txt"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$out/log/gpu.txt"
}

note() { echo "$(( $(date +%s) - chain_t0 )) s: $*" >> "$out/progress.txt"; }

stage() {
  local gpu=$1 dir=$2 name=$3
  shift 3
  note "start $name (GPU $gpu)"
  CUDA_VISIBLE_DEVICES=$gpu python -m benchmarks.long_streaming_quality --out "$out/$dir" $E "$@" \
    > "$out/log/$name.txt" 2>&1 && note "end $name" || note "FAILED $name"
}

padded() {
  local gpu=$1 name=$2
  shift 2
  note "start padded-text $name (GPU $gpu)"
  CUDA_VISIBLE_DEVICES=$gpu OUT="$out/p30/$name" TESTS_S=290 bash benchmarks/gpu_padded_text.sh "$@" \
    > "$out/log/p30_$name.txt" 2>&1
  note "end padded-text $name"
}

optimizer_gpu_tests() {
  note "start optimizer GPU tests"
  timeout 300 python -m pytest -q -p no:cacheprovider -m gpu tests/test_ema.py tests/test_ema_sharded.py \
    tests/test_zero_single_rank.py > "$out/log/optimizer_gpu_tests.txt" 2>&1
  note "end optimizer GPU tests: $(tail -n 1 "$out/log/optimizer_gpu_tests.txt")"
}

lone_nccl_check() {
  note "start lone NCCL check"
  CUDA_VISIBLE_DEVICES=${CHAIN_GPU:-0} timeout 200 python -m pytest -q -p no:cacheprovider -m gpu \
    tests/test_script_teardown.py > "$out/log/lone_nccl_check.txt" 2>&1 \
    && note "end lone NCCL check: $(tail -n 1 "$out/log/lone_nccl_check.txt")" \
    || note "FAILED lone NCCL check: $(tail -n 1 "$out/log/lone_nccl_check.txt")"
}
