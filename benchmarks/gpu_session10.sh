#!/usr/bin/env bash
# The device calls of 2026-11-26 (session 10), kept as the commands behind their rows. Results under OUT.
#   bash benchmarks/gpu_session10.sh OUT trainer   one GPU: the deferred non-finite check's GPU test and the 1B
#                                                  synthetic training test, then goal 1 (trainer vs bare step, p90/p10)
#                                                  with the default deferred check and the synchronous one, interleaved
#   bash benchmarks/gpu_session10.sh OUT step      one GPU: goal 3 on this GPU (gpu_issue16_one_gpu.sh step)
#   bash benchmarks/gpu_session10.sh OUT resume    one GPU: exact resume of zero2 (deferred check), Gemini static and
#                                                  auto over 4 steps, on a quarter of the 1B model (saves of ~4 GB)
#   bash benchmarks/gpu_session10.sh OUT multi     2 GPUs: the deferred check's tests on CUDA (two ranks over NCCL
#                                                  included), then 2-GPU ZeRO-2 scaling with it, 3 interleaved rounds
#   bash benchmarks/gpu_session10.sh OUT 11b       2 GPUs: the 11B preset with Gemini + host-offloaded optimizer
set -uo pipefail
out=${1:?usage: gpu_session10.sh OUT trainer|step|resume|multi|11b}
part=${2:?usage: gpu_session10.sh OUT trainer|step|resume|multi|11b}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
case "$part" in
trainer)
    timeout 300 python -m pytest -q -m gpu tests/test_nonfinite_check.py tests/test_train.py -k "gpu or synthetic" \
        -p no:cacheprovider -s 2>&1 | tail -25 | tee "$out/gpu_tests.txt"
    runs="trainer@full;trainer-sync@full;ours-eager-master-fused@full;ours-eager@full"
    runs="$runs;trainer@full;trainer-sync@full;ours-eager-master-fused@full"
    python benchmarks/train_step.py --runs "$runs" --warmup 4 --iters 30 --audit-steps 1 --timeout 150 \
        --out "$out/train_step_trainer_deferred.json"
    ;;
step)
    bash benchmarks/gpu_issue16_one_gpu.sh "$out" step
    ;;
resume)
    quarter="--model.depth_double 2 --model.depth_single 4 --model.grad_ckpt_double 2 --model.grad_ckpt_single 4"
    NPROC=1 STEPS=4 RUN_TIMEOUT=170 RESUME_ARGS="$quarter" bash benchmarks/gemini_check.sh /tmp/gc resume
    cp /tmp/gc/gemini_check_resume.json "$out/" 2> /dev/null
    for f in /tmp/gc/*.log; do tail -5 "$f" > "$out/$(basename "$f").tail"; done
    ;;
multi)
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    nvidia-smi --query-gpu=index,name --format=csv,noheader | tee -a "$out/gpu.txt"
    timeout 200 python -m pytest -q tests/test_nonfinite_check.py -p no:cacheprovider 2>&1 | tail -8 \
        | tee "$out/nonfinite_tests.txt"
    timeout 330 bash benchmarks/train_scaling.sh --repeats 3 --plugins zero2 --gpus "1 2" --steps 16 --skip 5 \
        --config configs/diffusion/train/mmdit_1b_bench_shape.py --out /tmp/scaling 2>&1 | grep -v "^==" | tail -n 14 \
        | tee "$out/scaling.txt"
    cp /tmp/scaling/scaling.json "$out/scaling_r3.json" 2> /dev/null
    ;;
11b)
    RUN_TIMEOUT=540 STEPS=4 VARIANTS=gemini-offload bash benchmarks/gemini_check.sh /tmp/gc11 11b
    cp /tmp/gc11/gemini_check_11b.json "$out/" 2> /dev/null
    tail -30 /tmp/gc11/11b-gemini-offload.log > "$out/11b-gemini-offload.log.tail"
    ;;
*)
    echo "unknown part '$part' (trainer|step|resume|multi|11b)" >&2
    exit 2
    ;;
esac
