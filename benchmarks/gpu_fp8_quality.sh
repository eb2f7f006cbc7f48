#!/usr/bin/env bash
# FP8 quality check on one GPU: the MovingShapes GPU teacher trained twice for the same number of steps from the same
# seed, in bf16 and with FP8 block linears (torchao, MMDiT(fp8_linears=RECIPE)), each scored on the 72 held captions
# with the same sampling seeds (30 Euler steps, CFG 4). The scores should agree within a point.
#   bash benchmarks/gpu_fp8_quality.sh OUT [STEPS] [RECIPE]      (defaults: 2000 steps, tensorwise)
# PRECISIONS="tensorwise" runs one side only (the calls may be split: eager FP8 at this 30M width is slower than
# bf16); FP8_FLAGS adds trainer flags to the FP8 run (e.g. "--model.compile_blocks True": the float8 casts fused).
# One call of under 10 minutes at 2000 steps on an H200 (~3 min of training each). The device machine lacks
# colossalai / mmengine / diffusers: carry .whl (../shared/tools/device_wheels.sh all) and install it first.
set -euo pipefail
out=${1:?usage: gpu_fp8_quality.sh OUT [STEPS] [RECIPE]}
steps=${2:-2000}
recipe=${3:-tensorwise}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$out"
cfg=configs/diffusion/train/moving_shapes_gpu.py
for precision in ${PRECISIONS:-bf16 $recipe}; do
  runs=outputs/fp8_quality/$precision
  extra=()
  if [ "$precision" != bf16 ]; then extra=(--model.fp8_linears "$precision" ${FP8_FLAGS:-}); fi
  start=$(date +%s)
  torchrun --standalone --nproc_per_node 1 scripts/diffusion/train.py "$cfg" --outputs "$runs" --overwrite \
    --max-steps "$steps" --ckpt-every 0 "${extra[@]}" 2>&1 | grep -v -i warn | tail -n 4
  echo "$precision: $steps steps in $(( $(date +%s) - start )) s (start-up included)"
  cp "$runs/metrics.jsonl" "$out/fp8_quality_${precision}_metrics.jsonl"
  ckpt=$(ls -d "$runs"/checkpoints/step-* | tail -n 1)
  python -m benchmarks.moving_shapes_quality "$cfg" --ckpt "$ckpt" --num-steps 30 --guidance-scale 4 --repeats 3 \
    --json "$out/fp8_quality_${precision}.json" | tail -n 6
done
