#!/usr/bin/env bash
# Step-time spread of the real trainer (issue 16, goal 1): run the 1B synthetic config for N steps, R times,
# alternating between the current trainer and an older copy given as a directory holding trainer.py and
# throughput.py (optional), and print median / p10 / p90 step time of the steps after warm-up for every run.
#   bash benchmarks/trainer_jitter.sh STEPS REPEATS [OLD_DIR] [CONFIG]
set -euo pipefail
steps=${1:-40}; repeats=${2:-2}; old=${3:-}; config=${4:-configs/diffusion/train/mmdit_1b_synthetic.py}
runs=${RUNS:-outputs/trainer_jitter}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
summary() {
  python - "$1" "$2" <<'PY'
import json, statistics, sys
records = [json.loads(line) for line in open(sys.argv[1] + "/metrics.jsonl") if line.strip()]
times = sorted(r["step_time"] for r in records[5:])  # after warm-up
q = lambda f: times[min(len(times) - 1, int(f * len(times)))]
mfu = [r["mfu"] for r in records[5:] if "mfu" in r]
print(json.dumps(dict(variant=sys.argv[2], steps=len(times), median_s=statistics.median(times), p10_s=q(0.1),
                      p90_s=q(0.9), p90_over_p10=q(0.9) / q(0.1), mean_mfu=sum(mfu) / len(mfu) if mfu else None)))
PY
}
run() {  # variant name
  rm -rf "$runs/$1"
  torchrun --standalone --nproc_per_node 1 scripts/diffusion/train.py "$config" --outputs "$runs/$1" \
      --max-steps "$steps" --ckpt-every 0 --save-at-end False > "$runs/$1.log" 2>&1 || { tail -n 20 "$runs/$1.log"; exit 1; }
  summary "$runs/$1" "$1"
}
mkdir -p "$runs"
for r in $(seq "$repeats"); do
  run "new-$r"
  if [ -n "$old" ]; then
    cp opensora/training/trainer.py opensora/training/throughput.py "$runs/"
    cp "$old/trainer.py" "$old/throughput.py" opensora/training/
    run "old-$r" || true
    cp "$runs/trainer.py" "$runs/throughput.py" opensora/training/
  fi
done
