#!/usr/bin/env bash
# Exact-once streamed decode with the real-size HunyuanVideo VAE on one GPU: the GPU tests of the fast chunk decode
# (fused group norm, graphs, against the eager diffusers decoder), one chunk's decode time at 480x832 interleaved with
# the eager diffusers decode and the overlap rule (and the decode options), then end-to-end streaming with the 1B
# causal student and the real-size VAE at 480x832 and 256px (1x and 4x the 33-frame clip; graphed 30-step CFG
# teacher). RULES=1 adds each chunk rule's deviation from the whole-clip decode (256px, real-size VAE, random
# weights) and OVERLAP=1 the overlap rule end to end at 480x832.
#   bash benchmarks/gpu_streaming_decode.sh OUT_DIR
set -uo pipefail
if [ $# -lt 1 ]; then
    echo "usage: bash $0 OUT_DIR" >&2
    exit 2
fi
out=$1
mkdir -p "$out"
export PYTHONUNBUFFERED=1
common=(--frames 33 --text-cache on --cuda-graphs on --merge-refill off --overlap-decode on --only window-graphs-overlap
    --teacher-graphs on --teacher-repeats 1)
{
    python -m pytest -q tests/test_streaming_decode_gpu.py tests/test_group_norm.py 2>&1 | tail -25
    python benchmarks/streaming_decode.py speed --out "$out"
    python benchmarks/streaming.py speed --size 480 832 --lengths 1 4 "${common[@]}" --out "$out/s480"
    if [ "${RULES:-0}" = 1 ]; then python benchmarks/streaming_decode.py rules --out "$out"; fi
    python benchmarks/streaming.py speed --size 256 256 --lengths 1 4 "${common[@]}" --out "$out/s256"
    if [ "${OVERLAP:-0}" = 1 ]; then
        python benchmarks/streaming.py speed --size 480 832 --lengths 1 --decode-rule overlap "${common[@]}" \
            --teacher-steps 0 --out "$out/s480_overlap"
    fi
} 2>&1 | tee "$out/log.txt"
