#!/usr/bin/env bash
# GeminiPlugin in the real trainer on GPUs, next to LowLevelZero (ZeRO-2).
#
#   bash benchmarks/gemini_check.sh OUT resume     # ~5-7 min on 2 GPUs: exact-resume check per plugin
#   bash benchmarks/gemini_check.sh OUT 11b        # 2 GPUs: the 11B preset, Gemini+offload (RUN_TIMEOUT=480 or more:
#                                                  # JIT builds and the host-side Adam) and ZeRO-2 (~40 s)
#
# resume: for each of zero2 (mmdit_1b_bench_shape.py: AdamW, EMA), gemini-static and gemini-auto
# (mmdit_1b_gemini.py: HybridAdam, no EMA) train STEPS steps saving at STEPS/2 (run A), then resume from that
# checkpoint into a fresh directory and train to STEPS again (run B). PASS when every loss and grad norm of B equals
# A's bit for bit; also median step time, tokens/s and peak memory (rank 0) of run A.
# 11b: mmdit_11b_synthetic.py (2304 + 512 tokens, batch 1 per GPU, full checkpointing) with Gemini static placement
# and the optimizer states offloaded to the host, then ZeRO-2 (fused AdamW) with everything on the GPUs; tokens/s,
# MFU, peak GPU memory (trainer, rank 0; nvidia-smi per GPU) and the host's peak used memory.
# Environment: NPROC (default 2), STEPS (default 6), VARIANTS (resume part, default "zero2 gemini-static
# gemini-auto"; 11b part, default "gemini-offload zero2"; split them over two calls if one call's 8 minutes do not suffice: HybridAdam JIT-compiles ~80 s on
# first use), RUN_TIMEOUT (s per run, default 420), RESUME_ARGS (resume part: more train.py flags for both runs, e.g.
# "--model.depth_double 2 --model.depth_single 4 --model.grad_ckpt_double 2 --model.grad_ckpt_single 4": a quarter of
# the 1B model, so each save writes ~4 GB instead of ~17), PYTHON. Results: OUT/gemini_check_{part}.json.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=${1:-outputs/gemini_check}; part=${2:-resume}
python=${PYTHON:-python3}
nproc=${NPROC:-2}; steps=${STEPS:-6}; half=$((steps / 2))
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
mkdir -p "$out"

samplers() {  # name: sample GPU memory per GPU and the host's used memory every 0.5 s
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 500 > "$out/$1.gpumem" 2> /dev/null &
  gpu_sampler=$!
  (while true; do awk '/MemTotal/ {t=$2} /MemAvailable/ {a=$2} END {print (t - a) / 1048576}' /proc/meminfo; sleep 0.5; done) > "$out/$1.hostmem" &
  host_sampler=$!
}
stop_samplers() { kill "$gpu_sampler" "$host_sampler" 2> /dev/null; wait "$gpu_sampler" "$host_sampler" 2> /dev/null; }

train() {  # name config args...: one torchrun training run, log in OUT/name.log
  local name=$1 config=$2; shift 2
  echo "== $name ($(date +%T))"
  samplers "$name"
  timeout "${RUN_TIMEOUT:-420}" "$python" -m torch.distributed.run --standalone --nproc_per_node "$nproc" \
    scripts/diffusion/train.py "$config" --outputs "$out/$name" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  stop_samplers
  [ $rc = 0 ] || { echo "   FAILED rc=$rc (see $out/$name.log)"; grep -E "Error|error" "$out/$name.log" | tail -4; }
  return 0
}

if [ "$part" = resume ]; then
  gemini_auto="{'type': 'GeminiPlugin', 'placement_policy': 'auto', 'max_norm': 1.0}"
  for variant in ${VARIANTS:-zero2 gemini-static gemini-auto}; do
    case $variant in
      zero2) config=configs/diffusion/train/mmdit_1b_bench_shape.py; extra=() ;;
      gemini-static) config=configs/diffusion/train/mmdit_1b_gemini.py; extra=() ;;
      gemini-auto) config=configs/diffusion/train/mmdit_1b_gemini.py; extra=(--plugin "$gemini_auto") ;;
    esac
    rm -rf "$out/$variant-A" "$out/$variant-B"
    # shellcheck disable=SC2086  # RESUME_ARGS: several flags
    train "$variant-A" "$config" --max-steps "$steps" --ckpt-every "$half" --save-at-end False "${extra[@]}" ${RESUME_ARGS:-}
    ckpt=$(ls -d "$out/$variant-A"/checkpoints/step-* 2> /dev/null | head -1)
    if [ -n "$ckpt" ]; then
      # shellcheck disable=SC2086
      train "$variant-B" "$config" --max-steps "$steps" --ckpt-every 0 --save-at-end False --load "$ckpt" "${extra[@]}" \
        ${RESUME_ARGS:-}
    else
      echo "   no checkpoint from $variant-A: resume not tried"
    fi
  done
elif [ "$part" = 11b ]; then
  # torchrun sets OMP_NUM_THREADS=1 unless it is set: the host-offloaded Adam (ColossalAI's CPUAdam, OpenMP) would
  # update 11B parameters on one core per rank: a Gemini run then had not finished its first step after 270 s
  # (~115 s of JIT builds, cpu_adam 72 s and fused_optim 43 s, the boost, then that step).
  per_rank=$(( $(nproc) / nproc )); [ "$per_rank" -ge 1 ] || per_rank=1
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$per_rank}
  zero2="{'type': 'LowLevelZeroPlugin', 'stage': 2, 'reduce_bucket_size_in_m': 128, 'overlap_communication': True}"
  for variant in ${VARIANTS:-gemini-offload zero2}; do
    rm -rf "$out/11b-$variant"
    case $variant in
      gemini-offload)
        train 11b-gemini-offload configs/diffusion/train/mmdit_11b_synthetic.py --max-steps "$steps" --ckpt-every 0 \
          --save-at-end False ;;
      zero2)  # with torch's fused AdamW (the 1B configs' optimizer; HybridAdam is Gemini's)
        train 11b-zero2 configs/diffusion/train/mmdit_11b_synthetic.py --max-steps "$steps" --ckpt-every 0 \
          --save-at-end False --plugin "$zero2" --optimizer.type AdamW ;;
      *) echo "unknown 11b variant '$variant' (gemini-offload | zero2)"; exit 2 ;;
    esac
  done
else
  echo "unknown part '$part' (resume | 11b)"; exit 2
fi

"$python" - "$out" "$part" "$half" <<'EOF'
import datetime, json, statistics, sys
from pathlib import Path
out, part, half = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
def records(name):
    path = out / name / "metrics.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []
def peak(path, column):
    vals = []
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split(",")
            try:
                vals.append(float(parts[column]))
            except (ValueError, IndexError):
                pass
    return max(vals) if vals else None
def summary(name):
    recs = [r for r in records(name) if "step_time" in r]
    timed = recs[2:] or recs  # first steps: warm-up (JIT, allocator)
    row = dict(run=name, steps=len(recs))
    if timed:
        row.update(step_time=statistics.median(r["step_time"] for r in timed),
                   tokens_per_s=statistics.median(r["tokens_per_s"] for r in timed),
                   mfu=statistics.median(r.get("mfu", 0) for r in timed),
                   peak_memory_gib_rank0=max(r.get("peak_memory_gib", 0) for r in timed))
    gpu = peak(out / f"{name}.gpumem", 1)
    row.update(nvidia_smi_peak_gib=gpu / 1024 if gpu else None, host_used_peak_gib=peak(out / f"{name}.hostmem", 0))
    log = out / f"{name}.log"
    if not recs and log.exists():
        row["error"] = " | ".join(l.strip() for l in log.read_text().splitlines() if "Error" in l)[-400:]
    return row
rows = []
if part == "resume":
    for variant in [v for v in ("zero2", "gemini-static", "gemini-auto") if (out / f"{v}-A.log").exists()]:
        a, b = {r["step"]: r for r in records(f"{variant}-A") if "loss" in r}, {r["step"]: r for r in records(f"{variant}-B") if "loss" in r}
        later = [s for s in sorted(a) if s > half]
        same = bool(later) and all(s in b for s in later) and all(
            a[s]["loss"] == b[s]["loss"] and a[s].get("grad_norm") == b[s].get("grad_norm") for s in later)
        diffs = {s: (a[s]["loss"], b.get(s, {}).get("loss")) for s in later}
        row = summary(f"{variant}-A")
        row.update(variant=variant, resume_exact=same, resumed_steps=later, losses_a_b=diffs)
        rows.append(row)
        print(f"{variant:14s} resume {'PASS' if same else 'FAIL'}  step {row.get('step_time', float('nan')):.3f} s  "
              f"tokens/s {row.get('tokens_per_s', float('nan')):.0f}  peak {row.get('peak_memory_gib_rank0')} GiB  "
              f"{row.get('error', '')}")
else:
    for name in ("11b-gemini-offload", "11b-zero2"):
        row = summary(name)
        rows.append(row)
        print(f"{name:20s} step {row.get('step_time', float('nan')):.3f} s  tokens/s {row.get('tokens_per_s', float('nan')):.0f}  "
              f"MFU {row.get('mfu', float('nan')):.3f}  GPU peak (trainer / smi) {row.get('peak_memory_gib_rank0')} / "
              f"{row.get('nvidia_smi_peak_gib')} GiB  host peak {row.get('host_used_peak_gib')} GiB  {row.get('error', '')}")
import torch
device = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "cpu"
path = out / f"gemini_check_{part}.json"
path.write_text(json.dumps(dict(date=datetime.date.today().isoformat(), device=device, torch=torch.__version__, part=part, rows=rows), indent=1))
print(f"wrote {path}")
EOF
