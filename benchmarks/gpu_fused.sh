#!/usr/bin/env bash
# Issue 16, goal 3 on one GPU (H200 or H100): the fused Triton kernels (MMDiT fused_kernels=True) and the
# compiled-block NaN hunt. Two parts, each under ~8 minutes, results under OUT:
#   bash benchmarks/gpu_fused.sh OUT step     GPU parity tests of the kernels at the 1B block shapes; per-chain
#                                             eager vs fused timing (fused_kernels.json); the 1B step eager / fused
#                                             / diffusers Flux, interleaved, + a profile of the fused step, + the
#                                             compiled+fused step (train_step.json)
#   bash benchmarks/gpu_fused.sh OUT parity   compiled vs eager, tensor by tensor, per variant: a modulation-only
#                                             block, a single block, a double block + the whole model
#                                             (OUT/{micro,single,model}/compile_parity.json)
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
    runs="ours-eager@none;ours-fused@none;diffusers-flash@none;ours-eager@none;ours-fused@none;ours-compile-nosplit@none"
    python benchmarks/train_step.py --runs "$runs" --profile "ours-fused@none" --warmup 3 --iters 20 \
        --timeout 150 --out "$out/train_step.json"
    ;;
parity)
    # the modulation-only micro block (seconds per compile) first, then a single block, then a double block and
    # the whole model; each call writes its own JSON, so a timeout keeps what came before
    timeout 200 python benchmarks/compile_parity.py --out "$out/micro" --blocks micro \
        --variants default,batch2,no-split-reductions,no-persistent-reductions,fused || true
    timeout 150 python benchmarks/compile_parity.py --out "$out/single" --blocks single \
        --variants default,batch2,no-split-reductions || true
    timeout 150 python benchmarks/compile_parity.py --out "$out/model" --blocks double --variants default \
        --model || true
    ;;
*)
    echo "unknown part '$part' (step|parity)" >&2
    exit 2
    ;;
esac
