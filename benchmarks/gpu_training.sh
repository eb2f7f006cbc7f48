#!/usr/bin/env bash
# The training benchmarks on GPUs, one part per measurement, each fitting one call of < 10 min; results under OUT.
# Run from the repository root. benchmarks/README.md has the current numbers each part gives.
#   bash benchmarks/gpu_training.sh OUT compiled-step   1 GPU: the compiled-blocks GPU test, then the 1B step with
#                                                       compiled blocks (SDPA traced) vs eager vs diffusers' Flux
#                                                       (flash), without and with full checkpointing, interleaved
#   bash benchmarks/gpu_training.sh OUT trainer-step    1 GPU: the non-finite check's GPU tests, then the real trainer
#                                                       vs the bare step with the trainer's optimizer precision (and
#                                                       the synchronous check, and the bf16-only bare step), twice
#   bash benchmarks/gpu_training.sh OUT compiled-trainer  1 GPU: the trainer with compiled blocks vs the compiled bare
#                                                       step and the eager trainer, full checkpointing
#   bash benchmarks/gpu_training.sh OUT max-tokens      1 GPU: the largest token count per checkpointing mode
#   bash benchmarks/gpu_training.sh OUT resume          1 GPU: exact resume of ZeRO-2, Gemini static and Gemini auto
#                                                       over 4 steps on a quarter of the 1B model (saves of ~4 GB)
#   bash benchmarks/gpu_training.sh OUT scaling         2 GPUs: the ZeRO GPU tests, then 1-GPU / 2-GPU ZeRO-2 scaling
#                                                       (the default multi-rank step and ColossalAI's own), 3 rounds
#   VARIANTS=V bash benchmarks/gpu_training.sh OUT 11b  2 GPUs: the 11B preset, V = gemini-offload (Gemini with the
#                                                       optimizer on the host: fits 80 GB cards) or zero2 (all on the
#                                                       GPUs: needs 141 GB cards); one call each
# The Flux rows need diffusers on the device (carry it as for benchmarks.train_step).
set -uo pipefail
out=${1:?usage: gpu_training.sh OUT compiled-step|trainer-step|compiled-trainer|max-tokens|resume|scaling|11b}
part=${2:?usage: gpu_training.sh OUT compiled-step|trainer-step|compiled-trainer|max-tokens|resume|scaling|11b}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
case "$part" in
compiled-step)
    timeout 150 python -m pytest -q -m gpu tests/test_mmdit_compile.py 2>&1 | tail -n 4 | tee "$out/gpu_tests.txt"
    runs="ours-compile-traced@none;diffusers-flash@none;ours-eager@none"
    runs="$runs;ours-compile-traced@full;diffusers-flash@full;ours-eager@full"
    python -m benchmarks.train_step --runs "$runs" --warmup 3 --iters 15 --timeout 150 --out "$out/train_step_compiled.json"
    ;;
trainer-step)
    timeout 300 python -m pytest -q -m gpu tests/test_nonfinite_check.py tests/test_train.py -k "gpu or synthetic" \
        -p no:cacheprovider 2>&1 | tail -n 8 | tee "$out/gpu_tests.txt"
    runs="trainer@full;trainer-sync@full;ours-eager-master-fused@full;ours-eager@full"
    runs="$runs;trainer@full;trainer-sync@full;ours-eager-master-fused@full"
    python -m benchmarks.train_step --runs "$runs" --warmup 4 --iters 30 --audit-steps 1 --timeout 150 \
        --out "$out/train_step_trainer.json"
    ;;
compiled-trainer)
    runs="trainer-compile@full;ours-compile-traced@full;trainer@full;trainer-compile@full;ours-compile-traced@full"
    python -m benchmarks.train_step --runs "$runs" --warmup 4 --iters 12 --audit-steps 1 --timeout 200 \
        --out "$out/train_step_compiled_trainer.json"
    ;;
max-tokens)
    python -m benchmarks.max_tokens --modes none,selective,full --max-frames 400 --budget-s 500 \
        --out "$out/max_tokens.json"
    ;;
resume)
    quarter="--model.depth_double 2 --model.depth_single 4 --model.grad_ckpt_double 2 --model.grad_ckpt_single 4"
    NPROC=1 STEPS=4 RUN_TIMEOUT=170 RESUME_ARGS="$quarter" bash benchmarks/gemini_check.sh "$out/runs" resume
    cp "$out/runs/gemini_check_resume.json" "$out/" 2> /dev/null
    ;;
scaling)
    timeout 240 python -m pytest -q -m gpu tests/test_zero_single_rank.py 2>&1 | tail -n 6 | tee "$out/gpu_tests.txt"
    # 1 GPU (the one-rank path, shared by both variants), then 2 GPUs with each variant; 3 interleaved rounds
    timeout 330 bash benchmarks/train_scaling.sh --repeats 3 --plugins "zero2 zero2-cai" --gpus "1 2" --shared-base \
        --steps 16 --skip 5 --config configs/diffusion/train/mmdit_1b_bench_shape.py --out "$out/runs" 2>&1 \
        | grep -v "^==" | tail -n 20 | tee "$out/scaling.txt"
    cp "$out/runs/scaling.json" "$out/scaling_r3.json" 2> /dev/null
    ;;
11b)
    RUN_TIMEOUT=${RUN_TIMEOUT:-520} STEPS=${STEPS:-3} VARIANTS=${VARIANTS:?set VARIANTS=gemini-offload or zero2} \
        bash benchmarks/gemini_check.sh "$out/runs" 11b
    cp "$out/runs/gemini_check_11b.json" "$out/" 2> /dev/null
    ;;
*)
    echo "unknown part '$part' (compiled-step|trainer-step|compiled-trainer|max-tokens|resume|scaling|11b)" >&2
    exit 2
    ;;
esac
