#!/usr/bin/env bash
# LoRA on one GPU: finetune of a trained MovingShapes teacher on the subset it scores worst on.
#   bash benchmarks/gpu_lora.sh TEACHER_CKPT OUT        (TEACHER_CKPT: a checkpoint dir of moving_shapes_gpu.py,
#                                                        e.g. from benchmarks/gpu_moving_shapes.sh 4 0)
# 1. score the teacher on all 72 held captions (STEPS Euler steps + CFG 4) and pick the shape or direction value
#    it gets right least often; score that subset with SEEDS seeds per caption;
# 2. LoRA-finetune (configs/diffusion/train/moving_shapes_lora_gpu.py) on that subset for MINUTES minutes;
# 3. score the subset (and all captions) again from the LoRA checkpoint (the sampler merges the adapter on load),
#    export the adapter alone and the merged weights, check every file of TEACHER_CKPT hashes the same as before,
#    and write OUT/lora_report.json (scores, adapter size, optimizer memory of full finetuning vs LoRA).
# About 5-6 minutes on one H100 with the defaults.
set -euo pipefail
teacher=${1:?usage: gpu_lora.sh TEACHER_CKPT OUT}
out=${2:?usage: gpu_lora.sh TEACHER_CKPT OUT}
minutes=${MINUTES:-2}
steps=${STEPS:-10}
seeds=${SEEDS:-8}
mkdir -p "$out"
teacher=$(cd "$teacher" && pwd)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
base_cfg=${BASE_CFG:-configs/diffusion/train/moving_shapes_gpu.py}  # the teacher's config (scoring)
quality=(python -m benchmarks.moving_shapes_quality --num-steps "$steps" --guidance-scale 4 --repeats 1
         --batch-size 96)
lora_cfg=$(realpath "${LORA_CFG:-configs/diffusion/train/moving_shapes_lora_gpu.py}")  # LoRA settings
hashes() { (cd "$teacher" && find . -type f | LC_ALL=C sort | xargs sha256sum); }

hashes > "$out/teacher_hashes_before.txt"
"${quality[@]}" "$base_cfg" --ckpt "$teacher" --json "$out/teacher_all.json" | tail -n 6
subset=$(python -m benchmarks.lora_report worst "$out/teacher_all.json")
key=${subset%%=*}
value=${subset#*=}
echo "finetuning on the teacher's worst subset: $key=$value"
"${quality[@]}" "$base_cfg" --ckpt "$teacher" --where "$subset" --seeds-per-prompt "$seeds" \
    --json "$out/teacher_subset.json" | tail -n 6

cat > "$out/lora_config.py" <<CFG
_base_ = ["$lora_cfg"]
init_from = dict(path="$teacher", role="model", ema=True)
dataset = dict(where=dict(_delete_=True, $key="$value"))
CFG
torchrun --standalone --nproc_per_node 1 scripts/diffusion/train.py "$out/lora_config.py" --outputs "$out/run" \
    --overwrite --max-steps 1000000 --ckpt-every 0 --max-minutes "$minutes" \
    ${VALIDATE_EVERY:+--validation.every $VALIDATE_EVERY} 2>&1 | grep -v -i "warn" | tail -n 5
lora=$(ls -d "$out"/run/checkpoints/step-* | tail -n 1)

"${quality[@]}" "$base_cfg" --ckpt "$lora" --where "$subset" --seeds-per-prompt "$seeds" \
    --json "$out/lora_subset.json" | tail -n 6
"${quality[@]}" "$base_cfg" --ckpt "$lora" --json "$out/lora_all.json" | tail -n 6
python tools/convert_checkpoint.py "$lora" "$out/adapter.safetensors" --lora-only --overwrite
python tools/convert_checkpoint.py "$lora" "$out/merged.safetensors" --merge-lora --overwrite
hashes > "$out/teacher_hashes_after.txt"
python -m benchmarks.lora_report report --teacher "$teacher" --lora "$lora" --adapter-file "$out/adapter.safetensors" \
    --before "$out/teacher_subset.json" --after "$out/lora_subset.json" \
    --before-all "$out/teacher_all.json" --after-all "$out/lora_all.json" \
    --hashes-before "$out/teacher_hashes_before.txt" --hashes-after "$out/teacher_hashes_after.txt" \
    --json "$out/lora_report.json"
