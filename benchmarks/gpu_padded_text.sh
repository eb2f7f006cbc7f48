#!/usr/bin/env bash
# Device calls for padded prompts at unpadded speed, compiled blocks by default and FP8 (one GPU). Usage, from the
# repository root on the GPU machine, with the wheels in .whl/ (diffusers, torchao, ...):
#   bash benchmarks/gpu_padded_text.sh tests|zero-keys|graph-ckpt|lora|step|fp8|trainer|trainer-padded|trainer-ema|trainer-vs-bare ...
# Per-part limits (seconds, env TESTS_S STEP_S FP8_S TRAINER_S): tests 280 + step 270 fit one 580 s device call,
# fp8 220 + trainer 330 another. STEP_ARGS / FP8_ARGS / TRAINER_ARGS add flags (e.g. STEP_ARGS="--variants ...
# --profile-steps 2", FP8_ARGS="--widths 11b-width", TRAINER_ARGS="--profile-steps 2").
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target .pysite .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD/.pysite:$PWD OMP_NUM_THREADS=4
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
bare_round() {  # the bare padded step in bf16 and with the trainer's fp32 masters, one process
  timeout ${STEP_S:-150} python -m benchmarks.padded_text_step --no-diffusers --rounds 1 \
    --variants ours-padded-bound-graph-ckpt,ours-padded-bound-graph-ckpt-master \
    --out "$OUT/bare_padded_$1.json" > "$OUT/bare_padded_$1.txt" 2>&1; tail -3 "$OUT/bare_padded_$1.txt"
}
for part in "$@"; do
  t0=$(date +%s)
  case $part in
    tests)  # batch-1 exact trim + thread-count fix (alone: the autograd thread starts after the pinning loader),
      # compiled batch-1 padded steps, then bf16 vs the fp32 masked reference, checkpointing / LoRA / causal, recompiles
      k="not pinning_loader${TESTS_K:+ and ($TESTS_K)}"
      { timeout 120 python -m pytest -q -p no:cacheprovider -s tests/test_text_padding_gpu.py -k pinning_loader
        timeout 70 python -m pytest -q -p no:cacheprovider tests/test_mmdit_gpu.py -k "compiled_blocks_match_eager_on_gpu and True-1-"
        timeout $(( ${TESTS_S:-280} - 190 )) python -m pytest -q -p no:cacheprovider -s tests/test_text_padding_gpu.py -k "$k"
      } > "$OUT/gpu_tests.txt" 2>&1; grep -E "passed|failed|error|graphs" "$OUT/gpu_tests.txt" | tail -8 ;;
    zero-keys)  # the zero-key path's GPU tests: kernels vs fp32 masked attention, the model eager / compiled
      timeout ${TESTS_S:-200} python -m pytest -q -p no:cacheprovider tests/test_text_padding_gpu.py -k zero \
        > "$OUT/zero_keys_gpu_tests.txt" 2>&1; tail -4 "$OUT/zero_keys_gpu_tests.txt" ;;
    graph-ckpt)  # checkpointed compiled blocks, the recompute inside the graph (the default) and checkpointing around the
      # compiled block: equal, same memory, each against the fp32 masked reference, batch 1 from a pinning loader and
      # the causal student both ways (LoRA: the lora part runs both ways)
      { timeout ${TESTS_S:-300} python -m pytest -q -p no:cacheprovider tests/test_graph_checkpoint.py
        timeout ${TESTS_S:-300} python -m pytest -q -p no:cacheprovider tests/test_text_padding_gpu.py -k "(in_graph or around) and not lora"
      } > "$OUT/graph_checkpoint_gpu_tests.txt" 2>&1; grep -E "passed|failed|error" "$OUT/graph_checkpoint_gpu_tests.txt" | tail -4 ;;
    lora)  # compiled LoRA with padded text; peft would import the wheel set's stub bitsandbytes, so hide it here
      site=$PWD/.pysite; [ -d "$site/bitsandbytes" ] && mv "$site/bitsandbytes" "$site/.bitsandbytes_hidden"
      timeout ${TESTS_S:-120} python -m pytest -q -p no:cacheprovider tests/test_text_padding_gpu.py -k lora \
        > "$OUT/lora_gpu_test.txt" 2>&1; tail -4 "$OUT/lora_gpu_test.txt"
      [ -d "$site/.bitsandbytes_hidden" ] && mv "$site/.bitsandbytes_hidden" "$site/bitsandbytes" ;;
    step)  # the real configuration next to diffusers' Flux, interleaved
      timeout ${STEP_S:-270} python -m benchmarks.padded_text_step --out "$OUT/padded_text_step.json" ${STEP_ARGS:-} \
        > "$OUT/padded_text_step.txt" 2>&1; tail -16 "$OUT/padded_text_step.txt" ;;
    fp8)
      timeout ${FP8_S:-220} python -m benchmarks.fp8_step --out "$OUT/fp8_step.json" ${FP8_ARGS:-} > "$OUT/fp8_step.txt" 2>&1
      tail -9 "$OUT/fp8_step.txt" ;;
    trainer)  # the trainer with the GPU configs' defaults (compiled blocks) vs the bare compiled step
      # (recompiles logged: a GLOBAL_STATE num_threads reason would mean the thread-count fix does not hold)
      TORCH_LOGS=recompiles timeout ${TRAINER_S:-330} python -m benchmarks.train_step \
        --runs "trainer-compile@full;ours-compile-traced@full" --out "$OUT/trainer_compile.json" ${TRAINER_ARGS:-} \
        > "$OUT/trainer_compile.txt" 2>&1; tail -6 "$OUT/trainer_compile.txt"
      echo "recompiles: $(grep -c 'Recompiling function' "$OUT/trainer_compile.txt")," \
        "num_threads reasons: $(grep -c 'num_threads' "$OUT/trainer_compile.txt")" ;;
    trainer-padded)  # the trainer at padded_text_step's shape (mmdit_1b_padded_text_shape.py) beside the bare step in
      # bf16 and with the trainer's optimizer precision, alternated twice (separate processes, so repeated, not interleaved)
      for round in 1 2; do
        bare_round $round
        timeout ${TRAINER_S:-150} python -m benchmarks.train_step --runs "trainer@full" \
          --trainer-config configs/diffusion/train/mmdit_1b_padded_text_shape.py ${TRAINER_ARGS:-} \
          --out "$OUT/trainer_padded_$round.json" > "$OUT/trainer_padded_$round.txt" 2>&1; tail -2 "$OUT/trainer_padded_$round.txt"
      done ;;
    trainer-ema)  # what the EMA costs the trainer at the padded shape: with it, without it, with it again, and the
      # gradients through ColossalAI's bucket store (one process each; the bare step with masters is trainer-padded's)
      timeout ${TRAINER_S:-200} python -m benchmarks.train_step \
        --runs "trainer@full;trainer-noema@full;trainer-bucketed@full;trainer@full" \
        --trainer-config configs/diffusion/train/mmdit_1b_padded_text_shape.py ${TRAINER_ARGS:-} \
        --out "$OUT/trainer_ema.json" > "$OUT/trainer_ema.txt" 2>&1; tail -6 "$OUT/trainer_ema.txt" ;;
    trainer-vs-bare)  # the trainer (EMA from the fp32 masters on one rank), without EMA, and again, between two rounds
      # of the bare step with masters: one quiet comparison of the trainer against its bare step
      for round in 1 2; do
        bare_round $round
        [ $round = 2 ] && break
        timeout ${TRAINER_S:-200} python -m benchmarks.train_step --runs "trainer@full;trainer-noema@full;trainer@full" \
          --trainer-config configs/diffusion/train/mmdit_1b_padded_text_shape.py ${TRAINER_ARGS:-} \
          --out "$OUT/trainer_vs_bare.json" > "$OUT/trainer_vs_bare.txt" 2>&1; tail -5 "$OUT/trainer_vs_bare.txt"
      done ;;
  esac
  echo "== $part: $(( $(date +%s) - t0 )) s"
done
