#!/usr/bin/env bash
# Device calls for padded prompts at unpadded speed, compiled blocks by default and FP8 (one GPU). Usage, from the
# repository root on the GPU machine, with the wheels in .whl/ (diffusers, torchao, ...):
#   bash benchmarks/gpu_padded_text.sh tests|step|fp8|trainer ...   (results under $OUT)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target .pysite .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD/.pysite:$PWD OMP_NUM_THREADS=4
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
for part in "$@"; do
  t0=$(date +%s)
  case $part in
    tests)  # bf16 vs the fp32 masked reference, compiled with checkpointing / LoRA / causal, recompiles
      timeout ${TESTS_S:-150} python -m pytest -q -p no:cacheprovider -s tests/test_text_padding_gpu.py -k "${TESTS_K:-}" \
        > "$OUT/gpu_tests.txt" 2>&1; tail -5 "$OUT/gpu_tests.txt" ;;
    step)  # the real configuration next to diffusers' Flux, interleaved
      timeout ${STEP_S:-300} python benchmarks/padded_text_step.py --out "$OUT/padded_text_step.json" ${STEP_ARGS:-} \
        > "$OUT/padded_text_step.txt" 2>&1; tail -16 "$OUT/padded_text_step.txt" ;;
    fp8)
      timeout ${FP8_S:-300} python benchmarks/fp8_step.py --out "$OUT/fp8_step.json" > "$OUT/fp8_step.txt" 2>&1
      tail -9 "$OUT/fp8_step.txt" ;;
    trainer)  # the trainer with the GPU configs' defaults (compiled blocks) vs the bare compiled step
      timeout 400 python benchmarks/train_step.py --runs "trainer-compile@full;ours-compile-traced@full" \
        --out "$OUT/trainer_compile.json" > "$OUT/trainer_compile.txt" 2>&1; tail -6 "$OUT/trainer_compile.txt" ;;
  esac
  echo "== $part: $(( $(date +%s) - t0 )) s"
done
