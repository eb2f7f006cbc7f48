#!/usr/bin/env bash
# Long streaming without drift on one GPU (benchmarks/long_streaming_quality.py), in device calls under 10 minutes
# each; run the parts back to back on the same warm machine (a stage whose final checkpoint exists is reused):
#   bash benchmarks/gpu_long_streaming.sh OUT prep       teacher on wrap clips (4 min) + causal ODE init (1.5 min)
#   bash benchmarks/gpu_long_streaming.sh OUT students   Self-Forcing and long-rollout DMD from the same init (2.5 min each)
#   bash benchmarks/gpu_long_streaming.sh OUT eval       both students streamed on the same seeds, scored per window at
#                                                        8x the clip; OUT/report.json and the printed table
#   bash benchmarks/gpu_long_streaming.sh OUT options    eval again with the streaming options: the long run also with
#                                                        --kv-recache shift, and a prompt switch after the clip length
#                                                        (new caption's accuracy in the next window); OUT/report_options.*
# Finer parts, for calls that must stay short or for two GPUs:
#   bash benchmarks/gpu_long_streaming.sh OUT teacher       the teacher alone
#   bash benchmarks/gpu_long_streaming.sh OUT self_forcing  causal ODE init + Self-Forcing
#   bash benchmarks/gpu_long_streaming.sh OUT long          the long-rollout student from the Self-Forcing one and the
#                                                           control self_forcing_more; with two GPUs both at once
#                                                           (--only-stage, one per GPU; logs OUT/lane_*.txt)
#   bash benchmarks/gpu_long_streaming.sh OUT long_rollout  the long-rollout student alone (from Self-Forcing); with
#                                                           LANE_GPU, two OUTs holding copies of the same teacher /
#                                                           ode / self_forcing stages train two variants at once
#                                                           (EXTRA="--switch-prob 0" in one of them)
# LANE_GPU=N pins every part to GPU N (then long trains its two stages one after the other).
# The device machine lacks colossalai / mmengine / diffusers: carry .whl (../shared/tools/device_wheels.sh train) and
# start the call with the pip line that script prints. EXTRA: more flags for the benchmark (e.g. --seed 777;
# EXTRA="--rope-anchor both" with eval adds the long run with the text and sinks anchored at the window's start;
# EXTRA="--long-init self_forcing" trains the long-rollout student from the Self-Forcing one plus the control
# self_forcing_more, Self-Forcing trained on for as long; "--sink-frames-variant 0" adds the long run without sinks).
set -euo pipefail
out=${1:?usage: gpu_long_streaming.sh OUT prep|students|eval|options|teacher|self_forcing|long|long_rollout}
part=${2:?usage: gpu_long_streaming.sh OUT prep|students|eval|options|teacher|self_forcing|long|long_rollout}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$out"
[ -n "${LANE_GPU:-}" ] && export CUDA_VISIBLE_DEVICES=$LANE_GPU
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
run=(python -m benchmarks.long_streaming_quality --out "$out" ${EXTRA:-})
case "$part" in
teacher) "${run[@]}" --stop-after teacher 2>&1 | grep -v -i warn | tail -n 20 ;;
self_forcing) "${run[@]}" --stop-after self_forcing 2>&1 | grep -v -i warn | tail -n 20 ;;
long)
  if [ -z "${LANE_GPU:-}" ] && [ "$(nvidia-smi --list-gpus | wc -l)" -ge 2 ]; then  # the two stages a GPU each
    for stage in long_rollout self_forcing_more; do
      gpu=$([ $stage = long_rollout ] && echo 0 || echo 1)
      CUDA_VISIBLE_DEVICES=$gpu "${run[@]}" --long-init self_forcing --only-stage $stage > "$out/lane_$stage.txt" 2>&1 &
    done
    status=0
    for job in $(jobs -p); do wait "$job" || status=1; done
    grep -h -E "trained in|reusing|Error" "$out"/lane_*.txt | tail -n 8
    exit $status
  fi
  "${run[@]}" --long-init self_forcing --stop-after long_rollout 2>&1 | grep -v -i warn | tail -n 20 ;;
long_rollout) "${run[@]}" --long-init self_forcing --only-stage long_rollout 2>&1 | grep -v -i warn | tail -n 20 ;;
prep) "${run[@]}" --stop-after ode 2>&1 | grep -v -i warn | tail -n 20 ;;
students) "${run[@]}" --stop-after long_rollout 2>&1 | grep -v -i warn | tail -n 20 ;;
eval) "${run[@]}" 2>&1 | grep -v -i warn | tail -n 120 | tee "$out/report.txt" ;;
options)
  "${run[@]}" --kv-recache both --prompt-switch 2>&1 | grep -v -i warn | tail -n 120 | tee "$out/report_options.txt"
  cp "$out/report.json" "$out/report_options.json" ;;
*) echo "unknown part $part (prep|students|eval|options|teacher|self_forcing|long|long_rollout)" >&2; exit 2 ;;
esac
