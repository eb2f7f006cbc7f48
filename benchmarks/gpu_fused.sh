#!/usr/bin/env bash
# Issue 16, goal 3 on one GPU (H200 or H100): the fused Triton kernels (MMDiT fused_kernels=True) and the
# compiled-block NaN hunt. Two parts, each under ~8 minutes, results under OUT:
#   bash benchmarks/gpu_fused.sh OUT step     GPU parity tests of the kernels at the 1B block shapes; per-chain
#                                             eager vs fused timing (fused_kernels.json); the 1B step eager / fused
#                                             / diffusers Flux, interleaved, + a profile of the fused step, + the
#                                             compiled+fused step (train_step.json)
#   bash benchmarks/gpu_fused.sh OUT parity   one compiled 1B block vs eager, tensor by tensor, per variant
#                                             (compile_parity.json), then the whole model (per-block grads)
# The device image needs diffusers for the Flux rows (carry it as for benchmarks/train_step.py).
set -euo pipefail
out=${1:?usage: gpu_fused.sh OUT step|parity}
part=${2:?usage: gpu_fused.sh OUT step|parity}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/.pysite:$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
case "$part" in
step)
    timeout 150 python -m pytest tests/test_fused_kernels.py -q -x -rs 2>&1 | tail -n 8 | tee "$out/tests.txt" || true
    timeout 90 python benchmarks/fused_kernels.py --out "$out" || true
    runs="ours-eager@none;ours-fused@none;diffusers-flash@none;ours-eager@none;ours-fused@none;ours-compile-fused@none"
    python benchmarks/train_step.py --runs "$runs" --profile "ours-fused@none" --warmup 3 --iters 20 \
        --timeout 150 --out "$out/train_step.json"
    ;;
parity)
    timeout 420 python benchmarks/compile_parity.py --out "$out" --variants default,no-rope,no-qknorm,flash,fused \
        --model || true
    ;;
*)
    echo "unknown part '$part' (step|parity)" >&2
    exit 2
    ;;
esac
