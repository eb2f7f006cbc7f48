#!/usr/bin/env bash
# Scaling of the real trainer: tokens/s per GPU, scaling efficiency vs 1 GPU and peak memory, for ZeRO-2 (bf16)
# and DDP, at any GPU counts. Inputs are synthetic (configs/diffusion/train/mmdit_1b_synthetic.py: rendered clips,
# tiny VAE/text encoders with the real shapes), so the data loader is not what is measured.
#
#   benchmarks/train_scaling.sh                      # GPUs "1 2", plugins "zero2 ddp", 30 steps each
#   benchmarks/train_scaling.sh --gpus "1 2 4 8" --steps 50 --skip 10
#   benchmarks/train_scaling.sh --tiny               # CPU smoke test: demo config, 1 and 2 gloo processes
#   benchmarks/train_scaling.sh --profile 15         # also split GPU time of steps 16-18 (compute / exposed / NCCL)
#   benchmarks/train_scaling.sh --config configs/diffusion/train/mmdit_1b_long_synthetic.py --sp 4 --gpus "4 8"
#                                                    # 33.8k-token videos, each sample split over 4 GPUs
#   benchmarks/train_scaling.sh --repeats 3 --plugins zero2 --steps 25 --skip 8 \
#       --config configs/diffusion/train/mmdit_1b_bench_shape.py   # 1/2/1/2/1/2 GPUs interleaved, medians + spread
#   benchmarks/train_scaling.sh --bucket-m 256 --overlap 0 ...     # ZeRO knobs: reduce bucket (M elements), overlap
#   benchmarks/train_scaling.sh --repeats 3 --plugins "zero2 zero2-cai" --shared-base ...
#                                                    # only the first plugin runs the first GPU count; the others'
#                                                    # efficiency is against that run (same repeat): for plugin
#                                                    # variants that differ only on several ranks
#
# --repeats R runs the whole GPU-count list R times, interleaved (1, 2, 1, 2, ...), so a slow machine phase hits
# both counts alike; the report gives per count the median tokens/s per GPU over the repeats with min / max, and the
# scaling efficiency per repeat (n-GPU run / the 1-GPU run of the same repeat) with its median, min and max.
#
# Launcher: torchrun (python -m torch.distributed.run); `--launcher colossalai` uses `colossalai run` (needs
# fabric, absent on the GPU machines). Results: {out}/scaling.json and a table; each run's metrics.jsonl stays in
# {out}/{plugin}_{n}gpu/.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
python=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && python=.venv/bin/python
gpus="1 2"; plugins="zero2 ddp"; steps=30; skip=10; tiny=0; launcher=torchrun; repeats=1; bucket_m=128; overlap=True; shared_base=0
config=configs/diffusion/train/mmdit_1b_synthetic.py; out=outputs/bench_scaling; extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --gpus) gpus=$2; shift 2 ;;
    --plugins) plugins=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --skip) skip=$2; shift 2 ;;
    --config) config=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --launcher) launcher=$2; shift 2 ;;
    --repeats) repeats=$2; shift 2 ;;
    --bucket-m) bucket_m=$2; shift 2 ;;
    --overlap) case "$2" in 1|True|true|on) overlap=True ;; *) overlap=False ;; esac; shift 2 ;;
    --tiny) tiny=1; shift ;;
    --shared-base) shared_base=1; shift ;;
    --profile) extra+=(--profile-steps "{'start': $2, 'steps': 3}"); shift 2 ;;
    --sp) extra+=(--sequence-parallel-size "$2"); shift 2 ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) sed -n 2,28p "$0"; exit 0 ;;
    *) echo "unknown argument $1 (see --help)"; exit 2 ;;
  esac
done
if [ $tiny = 1 ]; then
  config=configs/diffusion/train/demo.py; out=${out%/}_tiny; steps=8; skip=3
  # its own clips: `make demo` rewrites outputs/demo/data with its own (shorter) clip set
  data=outputs/train_scaling_tiny_data
  [ -f $data/meta.csv ] || $python tools/make_demo_dataset.py --out $data --num 72 --seed 0
  extra+=(--num-workers 0 --tensorboard False --dataset.data_path $data/meta.csv)
fi
plugin_cfg() {  # bf16 ZeRO-2 on GPU; the demo config's precision (fp32) on CPU
  # zero2: the 1B configs' settings (128M-element reduce buckets, reduce-scatter overlapped with the backward) with
  # the trainer's defaults, which include the multi-rank step shortcut (multi-tensor casts and one all-gather per
  # bucket instead of ColossalAI's per-tensor work); zero2-cai: the same with ColossalAI's own multi-rank step
  # (multi_rank_shortcut=False); zero2-default: colossalai's defaults (12M buckets); zero2-ag: zero2 + the parameter
  # all-gather after the step overlapped with the next forward (overlap_allgather, which takes ColossalAI's step).
  local zero="'type': 'LowLevelZeroPlugin', 'stage': 2"
  case "$1" in
    zero2) echo "{$zero, 'reduce_bucket_size_in_m': $bucket_m, 'overlap_communication': $overlap}" ;;
    zero2-cai) echo "{$zero, 'reduce_bucket_size_in_m': $bucket_m, 'overlap_communication': $overlap, 'multi_rank_shortcut': False}" ;;
    zero2-default) echo "{$zero}" ;;
    zero2-ag) echo "{$zero, 'reduce_bucket_size_in_m': $bucket_m, 'overlap_communication': $overlap, 'overlap_allgather': True}" ;;
    ddp) echo "{'type': 'TorchDDPPlugin'}" ;;
    *) echo "unknown plugin $1 (zero2|zero2-cai|zero2-default|zero2-ag|ddp)" >&2; exit 2 ;;
  esac
}
mkdir -p "$out"
first_plugin=${plugins%% *}; first_gpus=${gpus%% *}
for r in $(seq "$repeats"); do
 for plugin in $plugins; do
  for n in $gpus; do
    [ $shared_base = 1 ] && [ "$plugin" != "$first_plugin" ] && [ "$n" = "$first_gpus" ] && continue
    name=${plugin}_${n}gpu; [ "$repeats" -gt 1 ] && name=${name}_r$r
    dir=$out/$name
    rm -rf "$dir"
    echo "== $plugin on $n process(es), repeat $r/$repeats -> $dir ($(date +%T))"
    if [ "$launcher" = colossalai ]; then
      launch=(colossalai run --nproc_per_node "$n")
    else
      launch=("$python" -m torch.distributed.run --standalone --nproc_per_node "$n")
    fi
    sampler=""
    if command -v nvidia-smi > /dev/null; then  # the trainer logs no memory: sample used memory per GPU (includes
      nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 500 > "$out/$name.mem" &
      sampler=$!                              # the CUDA context and allocator cache, so it is an upper bound)
    fi
    precision=()  # ColossalAI 0.5.0's TorchDDPPlugin has no bf16 mode: DDP runs fp32 (on GPU)
    [ "$plugin" = ddp ] && [ $tiny = 0 ] && precision=(--precision fp32)
    "${launch[@]}" scripts/diffusion/train.py "$config" --outputs "$dir" --max-steps "$steps" \
      --ckpt-every 0 --save-at-end False --plugin "$(plugin_cfg "$plugin")" "${precision[@]}" "${extra[@]}" > "$out/$name.log" 2>&1 \
      || { echo "   FAILED (see $out/$name.log)"; tail -5 "$out/$name.log"; }
    [ -n "$sampler" ] && kill "$sampler" 2> /dev/null || true
  done
 done
done
$python - "$out" "$skip" "$plugins" "$gpus" "$repeats" "$bucket_m" "$overlap" "$config" "$shared_base" <<'EOF'
import datetime, json, statistics, sys
from pathlib import Path
out, skip, plugins, gpus = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(), [int(g) for g in sys.argv[4].split()]
repeats, knobs = int(sys.argv[5]), dict(reduce_bucket_size_in_m=int(sys.argv[6]), overlap_communication=sys.argv[7] == "True")
shared_base = sys.argv[9] == "1"  # the first plugin's first-GPU-count runs are every plugin's baseline
def run_name(plugin, n, r):
    return f"{plugin}_{n}gpu" + (f"_r{r}" if repeats > 1 else "")
def owner(plugin, n):  # whose run stands for `plugin` at `n` GPUs (--shared-base: the first plugin's, at gpus[0])
    return plugins[0] if shared_base and n == gpus[0] else plugin
def per_gpu_rate(plugin, n, r):
    path = out / run_name(owner(plugin, n), n, r) / "metrics.jsonl"
    recs = [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []
    recs = [x for x in recs if "tokens_per_s" in x and x.get("step", 0) > skip]
    return statistics.median(x["tokens_per_s"] for x in recs) / n if recs else None
rows = []
for plugin in plugins:
    base = None
    for n in gpus:
        path = out / run_name(owner(plugin, n), n, repeats) / "metrics.jsonl"
        recs = [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []
        recs = [r for r in recs if "tokens_per_s" in r and r.get("step", 0) > skip]
        if not recs:
            rows.append(dict(plugin=plugin, gpus=n, error=f"no metrics after step {skip} in {path}"))
            continue
        # tokens_per_s is over all ranks; per repeat the median of the steps after `skip`, then the median of repeats
        rates = [per_gpu_rate(plugin, n, r) for r in range(1, repeats + 1)]
        good = [x for x in rates if x is not None]
        per_gpu = statistics.median(good)
        base_rates = [per_gpu_rate(plugin, gpus[0], r) for r in range(1, repeats + 1)]
        effs = [a / b for a, b in zip(rates, base_rates) if a is not None and b]
        mem_file = out / f"{run_name(owner(plugin, n), n, repeats)}.mem"
        # the trainer's allocator high-water mark (rank 0) when logged, else nvidia-smi's used memory (upper bound)
        mem = [r["peak_memory_gib"] for r in recs if "peak_memory_gib" in r] or (
            [float(l.split(",")[1]) / 1024 for l in mem_file.read_text().splitlines() if "," in l]
            if mem_file.exists() else [])
        base = base or (per_gpu if n == gpus[0] else None)
        profiles = [json.loads(p.read_text()) for p in sorted((out / run_name(owner(plugin, n), n, repeats) / "profile").glob("rank*.json"))]
        profile = {k: [round(p[f"{k}_ms_per_step"], 1) for p in profiles] for k in ("wall", "compute", "exposed", "communication")}
        rows.append(dict(plugin=plugin, gpus=n, tokens_per_s_per_gpu=per_gpu,
                         step_time=statistics.median(r["step_time"] for r in recs),
                         scaling_efficiency=per_gpu / base if base else None,
                         peak_mem_gib=max(mem) if mem else None, mfu=recs[-1].get("mfu"), steps=len(recs),
                         profile_ms_per_rank=profile if profiles else None,
                         repeats=len(good), tokens_per_s_per_gpu_runs=rates,
                         tokens_per_s_per_gpu_min=min(good), tokens_per_s_per_gpu_max=max(good),
                         rate_spread=max(good) / min(good),
                         efficiency_per_repeat=effs, efficiency_median=statistics.median(effs) if effs else None,
                         efficiency_min=min(effs) if effs else None, efficiency_max=max(effs) if effs else None))
import torch
device = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "cpu"
report = dict(date=datetime.date.today().isoformat(), device=device, torch=torch.__version__, config=sys.argv[8],
              zero_knobs=knobs, repeats=repeats, skip=skip, shared_base=shared_base, rows=rows)
(out / "scaling.json").write_text(json.dumps(report, indent=1))
print(f"{'plugin':7s} {'gpus':>4s} {'tokens/s/gpu':>13s} {'step s':>7s} {'eff':>6s} {'used GiB':>9s} {'mfu':>6s}")
for r in rows:
    if "error" in r:
        print(f"{r['plugin']:7s} {r['gpus']:4d} {r['error']}"); continue
    f = lambda v, fmt: format(v, fmt) if v is not None else "-"
    print(f"{r['plugin']:7s} {r['gpus']:4d} {r['tokens_per_s_per_gpu']:13.1f} {r['step_time']:7.3f} "
          f"{f(r['scaling_efficiency'], '6.2f')} {f(r['peak_mem_gib'], '9.1f')} {f(r['mfu'], '6.3f')}")
    if r.get("repeats", 1) > 1:
        f = lambda v: format(v, ".3f") if v is not None else "-"
        print(f"        {r['repeats']} repeats: tokens/s/gpu min {r['tokens_per_s_per_gpu_min']:.1f} max "
              f"{r['tokens_per_s_per_gpu_max']:.1f} (spread {r['rate_spread']:.3f}); efficiency median "
              f"{f(r['efficiency_median'])} min {f(r['efficiency_min'])} max {f(r['efficiency_max'])}")
    if r.get("profile_ms_per_rank"):
        print("        ms/step per rank: " + ", ".join(f"{k} {v}" for k, v in r["profile_ms_per_rank"].items()))
print(f"wrote {out / 'scaling.json'}")
EOF
