#!/usr/bin/env bash
# Jano on one GPU: the GPU tests of the region cache, the OffloadManager and the level graphs, then
# benchmarks.jano (quality on the MovingShapes teacher, per-level step time at the 1B shape, eager and as CUDA
# graphs, offload vs on-GPU caches with a profile, with and without graphs).
#   bash benchmarks/gpu_jano.sh [TEACHER_CKPT_DIR]
# Without a checkpoint it first trains the teacher for TEACHER_MINUTES (default 4) as gpu_moving_shapes.sh does (without
# that script's own scoring). Env: PARTS (default quality,levels,offload), TESTS=0 skips the pytest GPU tests,
# RESULTS (default outputs/benchmarks) receives jano_<parts>.json; TRACE=DIR also writes the offload profiles (gzip
# chrome traces) there; the summary table goes to stdout.
set -euo pipefail
results=${RESULTS:-outputs/benchmarks}
runs=${RUNS:-outputs/gpu_moving_shapes}
parts=${PARTS:-quality,levels,offload}
mkdir -p "$results"
export PYTHONUNBUFFERED=1
ckpt=${1:-}
if [ "${TESTS:-1}" != 0 ]; then
    python3 -m pytest -q -rf -m gpu tests/test_jano.py tests/test_offload.py tests/test_region_graphs.py 2>&1 | tail -n 40 || echo "GPU TESTS FAILED"
fi
if [ -z "$ckpt" ] && [[ "$parts" == *quality* ]]; then
    torchrun --standalone --nproc_per_node 1 scripts/diffusion/train.py configs/diffusion/train/moving_shapes_gpu.py \
        --outputs "$runs/teacher" --max-steps 1000000 --ckpt-every 0 --max-minutes "${TEACHER_MINUTES:-4}" 2>&1 \
        | grep -v -i "warn" | tail -n 3
    ckpt=$(ls -d "$runs"/teacher/checkpoints/step-* | tail -n 1)
fi
python3 -m benchmarks.jano --config configs/diffusion/train/moving_shapes_gpu.py ${ckpt:+--ckpt "$ckpt"} \
    --parts "$parts" --num-steps "${TEACHER_STEPS:-30}" --repeats "${REPEATS:-2}" ${TRACE:+--trace "$TRACE"} \
    --out "$results/jano_${parts//,/_}.json" 2>&1 \
    | grep -v -i "warn"
