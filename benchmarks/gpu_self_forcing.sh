#!/usr/bin/env bash
# Self-Forcing on one GPU: from a trained MovingShapes GPU teacher (benchmarks/gpu_moving_shapes.sh makes one).
# Stage 1, causal ODE init (configs/distill/causal_ode_gpu.py): the block-causal student regresses the teacher's
# guided ODE trajectory at its 4-step list. Stage 2, Self-Forcing (configs/distill/self_forcing_gpu.py): DMD on the
# student's own chunk-by-chunk rollout through its KV cache, teacher = real score, critic = fake score.
#   bash benchmarks/gpu_self_forcing.sh TEACHER_CKPT OUT_DIR [ODE_MINUTES] [SELF_FORCING_MINUTES]
# TEACHER_CKPT: a teacher checkpoint directory (e.g. outputs/gpu_moving_shapes/teacher/checkpoints/step-NNNNNNN).
# Checkpoints go to OUT_DIR/causal_ode and OUT_DIR/self_forcing; the defaults (2 + 3.5 minutes of training, plus
# start-up and saving) fit in about 8 minutes on one H100. Prints each stage's last logged losses.
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: bash $0 TEACHER_CKPT OUT_DIR [ODE_MINUTES] [SELF_FORCING_MINUTES]" >&2
    exit 2
fi
teacher=$1
out=$2
ode_minutes=${3:-2}
sf_minutes=${4:-3.5}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
launch=(torchrun --standalone --nproc_per_node 1 scripts/diffusion/train.py)

last_losses() {  # per loss key: its last logged value and its mean over the last 20 records that have it
    python - "$1/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
print(f"  {len(rows)} steps")
for key in sorted({k for row in rows for k in row if "loss" in k}):
    values = [row[key] for row in rows if key in row]
    tail = values[-20:]
    print(f"  {key}: last {values[-1]:.5f}, mean of last {len(tail)} {sum(tail) / len(tail):.5f}")
PY
}

echo "== stage 1: causal ODE init (${ode_minutes} min)"
"${launch[@]}" configs/distill/causal_ode_gpu.py --outputs "$out/causal_ode" --max-steps 1000000 --ckpt-every 0 \
    --max-minutes "$ode_minutes" --models.student.init_from.path "$teacher" \
    --models.teacher.init_from.path "$teacher" 2>&1 | grep -v -i "warn" | tail -n 5
last_losses "$out/causal_ode"
student=$(ls -d "$out"/causal_ode/checkpoints/step-* | tail -n 1)

echo "== stage 2: Self-Forcing (${sf_minutes} min) from $student"
"${launch[@]}" configs/distill/self_forcing_gpu.py --outputs "$out/self_forcing" --max-steps 1000000 --ckpt-every 0 \
    --max-minutes "$sf_minutes" --models.student.init_from.path "$student" \
    --models.teacher.init_from.path "$teacher" --models.critic.init_from.path "$teacher" 2>&1 \
    | grep -v -i "warn" | tail -n 5
last_losses "$out/self_forcing"
student=$(ls -d "$out"/self_forcing/checkpoints/step-* | tail -n 1)
echo "student: $student (role student; its config: configs/distill/self_forcing_gpu.py)"

echo "== streaming sample (chunk by chunk through the KV cache) -> $out/samples"
python scripts/diffusion/inference.py configs/distill/self_forcing_gpu.py --ckpt "$student" --role student \
    --prompt "a red circle moving left" --resolution 64x64 --num-frames 16 --save-dir "$out/samples" \
    --no-progress 2>&1 | grep -v -i "warn" | tail -n 3 || echo "streaming sample failed (training results above stand)"
