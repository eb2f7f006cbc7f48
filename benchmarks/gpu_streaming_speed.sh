#!/usr/bin/env bash
# Issue 13 on one GPU: the streaming GPU tests (merged refill + CUDA graphs vs eager, graphed decode, no memory left
# behind by graph captures, decode overlap bitwise equal to the serial order, graphed peak memory flat from 1x to 4x),
# then `streaming.py speed` at the 1B shape (random weights): teacher vs student with and without the merged refill,
# eager and graphed, graphed with the decode serial and overlapped, at 1x/2x/4x the training length, with the FLOP
# ceiling, the graphed decode time and its top kernels.
# Then the merged refill without a mask: `--text-mask full` marks every text token valid (the tokenizer pads the
# prompt to 512 tokens otherwise, which keeps every pass masked), so the text-cached merged passes make two mask-free
# SDPA calls per block; separate vs merged, serial decode, 1x and 4x.
#   bash benchmarks/gpu_streaming_speed.sh OUT_DIR
# Writes OUT_DIR/tests.txt, OUT_DIR/speed.txt, OUT_DIR/streaming_1b/speed.json, OUT_DIR/speed_unpadded.txt and
# OUT_DIR/streaming_1b_unpadded/speed.json; ~5-8 minutes on one H100.
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
python benchmarks/streaming.py speed --text-mask full --merge-refill both --overlap-decode off --lengths 1 4 \
    --out "$out/streaming_1b_unpadded" 2>&1 | tee "$out/speed_unpadded.txt" | tail -40
