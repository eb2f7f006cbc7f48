#!/usr/bin/env bash
# MovingShapes on one GPU: train the teacher for a fixed wall-clock budget, score its samples
# (30 Euler steps + CFG), distil it with DMD2 into a 4-step student, score the student, and time both samplers on
# the same device and batch. Results: JSON under ${RESULTS:-outputs/benchmarks}/.
#   bash benchmarks/gpu_moving_shapes.sh [TEACHER_MINUTES] [DISTILL_MINUTES]   (DISTILL_MINUTES 0: teacher only)
# VALIDATE_EVERY=N: the teacher run samples and scores the config's validation prompts every N steps.
set -euo pipefail
teacher_minutes=${1:-4}
distill_minutes=${2:-2.5}
results=${RESULTS:-outputs/benchmarks}
runs=${RUNS:-outputs/gpu_moving_shapes}
mkdir -p "$results" "$runs"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
launch=(torchrun --standalone --nproc_per_node 1 scripts/diffusion/train.py)

teacher_cfg=configs/diffusion/train/moving_shapes_gpu.py
"${launch[@]}" "$teacher_cfg" --outputs "$runs/teacher" --overwrite --max-steps 1000000 --ckpt-every 0 \
    --max-minutes "$teacher_minutes" ${VALIDATE_EVERY:+--validation.every $VALIDATE_EVERY} 2>&1 | grep -v -i "warn" | tail -n 5
cp "$runs/teacher/metrics.jsonl" "$results/moving_shapes_teacher_metrics.jsonl"
teacher=$(ls -d "$runs"/teacher/checkpoints/step-* | tail -n 1)
python -m benchmarks.moving_shapes_quality "$teacher_cfg" --ckpt "$teacher" --num-steps "${TEACHER_STEPS:-30}" --guidance-scale 4 --repeats "${REPEATS:-3}" ${PROMPTS:+--num-prompts $PROMPTS} \
    --json "$results/moving_shapes_teacher.json" | tail -n 14

if [ "$distill_minutes" = 0 ]; then exit 0; fi
distill_cfg=configs/distill/dmd2_gpu.py
"${launch[@]}" "$distill_cfg" --outputs "$runs/dmd2" --overwrite --max-steps 1000000 --ckpt-every 0 \
    --max-minutes "$distill_minutes" --models.student.init_from.path "$teacher" \
    --models.teacher.init_from.path "$teacher" --models.critic.init_from.path "$teacher" 2>&1 \
    | grep -v -i "warn" | tail -n 5
cp "$runs/dmd2/metrics.jsonl" "$results/moving_shapes_dmd2_metrics.jsonl"
student=$(ls -d "$runs"/dmd2/checkpoints/step-* | tail -n 1)
python -m benchmarks.moving_shapes_quality "$distill_cfg" --ckpt "$student" --use-step-list --repeats "${REPEATS:-3}" ${PROMPTS:+--num-prompts $PROMPTS} \
    --json "$results/moving_shapes_dmd2_student.json" | tail -n 14
