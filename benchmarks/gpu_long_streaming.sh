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
# The device machine lacks colossalai / mmengine / diffusers: carry .whl (../shared/tools/device_wheels.sh train) and
# start the call with the pip line that script prints. EXTRA: more flags for the benchmark (e.g. --seed 777;
# EXTRA="--rope-anchor both" with eval adds the long run with the text and sinks anchored at the window's start;
# EXTRA="--long-init self_forcing" trains the long-rollout student from the Self-Forcing one plus the control
# self_forcing_more, Self-Forcing trained on for as long; "--sink-frames-variant 0" adds the long run without sinks).
set -euo pipefail
out=${1:?usage: gpu_long_streaming.sh OUT prep|students|eval|options}
part=${2:?usage: gpu_long_streaming.sh OUT prep|students|eval|options}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
run=(python -m benchmarks.long_streaming_quality --out "$out" ${EXTRA:-})
case "$part" in
prep) "${run[@]}" --stop-after ode 2>&1 | grep -v -i warn | tail -n 20 ;;
students) "${run[@]}" --stop-after long_rollout 2>&1 | grep -v -i warn | tail -n 20 ;;
eval) "${run[@]}" 2>&1 | grep -v -i warn | tail -n 120 | tee "$out/report.txt" ;;
options)
  "${run[@]}" --kv-recache both --prompt-switch 2>&1 | grep -v -i warn | tail -n 120 | tee "$out/report_options.txt"
  cp "$out/report.json" "$out/report_options.json" ;;
*) echo "unknown part $part (prep|students|eval|options)" >&2; exit 2 ;;
esac
