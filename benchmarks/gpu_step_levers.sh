#!/usr/bin/env bash
# Levers on the real configuration's training step, on one GPU: FlashAttention 4 against cuDNN (the attention call
# and the step), the compiled blocks as CUDA graphs, and first the model backend parity check. FA4's wheels and ours
# cannot travel together (.whl 42 MB, .fa4/a 47 MB, .fa4/b 52 MB, 64 MiB a call), so calls to one warm machine:
#   call 1, carry [".fa4/a"]: bash benchmarks/fa4_wheels.sh stash /tmp/fa4
#   call 2, carry [".whl"]:   python3 -m pip install -q --no-index --no-deps --no-compile --target .pysite .whl/*.whl
#   call 3, carry [".fa4/b"]: bash benchmarks/fa4_wheels.sh install /tmp/fa4 && bash benchmarks/gpu_step_levers.sh parity fa4 tests
#   call 4 (no carry):         bash benchmarks/gpu_step_levers.sh step
#   call 5 (no carry):         bash benchmarks/gpu_step_levers.sh cudagraphs
#   without FA4, after call 2:  bash benchmarks/gpu_step_levers.sh cudnn     (rm -rf .pysite/bitsandbytes* first for
#                               the LoRA GPU tests: the device wheels' stub lacks bitsandbytes.nn, which peft probes)
# (a call has 600 s: the first three parts are capped at 120 + 240 + 180 s, step and cudagraphs at 420 s each; no
# argument runs parity fa4 tests step)
# Writes to $OUT: fa4.json (forward + backward of one attention call: FA4 dense / varlen vs cuDNN / flash SDPA, errors
# against fp64), gpu_tests.txt (the FA4 zero-key GPU test and the model backend tests, with tracebacks) and
# padded_text_step_fa4.json (the trainer's step with the "fa4" backend vs cuDNN vs diffusers' Flux, interleaved),
# and first model_backend_parity.json (a tiny MMDiT's backends against fp32 math). cudagraphs:
# padded_text_step_cudagraphs.json, the trainer's step with its compiled block graphs replayed as CUDA graphs vs
# without vs diffusers. inductor (needs no FA4): padded_text_step_inductor.json, the trainer's step with Inductor's
# max-autotune GEMMs and with its coordinate-descent tuning vs the default vs diffusers. cudnn (needs no FA4):
# cudnn_backward_layout.json (the cuDNN backward-graph cache collision behind the model backend test's failure) and
# cudnn_gpu_tests.txt (that test and the zero-key / plain cuDNN order test, with tracebacks).
set -uo pipefail
: "${OUT:?set OUT}"
export PYTHONPATH="$(cat /tmp/fa4/pythonpath):$PWD/.pysite:$PWD" PYTHONUNBUFFERED=1
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(parity fa4 tests step)
for part in "${parts[@]}"; do
  case $part in
    parity)
      timeout 120 python -m benchmarks.model_backend_parity --out "$OUT/model_backend_parity.json" \
        > "$OUT/model_backend_parity.txt" 2>&1
      echo "non-finite cases: $(grep -c NON-FINITE "$OUT/model_backend_parity.txt")"; tail -n 2 "$OUT/model_backend_parity.txt" ;;
    fa4)
      timeout 240 python -m benchmarks.flash_attention4 --out "$OUT/fa4.json" 2>&1 | tee "$OUT/fa4.txt" | tail -n 12 ;;
    tests)
      timeout 180 python -m pytest -q -p no:cacheprovider -m gpu --tb=short tests/test_fa4_kernel.py \
        "tests/test_mmdit.py::test_model_backends_match_math_on_gpu" > "$OUT/gpu_tests.txt" 2>&1
      tail -n 3 "$OUT/gpu_tests.txt" ;;
    step)
      timeout 420 python -m benchmarks.padded_text_step --rounds 3 \
        --variants ours-padded-bound-graph-ckpt,ours-padded-bound-graph-ckpt-fa4,diffusers-128 \
        --out "$OUT/padded_text_step_fa4.json" 2>&1 | tail -n 12 ;;
    cudnn)
      timeout 120 python -m benchmarks.cudnn_backward_layout --out "$OUT/cudnn_backward_layout.json" 2>&1 \
        | grep -E "^tokens|^cache|^\{|Error" | cut -c1-400
      timeout 240 python -m pytest -q -p no:cacheprovider -m gpu --tb=short "tests/test_mmdit.py::test_model_backends_match_math_on_gpu" \
        "tests/test_text_padding_gpu.py::test_zero_key_and_plain_cudnn_backwards_at_one_shape_in_one_process_are_both_right" \
        > "$OUT/cudnn_gpu_tests.txt" 2>&1
      tail -n 3 "$OUT/cudnn_gpu_tests.txt" ;;
    inductor)  # Inductor's own levers, each a model of its own: GEMM autotuning (epilogue fusion), coordinate descent
      timeout 540 python -m benchmarks.padded_text_step --rounds 3 \
        --variants ours-padded-bound-graph-ckpt,ours-padded-bound-graph-ckpt-autotune,ours-padded-bound-graph-ckpt-coordesc,diffusers-128 \
        --out "$OUT/padded_text_step_inductor.json" 2>&1 | tail -n 14 ;;
    cudagraphs)
      timeout 420 python -m benchmarks.padded_text_step --rounds 3 \
        --variants ours-padded-bound-graph-ckpt,ours-padded-bound-graph-ckpt-cudagraphs,diffusers-128 \
        --out "$OUT/padded_text_step_cudagraphs.json" 2>&1 | tail -n 12 ;;
    *) echo "unknown part $part (parity fa4 tests step cudagraphs inductor cudnn)" >&2; exit 2 ;;
  esac
done
