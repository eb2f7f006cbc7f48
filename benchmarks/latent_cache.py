"""Training from precomputed latents vs encoding on the fly, precompute throughput, and cache storage per clip.

One GPU, the 1B MMDiT at 256px x 33 frames, batch 4 (configs/diffusion/train/mmdit_1b_synthetic.py's model, plugin
and optimizer), with the real-size frozen components built with random weights directly on the GPU in bf16 (nothing
downloaded): the HunyuanVideo VAE (diffusers ``AutoencoderKLHunyuanVideo()``'s default config, 246M), a T5-XXL-size
encoder (transformers ``T5Config``: d_model 4096, 24 layers, 64 heads, d_ff 10240, gated-GELU; 4.76B; 512 tokens)
and a CLIP-L-size text encoder (768 wide, 12 layers; 77 tokens). Clips are real mp4 files (MovingShapes, 256x256,
33 frames) decoded with PyAV by the training dataset; captions are unique ~300-byte sentences (the byte-level
tokenizer: ~300 valid tokens of 512).

Modes, each in its own subprocess (GPU memory of one does not leak into the next):

* ``precompute``: ``opensora.latent_cache.precompute.run`` over the table (decode in workers, encode, write shards
  from a thread). Its clips/s is the steady state: the clips of chunks 2..n over the time from the first chunk's
  progress record to the last (start-up and the first calls' autotuning left out; the whole loop's rate is reported
  too). Then the encoders alone on the same clips, already decoded and on the GPU (VAE one clip per call as
  precompute does, T5 + CLIP per chunk of captions): the ratio is the goal "within 10% of the encoders' own speed".
  Also the storage per clip read from the shards.
* ``on_the_fly``: the real ``Trainer`` on the videos (VAE and text encoders run every step).
* ``from_cache``: the real ``Trainer`` on ``CachedLatentDataset`` (no encoder built).

Trainer numbers: median samples/s and step time over the timed steps (the trainer's own records), and the host
time spent waiting for each batch. Storage at 480x832 x 129 is computed from the VAE's latent shape (no encode).

  python -m benchmarks.latent_cache --out $OUT/latent_cache_h100.json   # ~5 min on one H100
  python -m benchmarks.latent_cache --tiny          # CPU smoke test of the script (tiny components, fp32)
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import OUT, ROOT

T5_XXL = dict(
    vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64, feed_forward_proj="gated-gelu"
)
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12)
TINY_VAE = dict(block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4, latent_channels=16)
LATENT_CHANNELS = 16
BYTES = dict(bf16=2, fp32=4)


def caption(index: int) -> str:
    words = "red green blue circle square triangle moving slowly quickly left right up down across the frame".split()
    body = " ".join(words[(index * 7 + k * 3) % len(words)] for k in range(48))
    return f"clip {index}: {body}"[:300]


def write_data(root: Path, tiny: bool) -> Path:
    """A table of 128 rows (tiny: 16) over 8 rendered mp4 clips, one unique caption per row."""
    import pandas as pd

    from opensora.datasets.moving_shapes import write_dataset

    size, frames = (32, 9) if tiny else (256, 33)
    csv = write_dataset(root / "data", num=8, seed=0, height=size, width=size, num_frames=frames, progress=False)
    table = pd.read_csv(csv)
    rows = pd.concat([table] * (2 if tiny else 16), ignore_index=True)
    rows["text"] = [caption(i) for i in range(len(rows))]
    out = root / "data" / "bench.csv"
    rows.to_csv(out, index=False)
    return out


def bench_config(csv: Path, outputs: Path, tiny: bool, cache: Path = None):
    from opensora.config import load_config
    from opensora.models.mmdit.configs import mmdit_config

    cfg = load_config(str(ROOT / "configs" / "diffusion" / "train" / "mmdit_1b_synthetic.py"))
    cfg.outputs, cfg.tensorboard, cfg.wandb, cfg.save_at_end, cfg.ckpt_every = str(outputs), False, None, False, 0
    cfg.dataset = dict(type="VideoTextDataset", data_path=str(csv), frame_interval=1)
    if tiny:
        cfg.precision, cfg.num_workers = "fp32", 0
        cfg.bucket_config = {"32x32": {9: (1.0, 2)}}
        cfg.vae = dict(type="HunyuanVideoVAE", config=TINY_VAE, seed=0, dtype="fp32")
        cfg.text_encoder = dict(type="TextConditioner", t5=dict(max_length=64), clip=dict(), seed=0)
        cfg.model = mmdit_config("tiny", in_channels=LATENT_CHANNELS, cond_channels=None)
        cfg.plugin = dict(type="LowLevelZeroPlugin", stage=2)
    else:
        cfg.bucket_config = {"256px": {33: (1.0, 4)}}
        cfg.vae = dict(type="HunyuanVideoVAE", config={}, seed=0, dtype="bf16")  # diffusers' default config
        cfg.text_encoder = dict(
            type="TextConditioner",
            t5=dict(config=T5_XXL, max_length=512),
            clip=dict(config=CLIP_L, max_length=77),
            seed=0,
            dtype="bf16",
        )
    if cache is not None:
        cfg.dataset = dict(type="CachedLatentDataset", data_path=str(cache))
    return cfg


def build_on_device():
    """Build every frozen component directly on the GPU (4.76B random parameters must not be made on the host)."""
    import torch

    from opensora.training import components

    if not torch.cuda.is_available():
        return
    plain = components.build_module

    def on_gpu(spec, registry):
        with torch.device("cuda", torch.cuda.current_device()):
            return plain(spec, registry)

    components.build_module = on_gpu


# ---------------------------------------------------------------------------------------------------- modes


def run_precompute(args) -> dict:
    import torch

    from opensora.latent_cache import precompute
    from opensora.latent_cache.store import read_index

    build_on_device()
    cfg = bench_config(Path(args.csv), Path(args.work) / "unused", args.tiny)
    flags = argparse.Namespace(
        outputs=args.cache, epochs=1, flip=False, samples_per_shard=args.samples_per_shard, encode_batch_size=1
    )
    encode_loop = precompute._encode_chunks
    timing = {}

    def timed_encode_loop(*a, **k):
        start = time.perf_counter()
        encode_loop(*a, **k)
        timing["encode_s"] = time.perf_counter() - start

    precompute._encode_chunks = timed_encode_loop
    started = time.perf_counter()
    precompute.run(cfg, flags)
    total_s = time.perf_counter() - started
    rows, made = read_index(Path(args.cache))
    ok = rows[rows.status == "ok"]
    clips = len(ok)
    # steady state: clips of chunks 2..n over the time between the first and the last progress record (the records
    # are written by the writer thread after each shard), so start-up and the first calls' autotuning are left out
    records = sorted((Path(args.cache) / "progress").glob("chunk-*.json"), key=lambda p: p.stat().st_mtime_ns)
    span_s = (records[-1].stat().st_mtime_ns - records[0].stat().st_mtime_ns) / 1e9
    first_chunk = str(records[0].stem).split("-")[1]
    steady_clips = int((ok.shard != f"shards/chunk-{first_chunk}.safetensors").sum())
    steady = steady_clips / span_s if span_s > 0 else float("nan")
    shard_bytes = sum(p.stat().st_size for p in (Path(args.cache) / "shards").glob("*.safetensors"))
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    own = encoders_alone(cfg, ok, args)
    result = dict(
        clips=clips,
        precompute_total_s=total_s,
        precompute_encode_s=timing["encode_s"],
        precompute_loop_clips_per_s=clips / timing["encode_s"],
        precompute_clips_per_s=steady,
        encoders_alone_clips_per_s=own["clips_per_s"],
        encoders_alone=own,
        precompute_vs_encoders=steady / own["clips_per_s"],
        bytes_per_clip_measured=shard_bytes / clips,
        latent_bytes_per_clip=float(ok.latents_nbytes.mean()),
        text_bytes_per_clip=float(ok.text_nbytes.mean()),
        pooled_bytes_per_clip=float(ok.pooled_nbytes.mean()),
        text_tokens_mean=float(ok.text_tokens.mean()),
        latent_shape=[int(n) for n in ok.latent_shape.iloc[0]],
        text_dim=int(made["text"]["dim"]),
    )
    return result


def encoders_alone(cfg, rows, args) -> dict:
    """The encoders on decoded clips already on the device: VAE one clip per call, text per chunk of captions."""
    import torch

    from opensora.datasets.dataset import VideoTextDataset, format_sample_key
    from opensora.dtypes import resolve_dtype
    from opensora.training.components import build_text_encoder, build_vae

    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = resolve_dtype(cfg.precision)
    vae, text = build_vae(cfg.vae, device, dtype), build_text_encoder(cfg.text_encoder, device)
    text.cache_size = 0
    dataset = VideoTextDataset(args.csv)
    keys = [format_sample_key(r.sample, r.num_frames, r.height, r.width, 0) for r in rows.itertuples()]
    videos = [dataset.load_sample(key)["video"][None].to(device, dtype) for key in keys]
    captions = [dataset.texts[r.sample] for r in rows.itertuples()]

    def sync():
        torch.cuda.synchronize() if device.type == "cuda" else None

    with torch.no_grad():
        vae.encode(videos[0]), text.encode(captions[:2])  # warm-up
        sync()
        start = time.perf_counter()
        for video in videos:
            vae.encode(video)
        sync()
        vae_s = time.perf_counter() - start
        start = time.perf_counter()
        for first in range(0, len(captions), args.samples_per_shard):
            text.encode(captions[first : first + args.samples_per_shard])
        sync()
        text_s = time.perf_counter() - start
    return dict(
        clips=len(videos),
        vae_ms_per_clip=vae_s / len(videos) * 1e3,
        text_ms_per_clip=text_s / len(videos) * 1e3,
        clips_per_s=len(videos) / (vae_s + text_s),
    )


def run_trainer(args) -> dict:
    import torch

    from opensora.training.trainer import Trainer

    build_on_device()
    outputs = Path(tempfile.mkdtemp(prefix="latent_cache_trainer_", dir=args.work))
    cache = Path(args.cache) if args.mode == "from_cache" else None
    cfg = bench_config(Path(args.csv), outputs, args.tiny, cache)
    cfg.max_steps = args.warmup + args.iters
    trainer = Trainer(cfg)
    waits, inner = [], trainer._batches

    def batches():
        source = inner()
        while True:
            start = time.perf_counter()
            batch = next(source)
            waits.append(time.perf_counter() - start)
            yield batch

    trainer._batches = batches
    trainer.train()
    records = [json.loads(line) for line in (outputs / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timed = [r for r in records if "step_time" in r][args.warmup :]
    waits = waits[args.warmup : args.warmup + len(timed)]
    built = {name: getattr(getattr(trainer.components, name), "is_built", True) for name in ("vae", "text_encoder")}
    return dict(
        samples_per_s=statistics.median(r["samples_per_s"] for r in timed),
        step_ms=statistics.median(r["step_time"] for r in timed) * 1e3,
        data_wait_median_ms=statistics.median(waits) * 1e3,
        data_wait_max_ms=max(waits) * 1e3,
        steps=len(timed),
        encoders_built=built,
        peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
    )


def storage_table(measured: dict, tiny: bool) -> dict:
    """Bytes per clip from the latent shapes: the 16-channel HunyuanVideo latent (8x space, 4x causal time) in
    bf16, plus T5 features (4096 x 2 bytes per valid token) and the 768-wide pooled vector."""
    token_bytes = 4096 * BYTES["bf16"]
    table = {}
    for name, (frames, height, width) in {"256px_x33": (33, 256, 256), "480x832_x129": (129, 480, 832)}.items():
        latent = LATENT_CHANNELS * ((frames - 1) // 4 + 1) * (height // 8) * (width // 8) * BYTES["bf16"]
        table[name] = dict(
            latent_shape=[LATENT_CHANNELS, (frames - 1) // 4 + 1, height // 8, width // 8],
            latent_mib=latent / 2**20,
            text_mib_at_128_tokens=128 * token_bytes / 2**20,
            text_mib_at_512_tokens=512 * token_bytes / 2**20,
            total_mib_at_128_tokens=(latent + 128 * token_bytes + 768 * 2) / 2**20,
        )
    if not tiny:  # the measured cache must agree with the formula at 256px x 33
        assert measured["latent_shape"] == table["256px_x33"]["latent_shape"], measured["latent_shape"]
        assert abs(measured["latent_bytes_per_clip"] - table["256px_x33"]["latent_mib"] * 2**20) < 1
    return table


# ---------------------------------------------------------------------------------------------------- driver


EXIT_GRACE_S = 40


def run_mode(mode: str, args, work: Path, csv: Path, cache: Path) -> dict:
    started = time.perf_counter()
    if args.tiny:  # CPU: no device memory to keep apart, so no subprocess start-up to pay
        child = argparse.Namespace(**vars(args))
        child.mode, child.work, child.csv, child.cache = mode, str(work), str(csv), str(cache)
        result = (run_precompute if mode == "precompute" else run_trainer)(child)
        result["wall_s"] = time.perf_counter() - started
        return result
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out = work / f"{mode}.json"
    command = [
        sys.executable,
        "-m",
        "benchmarks.latent_cache",
        "--mode",
        mode,
        "--work",
        str(work),
        "--csv",
        str(csv),
        "--cache",
        str(cache),
    ]
    command += [
        "--warmup",
        str(args.warmup),
        "--iters",
        str(args.iters),
        "--samples-per-shard",
        str(args.samples_per_shard),
    ]
    command += ["--result", str(out)]
    child = subprocess.Popen(command, env=env, cwd=ROOT)
    while child.poll() is None and not out.exists():
        time.sleep(1)
    try:  # the result is written: the child only has to exit (a run once hung there for minutes)
        child.wait(timeout=EXIT_GRACE_S)
    except subprocess.TimeoutExpired:
        print(f"{mode}: the child wrote its result but did not exit in {EXIT_GRACE_S} s: killed", flush=True)
        child.kill()
        child.wait()
    if not out.exists():
        raise SystemExit(f"{mode}: the child exited with code {child.returncode} and no result")
    result = json.loads(out.read_text())
    result["wall_s"] = time.perf_counter() - started
    print(f"{mode}: {json.dumps(result)}", flush=True)
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny components, fp32")
    parser.add_argument("--out", default=None, help="result JSON (default: outputs/benchmarks/latent_cache_<dev>.json)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--samples-per-shard", type=int, default=16)
    parser.add_argument("--mode", choices=("precompute", "on_the_fly", "from_cache"), help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--csv", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mode:  # a child: one mode, one JSON
        import faulthandler

        run = run_precompute if args.mode == "precompute" else run_trainer
        Path(args.result).write_text(json.dumps(run(args), default=float))
        faulthandler.dump_traceback_later(EXIT_GRACE_S / 2, exit=False)  # says where an exit that hangs is stuck
        return

    import importlib.util

    import torch

    missing = [m for m in ("pyarrow", "av", "diffusers", "colossalai", "mmengine") if not importlib.util.find_spec(m)]
    if missing:
        raise SystemExit(f"latent_cache.py needs {', '.join(missing)} (carry their wheels to the GPU machine)")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    work = Path(tempfile.mkdtemp(prefix="latent_cache_bench_"))
    csv = write_data(work, args.tiny)
    cache = work / "cache"
    results = dict(device=device, date=time.strftime("%Y-%m-%d"), tiny=args.tiny, warmup=args.warmup, iters=args.iters)
    try:
        results["precompute"] = run_mode("precompute", args, work, csv, cache)
        results["from_cache"] = run_mode("from_cache", args, work, csv, cache)
        results["on_the_fly"] = run_mode("on_the_fly", args, work, csv, cache)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the synthetic clips and their cache: measured, then not kept
    results["speedup_from_cache"] = results["from_cache"]["samples_per_s"] / results["on_the_fly"]["samples_per_s"]
    results["storage"] = storage_table(results["precompute"], args.tiny)
    tag = "cpu" if device == "cpu" else device.split()[-1].lower().replace("-", "")
    out = Path(args.out or OUT / f"latent_cache_{tag}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    p = results["precompute"]
    print(
        f"{device}: from cache {results['from_cache']['samples_per_s']:.2f} samples/s vs on the fly "
        f"{results['on_the_fly']['samples_per_s']:.2f} ({results['speedup_from_cache']:.2f}x; data wait median "
        f"{results['from_cache']['data_wait_median_ms']:.1f} ms); precompute {p['precompute_clips_per_s']:.2f} "
        f"clips/s = {p['precompute_vs_encoders']:.2f} of the encoders alone ({p['encoders_alone_clips_per_s']:.2f}); "
        f"{p['bytes_per_clip_measured'] / 2**20:.2f} MiB per clip measured -> {out}"
    )


if __name__ == "__main__":
    main()
