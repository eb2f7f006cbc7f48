"""``inference.py --streaming --pp-devices cuda:0,cuda:1``: streaming generation on two GPUs (pipeline_parallel.py).

    python scripts/diffusion/inference.py CONFIG --ckpt CKPT --prompt "..." --streaming --step-list 1.0,0.75,0.5,0.25 \
        --pp-devices cuda:0,cuda:1 --pp-overlap aggressive --pp-split auto [--profile]

The network must be causal (``causal_chunk_frames > 0``); the clip's latent frames are generated chunk by chunk
(``causal_chunk_frames`` per chunk) with the per-chunk ``--step-list`` (or ``--num-steps`` shifted steps), the
cache refilled at context noise 0 (``--stream-refill``, default on), CFG when ``--guidance-scale != 1`` (the null
text as a second branch with its own caches). Each prompt group (``--batch-size`` prompts) is one item in flight.
GPU0: text features, noise, embedders and blocks[0..split]; GPU1: the other blocks, the final layer, the sampler
update and the VAE decode (each chunk decoded on its own). ``--profile`` writes ``pp_profile.json`` (per task:
GPU, start/end ms; per GPU: busy/idle) to the save dir and prints the per-stage summary.
"""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

PIPELINE_FLAGS = {
    "streaming": False,  # chunk-by-chunk generation with a causal model's KV cache
    "pp_devices": None,  # "cuda:0,cuda:1": two-GPU pipeline overlap (streaming only)
    "pp_overlap": "aggressive",  # off | basic | aggressive
    "pp_split": "auto",  # auto | N: index of the last block on the first GPU
    "stream_refill": True,  # re-run each chunk's x0 at context noise 0 to write the cache (else the last step does)
    "stream_rule": "renoise",  # per-chunk step rule: renoise (few-step students) | euler
    "stream_window_frames": None,  # rolling KV window in latent frames (None: keep all)
    "stream_sink_frames": 0,
    "profile": False,
}


def _uint8_on_device(video: torch.Tensor) -> torch.Tensor:
    """``io.to_uint8_frames`` without the host copy (the pipeline copies to pinned memory asynchronously)."""
    import torch

    pixels = ((video.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return pixels.permute(0, 2, 3, 4, 1).contiguous()


def run_pipelined(cfg, args, prompts, seeds, ckpt, num_frames, height, width, save_dir: Path, common: dict) -> list:
    """Generate ``prompts`` with the two-GPU streaming pipeline; returns the written sample paths."""
    import torch

    from opensora.diffusion.sampling import timesteps_for_sampling
    from opensora.inference.io import save_sample, write_samples_csv, write_sidecar
    from opensora.inference.pipeline import VideoSampler
    from opensora.inference.pipeline_parallel import (
        OVERLAP_MODES,
        Lanes,
        Plan,
        choose_split,
        dump_json,
        parse_devices,
        parse_split,
        run_plan,
    )
    from opensora.inference.pipeline_stages import (
        CausalStreamingStages,
        all_blocks,
        measure_stage_times,
        place_model,
        seeded_latent_noise,
    )
    from opensora.inference.prompts import sample_stem

    if not args.streaming:
        raise SystemExit("--pp-devices drives the streaming sampler: add --streaming")
    devices = parse_devices(args.pp_devices)
    mode = str(args.pp_overlap)
    if mode not in OVERLAP_MODES:
        raise SystemExit(f"--pp-overlap must be one of {OVERLAP_MODES}, got {mode!r}")
    sampler = VideoSampler.from_config(cfg, ckpt, role=args.role, ema=bool(args.ema), device=devices[0],
                                       dtype=args.dtype, progress=False)
    model = sampler.model
    chunk = int(getattr(model, "causal_chunk_frames", 0))
    if not chunk:
        raise SystemExit("--streaming needs a causal network (model.causal_chunk_frames > 0)")
    latent = sampler.latent_size(num_frames, height, width)
    if latent[0] % chunk:
        raise SystemExit(f"{latent[0]} latent frames are not whole chunks of {chunk}; pick --num-frames to fit")
    num_chunks = latent[0] // chunk
    if args.step_list is not None:
        steps = [float(t) for t in args.step_list if float(t) > 0]
    else:
        steps = timesteps_for_sampling(int(args.num_steps), sampler.shift_alpha((chunk, *latent[1:])))[:-1].tolist()
    guidance = float(args.guidance_scale)
    batch = max(1, int(args.batch_size))
    groups = []
    for start in range(0, len(prompts), batch):
        text, null = sampler.encode_text(prompts[start:start + batch])
        groups.append(dict(seeds=seeds[start:start + batch], branches=[text] + ([null] if guidance != 1.0 else [])))
    if len({len(g["seeds"]) for g in groups}) != 1:
        raise SystemExit(f"{len(prompts)} prompts do not split into equal groups of --batch-size {batch}")
    vae = sampler.vae.to(devices[0])
    vae_dtype = next(vae.parameters(), torch.empty(0, dtype=sampler.dtype)).dtype

    def decode(x0):
        return _uint8_on_device(vae.decode(x0.to(vae_dtype)))

    chunk_shape = (sampler.vae.latent_channels, chunk, *latent[1:])
    plan = Plan(num_groups=len(groups), num_branches=len(groups[0]["branches"]), num_chunks=num_chunks,
                num_steps=len(steps), refill=bool(args.stream_refill))
    split = parse_split(args.pp_split, len(all_blocks(model)))
    split_report = dict(requested=str(args.pp_split))
    if split is None:
        x = seeded_latent_noise(groups[0]["seeds"], chunk_shape).to(devices[0])
        times = measure_stage_times(model, x, groups[0]["branches"][0], decode=decode)
        split, table = choose_split(plan, mode, times["block_ms"], times["embed_ms"], times["final_ms"],
                                    decode_ms=times["decode_ms"])
        split_report.update(stage_times=times, candidates=table)
        logger.info("pp-split auto: GPU0 = embed + blocks[0..%d], GPU1 = blocks[%d..] + final + decode (stage times "
                    "of a warm-up chunk: embed %.2f ms, blocks %s ms, final %.2f ms, decode %.2f ms; simulated plan "
                    "time %.1f ms, the shortest of %d splits)", split, split + 1, times["embed_ms"],
                    [round(t, 2) for t in times["block_ms"]], times["final_ms"], times["decode_ms"],
                    table[split]["simulated_ms"], len(table))
    split_report["split"] = split
    place_model(model, split, devices)
    vae.to(devices[1])
    lanes = Lanes(devices, profile=bool(args.profile))
    stages = CausalStreamingStages(model, lanes, split, groups, chunk_shape, num_chunks, steps,
                                   refill=bool(args.stream_refill), rule=str(args.stream_rule), guidance_scale=guidance,
                                   decode=decode, window_frames=args.stream_window_frames,
                                   sink_frames=int(args.stream_sink_frames))
    result, sim = run_plan(stages, mode, lanes)
    frames_done = len(prompts) * num_chunks * chunk
    logger.info("two-GPU streaming (%s, split %d): %d prompt(s) x %d chunks in %.2f s (%.1f latent frames/s; "
                "simulated busy GPU0/GPU1 %.2f/%.2f)", mode, split, len(prompts), num_chunks, result.seconds,
                frames_done / result.seconds, *sim.busy_fraction)
    pp_record = dict(pp_devices=devices, pp_overlap=mode, pp_split=split_report, stream_steps=steps,
                     stream_refill=bool(args.stream_refill), stream_rule=str(args.stream_rule), seconds=result.seconds)
    if args.profile:
        dump_json(save_dir / "pp_profile.json", dict(summary=result.summary, timeline=result.timeline, **pp_record))
        for lane, s in result.summary.get("lanes", {}).items():
            logger.info("profile %s: busy %.1f ms, idle %.1f ms, busy fraction %.2f", lane, s["busy_ms"], s["idle_ms"],
                        s["busy_fraction"])
        logger.info("profile ms per stage: %s", {k: round(v, 2) for k, v in result.summary["ms_per_kind"].items()})
    written, rows = [], []
    for g, group in enumerate(groups):
        video = torch.cat([result.frames[(g, c)] for c in range(num_chunks)], dim=1)  # [B, T, H, W, 3]
        for i, frames in enumerate(video.numpy()):
            index = g * batch + i
            stem = save_dir / sample_stem(index, prompts[index])
            path = save_sample(stem, frames, fps=float(args.fps))
            write_sidecar(stem.with_suffix(".json"), dict(index=index, prompt=prompts[index], seed=seeds[index],
                                                          path=path.name, **common, **pp_record))
            written.append(path)
            rows.append(dict(path=path.name, text=prompts[index]))
    write_samples_csv(save_dir, rows)
    return written
