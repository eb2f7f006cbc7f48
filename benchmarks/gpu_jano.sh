#!/usr/bin/env bash
# Issue 15 on one GPU: the GPU tests of the region cache and the OffloadManager, then benchmarks/jano.py (quality on the
# MovingShapes teacher, per-level step time at the 1B shape, offload vs on-GPU caches with a profile).
#   bash benchmarks/gpu_jano.sh TEACHER_CKPT_DIR    (no argument: trains the teacher first via gpu_moving_shapes.sh)
# Result: ${RESULTS:-benchmarks/results}/jano.json and the summary table on stdout.
set -euo pipefail
results=${RESULTS:-benchmarks/results}
mkdir -p "$results"
ckpt=${1:-}
if [ -z "$ckpt" ]; then
    bash benchmarks/gpu_moving_shapes.sh "${TEACHER_MINUTES:-4}" 0
    ckpt=$(ls -d "${RUNS:-outputs/gpu_moving_shapes}"/teacher/checkpoints/step-* | tail -n 1)
fi
python -m pytest -q -m gpu tests/test_jano.py tests/test_offload.py
python benchmarks/jano.py --config configs/diffusion/train/moving_shapes_gpu.py --ckpt "$ckpt" \
    --num-steps "${TEACHER_STEPS:-30}" --repeats "${REPEATS:-3}" --out "$results/jano.json" 2>&1 | grep -v -i "warn"
