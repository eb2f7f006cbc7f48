#!/usr/bin/env bash
# One-GPU call (issue 16 goals 3 and 5): compiled blocks with attention as the opaque op vs SDPA traced into the
# graph (GPU tests + the 1B step interleaved with diffusers Flux, profile of the traced step), then Gemini static
# placement's exact resume with the fp32-master fix, with whatever time is left. Results under OUT.
set -uo pipefail
out=${1:?usage: gpu_session8_traced.sh OUT}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
start=$(date +%s)
left() { echo $((${BUDGET:-550} - ($(date +%s) - start))); }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$out/log.txt"
timeout 170 python -m pytest -q -m gpu tests/test_mmdit_compile.py 2>&1 | tail -n 4 | tee -a "$out/log.txt"
runs="ours-compile-traced@none;ours-compile@none;diffusers-flash@none;ours-eager@none;ours-compile-traced@none"
runs="$runs;ours-compile@none;diffusers-flash@none"
python benchmarks/train_step.py --runs "$runs" --profile "ours-compile-traced@none" --warmup 3 --iters 15 \
    --timeout 150 --out "$out/train_step_traced.json" 2>&1 | grep -v "host op\|  gap" | tail -n 30 | tee -a "$out/log.txt"
echo "after the step runs: $(( $(date +%s) - start )) s" | tee -a "$out/log.txt"
t=$(left)
if [ "$t" -gt 150 ]; then
    NPROC=1 STEPS=4 RUN_TIMEOUT=$(( (t - 20) / 2 )) VARIANTS="gemini-static" timeout $((t - 5)) \
        bash benchmarks/gemini_check.sh /tmp/gc resume 2>&1 | tail -n 8 | tee -a "$out/log.txt"
    cp /tmp/gc/gemini_check_resume.json "$out/" 2>/dev/null
    for f in /tmp/gc/*/metrics.jsonl; do [ -f "$f" ] && cp "$f" "$out/$(basename "$(dirname "$f")")_metrics.jsonl"; done
fi
echo "elapsed $(( $(date +%s) - start )) s" | tee -a "$out/log.txt"
