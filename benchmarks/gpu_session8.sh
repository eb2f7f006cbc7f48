#!/usr/bin/env bash
# One-GPU call: GPU tests owed (group norm rule, pass graphs), the streaming speed at the 1B shape at 256px and at
# 480x832 with the teacher eager and graphed and paired rounds (issue 13), then the compiled-block parity hunt
# (issue 16 goal 3) with what is left of the call. Results under OUT (flat, at most 8 files).
set -uo pipefail
out=${1:?usage: gpu_session8.sh OUT}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
start=$(date +%s)
left() { echo $((${BUDGET:-540} - ($(date +%s) - start))); }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$out/log.txt"
python -m pytest -q -m gpu tests/test_group_norm.py tests/test_pass_graphs_gpu.py 2>&1 | tail -n 15 | tee -a "$out/log.txt"
common="--lengths 1 --merge-refill off --overlap-decode on --teacher-graphs both"
timeout 200 python benchmarks/streaming.py speed $common --paired 5 --out /tmp/s256 2>&1 | tail -n 30 | tee -a "$out/log.txt"
cp /tmp/s256/speed.json "$out/streaming_256.json" 2>/dev/null
timeout $(( $(left) > 60 ? $(left) - 30 : 10 )) python benchmarks/streaming.py speed $common --size 480 832 \
    --paired 3 --teacher-repeats 1 --out /tmp/s480 2>&1 | tail -n 30 | tee -a "$out/log.txt"
cp /tmp/s480/speed.json "$out/streaming_480.json" 2>/dev/null
t=$(left)
if [ "$t" -gt 90 ]; then
    timeout $((t - 10)) python benchmarks/compile_parity.py --out /tmp/cp --blocks micro \
        --variants default,batch2,no-split-reductions 2>&1 | tail -n 30 | tee -a "$out/log.txt"
    cp /tmp/cp/compile_parity.json "$out/compile_parity_micro.json" 2>/dev/null
fi
echo "elapsed $(( $(date +%s) - start )) s" | tee -a "$out/log.txt"
