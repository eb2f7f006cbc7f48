#!/usr/bin/env bash
# Streaming speed at the 1B shape on one GPU: the streaming GPU tests (chunk graphs, graphed decode, decode overlap
# bitwise equal to the serial order, graphed peak memory flat in the length, pass graphs of the teacher), then
# `benchmarks.streaming speed` with the defaults a user gets on a GPU (CUDA graphs + decode overlap) against the
# 30-step CFG teacher, eager and graphed, in paired rounds: at 256x256 and at 480x832 (33 frames). The VAE is the
# one of the benchmark config (`--config`; the default, mmdit_1b_synthetic.py, has a tiny stand-in HunyuanVideo VAE,
# so these numbers are "(stand-in decoder)" ones).
#   bash benchmarks/gpu_streaming_speed.sh OUT_DIR        (~8-9 min on one H100 or H200)
# Writes OUT_DIR/tests.txt, OUT_DIR/speed_{256,480x832}.txt and OUT_DIR/streaming_{256,480x832}/speed.json.
set -uo pipefail
if [ $# -lt 1 ]; then
    echo "usage: bash $0 OUT_DIR" >&2
    exit 2
fi
out=$1
mkdir -p "$out"
export PYTHONUNBUFFERED=1
start=$(date +%s)
left() { echo $((${BUDGET:-540} - ($(date +%s) - start))); }
timeout 150 python -m pytest -q tests/test_streaming_gpu.py tests/test_chunk_graphs_gpu.py tests/test_pass_graphs_gpu.py \
    2>&1 | tail -n 8 | tee "$out/tests.txt"
common="--lengths 1 --merge-refill off --overlap-decode on --teacher-graphs both"
timeout 200 python -m benchmarks.streaming speed $common --paired 5 --out "$out/streaming_256" 2>&1 \
    | tee "$out/speed_256.txt" | tail -n 30
timeout $(( $(left) > 60 ? $(left) - 10 : 10 )) python -m benchmarks.streaming speed $common --size 480 832 \
    --paired 3 --teacher-repeats 1 --out "$out/streaming_480x832" 2>&1 | tee "$out/speed_480x832.txt" | tail -n 30
echo "elapsed $(( $(date +%s) - start )) s"
