#!/usr/bin/env bash
# Issue 13 on one GPU: the streaming GPU tests (merged refill + CUDA graphs vs eager, graphed decode, no memory left
# behind by graph captures, decode overlap bitwise equal to the serial order, graphed peak memory flat from 1x to 4x),
# then `streaming.py speed` at the 1B shape (random weights): teacher vs student with and without the merged refill,
# eager and graphed, graphed with the decode serial and overlapped, at 1x/2x/4x the training length, with the FLOP
# ceiling, the graphed decode time and its top kernels.
# Then the passes without a mask: `--text-mask full` marks every text token valid (the tokenizer pads the prompt to
# 512 tokens otherwise, which keeps every pass masked), so the text-cached passes run mask-free (the merged ones as two
# SDPA calls per block); `--text-mask trim` cuts the student's padded text tail instead (exact; the teacher keeps its
# 512 tokens); separate vs merged, serial decode, 1x and 4x.
#   bash benchmarks/gpu_streaming_speed.sh OUT_DIR
# Writes OUT_DIR/tests.txt, OUT_DIR/speed.txt, OUT_DIR/streaming_1b/speed.json, OUT_DIR/speed_{unpadded,trim}.txt and
# OUT_DIR/streaming_1b_{unpadded,trim}/speed.json; ~7-10 minutes on one H100.
set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: bash $0 OUT_DIR" >&2
    exit 2
fi
out=$1
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python -m pytest -q tests/test_streaming_gpu.py tests/test_chunk_graphs_gpu.py 2>&1 | tee "$out/tests.txt" | tail -5 || true
python benchmarks/streaming.py speed --out "$out/streaming_1b" 2>&1 | tee "$out/speed.txt" | tail -40
for mode in full trim; do
    name=$([ "$mode" = full ] && echo unpadded || echo trim)
    python benchmarks/streaming.py speed --text-mask "$mode" --merge-refill both --overlap-decode off --lengths 1 4 \
        --out "$out/streaming_1b_$name" 2>&1 | tee "$out/speed_$name.txt" | tail -40
done
