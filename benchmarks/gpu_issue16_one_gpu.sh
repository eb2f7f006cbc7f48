#!/usr/bin/env bash
# Issue 16's one-GPU checks still owed (run on an H200; each part fits one call of < 10 min). Results under OUT.
#   bash benchmarks/gpu_issue16_one_gpu.sh OUT step     the compiled step vs diffusers Flux on this GPU (goal 3's H200
#                                                       number) and the trainer with compiled blocks vs that step
#                                                       (goal 1 at the compiled speed), interleaved
#   bash benchmarks/gpu_issue16_one_gpu.sh OUT gemini   Gemini static / auto exact resume with 4 steps (the fp32
#                                                       master fix shows at the second resumed step; each 1B save
#                                                       writes ~17 GB, hence the long run timeout)
#   bash benchmarks/gpu_issue16_one_gpu.sh OUT tokens   goal 4: the largest token count with selective / full
#                                                       checkpointing (the first run's search budget ran out)
set -uo pipefail
out=${1:?usage: gpu_issue16_one_gpu.sh OUT step|gemini|tokens}
part=${2:?usage: gpu_issue16_one_gpu.sh OUT step|gemini|tokens}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
case "$part" in
step)
    runs="ours-compile-traced@none;diffusers-flash@none;ours-eager@none;ours-compile-traced@none;diffusers-flash@none"
    python benchmarks/train_step.py --runs "$runs" --warmup 3 --iters 15 --timeout 150 --out "$out/step_none.json"
    runs="trainer-compile@full;ours-compile-traced@full;trainer@full;trainer-compile@full;ours-compile-traced@full"
    python benchmarks/train_step.py --runs "$runs" --warmup 4 --iters 12 --audit-steps 1 --timeout 200 \
        --out "$out/step_trainer.json"
    ;;
gemini)
    NPROC=1 STEPS=4 RUN_TIMEOUT=400 VARIANTS="gemini-static gemini-auto" bash benchmarks/gemini_check.sh /tmp/gc resume
    cp /tmp/gc/gemini_check_resume.json "$out/" 2> /dev/null
    ;;
tokens)
    python benchmarks/max_tokens.py --modes selective,full --max-frames 400 --budget-s 400 --out "$out/max_tokens.json"
    ;;
*)
    echo "unknown part '$part' (step|gemini|tokens)" >&2
    exit 2
    ;;
esac
