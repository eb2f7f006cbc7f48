#!/usr/bin/env bash
# One-GPU call (issue 16 goal 3): the compiled blocks with Inductor's mix-order reductions off. GPU test of the
# compiled grads at batch 1 in bf16, the parity script with the fix (default) and without it (mix-order), then the
# 1B step eager / compiled / diffusers Flux interleaved twice, with a profile of the compiled step. Results under OUT.
set -uo pipefail
out=${1:?usage: gpu_session8_compile.sh OUT}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$out/log.txt"
timeout 150 python -m pytest -q -m gpu tests/test_mmdit_compile.py 2>&1 | tail -n 6 | tee -a "$out/log.txt"
timeout 100 python benchmarks/compile_parity.py --out /tmp/cp --blocks micro --variants default,mix-order 2>&1 \
    | tail -n 6 | tee -a "$out/log.txt"
cp /tmp/cp/compile_parity.json "$out/compile_parity_fix.json" 2>/dev/null
echo "before the step runs: $(( $(date +%s) - start )) s" | tee -a "$out/log.txt"
runs="ours-eager@none;ours-compile@none;diffusers-flash@none;ours-eager@none;ours-compile@none;diffusers-flash@none"
python benchmarks/train_step.py --runs "$runs" --profile "ours-compile@none" --warmup 3 --iters 15 --timeout 200 \
    --out "$out/train_step_compile.json" 2>&1 | tail -n 40 | tee -a "$out/log.txt"
echo "elapsed $(( $(date +%s) - start )) s" | tee -a "$out/log.txt"
