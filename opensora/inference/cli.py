"""``scripts/diffusion/inference.py``'s logic, importable: parse config + flags, build a ``VideoSampler``, write samples.

    python scripts/diffusion/inference.py configs/diffusion/inference/demo.py --ckpt outputs/demo/train \
        --prompt-file outputs/demo/data/meta.csv --save-dir outputs/demo/samples --num-steps 30 --seed 0

Every flag is a config key (``--num-steps`` sets ``num_steps``); any other ``--dotted.key`` overrides the config.
Outputs: ``{save_dir}/{index:04d}_{slug}.mp4`` (``.png`` for one frame) with a ``.json`` sidecar each,
``{save_dir}/samples.csv`` (``path,text``: the input of ``tools/eval_moving_shapes.py``) and the resolved
``{save_dir}/config.py``.
"""

import logging
import os
import sys
from pathlib import Path

from opensora.checkpoint_layout import checkpoint_root, find_latest_checkpoint
from opensora.cli_errors import UserInputError, check_range, run_cli
from opensora.config import load_config_from_cli, save_config
from opensora.inference.pipeline_parallel.cli import PIPELINE_FLAGS, parse_stream_graphs, streaming_options

logger = logging.getLogger(__name__)

INFERENCE_FLAGS = {
    "ckpt": None,  # checkpoint directory (step-XXXXXXX), a training outputs dir (newest checkpoint) or a .safetensors
    "role": "model",  # which network of the checkpoint ("student" for a distilled one)
    "ema": True,  # --no-ema: the raw (non-EMA) weights
    "prompt": None,  # one prompt, or several separated by '|'
    "prompt_file": None,  # .txt (one per line) or .csv with a 'text' column
    "save_dir": "samples",
    "num_steps": 30,
    "step_list": None,  # explicit t values (e.g. "1.0,0.75,0.5,0.25"); replaces num_steps
    "seed": 0,  # sample i uses seed + i
    "num_frames": 16,
    "resolution": "256px",  # bucket-style name: "256px", "720p" or an exact "HxW"
    "aspect_ratio": "1:1",  # height:width, for area resolutions
    "fps": 8,
    "batch_size": 1,
    "guidance_scale": 7.5,  # text CFG scale w_txt
    "image_guidance_scale": 3.0,  # image CFG scale w_img (reference conditions only; 1 = 2 passes)
    "cond_type": "t2v",  # t2v | i2v_head | i2v_tail | i2v_loop | v2v_head | v2v_tail
    "ref": None,  # reference image (i2v_*) or video (v2v_*)
    "dtype": "auto",  # auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16 | fp16
    "device": "auto",
    "offload": False,  # keep text encoder and autoencoder on the CPU except while they run
    "progress": True,
    # the bidirectional sampler: replay each step's model pass as a CUDA graph (pass_graphs.py); auto = on a GPU
    # (1B, 256px, 30 steps x CFG on an H100: 0.95 s graphed vs 1.11-1.46 s eager; equal at 480p, where it is GPU-bound)
    "cuda_graphs": "auto",  # auto | on | off
    "jano": False,  # Jano region-aware caching (opensora/inference/cache/jano.py); settings under jano_settings
    "jano_offload": False,  # with --jano: keep its caches in pinned CPU memory, prefetched on a side stream
    "jano_graphs": False,  # with --jano: replay each step level as CUDA graphs (GPU only; region_graphs.py)
    # JanoConfig's fields; override one with e.g. --jano-settings.warmup_steps 4
    "jano_settings": dict(
        warmup_steps=6,
        cooldown_steps=2,
        refresh_interval=5,
        medium_interval=2,
        static_threshold=0.2,
        medium_threshold=0.6,
        analysis_steps=3,
        dilation=1,
        batch_quantile=1.0,
        share_branches=True,
    ),
    # streaming (causal models): chunk by chunk with a KV cache, each chunk appended to the mp4 as it finishes
    "streaming": False,
    "window_frames": None,  # latent frames the KV cache keeps (sinks included); None: all (memory grows)
    "sink_frames": 0,  # first latent frames kept for good when the window rolls
    "rollout": "renoise",  # renoise (x0 + fresh noise at the next time, Self-Forcing) | euler
    "context_time": 0.0,  # time at which a finished chunk re-runs to fill the cache
    # under torchrun: split each video's tokens over groups of this many ranks (must divide the world size); the
    # groups share the prompts (data parallel), each group's rank 0 writes
    "sequence_parallel_size": 1,
}
INFERENCE_FLAGS.update(
    PIPELINE_FLAGS
)  # --streaming --pp-devices ... (two-GPU pipeline overlap, pipeline_parallel/cli.py)


def resolve_checkpoint(path) -> Path:
    """A checkpoint directory or file as given, or the newest complete checkpoint of a training outputs dir."""
    if path is None:
        raise SystemExit("--ckpt PATH is required (a checkpoint directory or a .safetensors file)")
    path = Path(path)
    if path.is_dir() and checkpoint_root(path).is_dir():
        latest = find_latest_checkpoint(path)
        if latest is None:
            raise SystemExit(f"{path} holds no complete checkpoint under checkpoints/")
        return Path(latest)
    if not path.exists():
        raise SystemExit(f"checkpoint {path} does not exist")
    return path


def parse_step_list(value):
    """``--step-list`` as floats: a list/tuple (``1.0,0.5`` parses to one), a single number, or None."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, str):
        value = value.replace(",", " ").split()
    return [float(t) for t in value]


def _steps_record(args) -> dict:
    if args.step_list is not None:
        return dict(
            num_steps=len(args.step_list) - 1 if float(args.step_list[-1]) == 0.0 else len(args.step_list),
            step_list=[float(t) for t in args.step_list],
        )
    return dict(num_steps=int(args.num_steps), step_list=None)


def check_inference_flags(args) -> None:
    """Range and choice checks of the flags, before any model is built."""
    from opensora.diffusion.conditions import CONDITION_TYPES

    check_range("num_steps", args.num_steps, 1, integer=True)
    check_range("seed", args.seed, 0, 2**32 - 1, integer=True)
    check_range("batch_size", args.batch_size, 1, integer=True)
    check_range("num_frames", args.num_frames, 1, integer=True)
    check_range("fps", args.fps, 0.001)
    check_range("guidance_scale", args.guidance_scale, 0)
    check_range("image_guidance_scale", args.image_guidance_scale, 0)
    if args.cond_type not in CONDITION_TYPES:
        raise UserInputError(f"--cond-type {args.cond_type!r} is not one of {', '.join(CONDITION_TYPES)}")
    if args.ref is not None and not Path(str(args.ref)).is_file():
        raise UserInputError(f"--ref {args.ref}: no such file")
    save_dir = Path(str(args.save_dir))
    if save_dir.exists() and not save_dir.is_dir():
        raise UserInputError(f"--save-dir {save_dir} is a file; give a directory (it is created if missing)")
    check_range("sequence_parallel_size", args.sequence_parallel_size, 1, integer=True)
    if int(args.sequence_parallel_size) > 1:
        others = [
            flag
            for flag, on in (
                ("--jano", args.jano or args.jano_offload or args.jano_graphs),
                ("--streaming", args.streaming),
                ("--pp-devices", args.pp_devices),
            )
            if on
        ]
        if others:
            raise UserInputError(f"--sequence-parallel-size > 1 does not combine with {' / '.join(others)}: pick one")
    parse_stream_graphs(args.stream_graphs)
    parse_stream_graphs(args.cuda_graphs, "--cuda-graphs")
    if args.streaming and args.jano:
        raise UserInputError(
            "--jano caches a bidirectional sampler's steps; --streaming has its own KV cache: pick one"
        )


def main(argv=None, on_chunk=None) -> list:
    """Run the sampling CLI; returns the written sample paths. ``on_chunk(chunk, paths)`` (streaming only) is
    called after each chunk's frames are in the files."""
    cfg, args = load_config_from_cli(
        argv,
        script_flags=INFERENCE_FLAGS,
        prog="inference.py",
        description="Sample videos from a trained (or distilled) model.",
    )
    check_inference_flags(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from opensora.inference.prompts import resolve_prompts
    from opensora.inference.sampler import video_size_for

    try:
        prompts = resolve_prompts(None if args.prompt is None else str(args.prompt), args.prompt_file)
    except (ValueError, FileNotFoundError) as error:
        raise SystemExit(str(error)) from None
    ckpt = resolve_checkpoint(args.ckpt)
    try:
        step_list = parse_step_list(args.step_list)
        height, width = video_size_for(str(args.resolution), args.aspect_ratio)
    except ValueError as error:
        raise UserInputError(f"--step-list / --resolution / --aspect-ratio: {error}") from None
    args.step_list = step_list
    num_frames = int(args.num_frames)
    batch_size = max(1, int(args.batch_size))
    save_dir = Path(args.save_dir)
    sp, device = start_sequence_parallel(int(args.sequence_parallel_size), args.device)
    if sp is not None:
        try:
            return _sample(
                cfg,
                args,
                prompts,
                ckpt,
                step_list,
                num_frames,
                height,
                width,
                batch_size,
                save_dir,
                on_chunk,
                sp,
                device,
            )
        finally:
            import torch.distributed as dist

            dist.destroy_process_group()
    return _sample(cfg, args, prompts, ckpt, step_list, num_frames, height, width, batch_size, save_dir, on_chunk)


def start_sequence_parallel(size: int, device):
    """``(SequenceGroup, device)`` of this rank for ``--sequence-parallel-size`` > 1 under torchrun, else
    ``(None, device)``. Starts torch.distributed itself (no ColossalAI, no training stack)."""
    if size == 1:
        return None, device
    from opensora.inference.sampler import resolve_device
    from opensora.parallel.process_group import init_process_group_from_env
    from opensora.parallel.sequence_parallel import build_sequence_groups

    # checked before any process group starts (a plain process may carry a launcher's leftover variables)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % size:
        raise UserInputError(
            f"--sequence-parallel-size {size} must divide the number of ranks ({world}); "
            f"launch with torchrun --nproc_per_node N, N a multiple of {size}"
        )
    try:
        _, world, device = init_process_group_from_env(resolve_device(device))
    except RuntimeError as error:
        raise UserInputError(f"--sequence-parallel-size {size}: {error}") from None
    return build_sequence_groups(size), device


def _sample(
    cfg, args, prompts, ckpt, step_list, num_frames, height, width, batch_size, save_dir, on_chunk, sp=None, device=None
):
    import torch.distributed as dist

    from opensora.inference.io import save_sample, write_samples_csv, write_sidecar
    from opensora.inference.prompts import per_sample_seeds, sample_stem
    from opensora.inference.sampler import VideoSampler

    writes = sp is None or sp.rank == 0  # this group's rank 0 writes its samples
    if writes:
        save_dir.mkdir(parents=True, exist_ok=True)
    if sp is None or dist.get_rank() == 0:
        save_config(cfg, save_dir)
    if args.pp_devices:
        from opensora.inference.pipeline_parallel.cli import run_pipelined

        common = dict(
            config=str(args.config),
            checkpoint=str(ckpt),
            role=args.role,
            **_steps_record(args),
            guidance_scale=float(args.guidance_scale),
            num_frames=num_frames,
            height=height,
            width=width,
            fps=float(args.fps),
        )
        return run_pipelined(
            cfg,
            args,
            prompts,
            per_sample_seeds(args.seed, len(prompts)),
            ckpt,
            num_frames,
            height,
            width,
            save_dir,
            common,
        )

    sampler = VideoSampler.from_config(
        cfg,
        ckpt,
        role=args.role,
        ema=bool(args.ema),
        device=args.device if device is None else device,
        dtype=args.dtype,
        offload=bool(args.offload),
        progress=bool(args.progress) and writes,
    )
    sampler.set_sequence_parallel(sp)
    sampler.set_cuda_graphs(parse_stream_graphs(args.cuda_graphs, "--cuda-graphs") != "off")
    if args.jano or args.jano_offload or args.jano_graphs:
        from opensora.inference.cache.jano import JanoCache, JanoConfig

        store = "offload" if args.jano_offload else "device"
        settings = dict(args.jano_settings or {}, store=store, graphs=bool(args.jano_graphs))
        sampler.accelerator = JanoCache(JanoConfig(**settings))
    weights = sampler.weights
    latent_size = sampler.latent_size(num_frames, height, width)
    logger.info(
        "sampling %d prompt(s) at %dx%dx%d (latent %s) from %s [%s] on %s/%s",
        len(prompts),
        num_frames,
        height,
        width,
        latent_size,
        weights.path,
        weights.source,
        sampler.device,
        sampler.dtype,
    )
    seeds = per_sample_seeds(args.seed, len(prompts))
    common = dict(
        config=str(args.config),
        checkpoint=str(ckpt),
        weights=str(weights.path),
        weights_source=weights.source,
        checkpoint_step=weights.step,
        role=args.role,
        **_steps_record(args),
        shift_alpha=None if step_list is not None else sampler.shift_alpha(latent_size),  # a step_list is unshifted
        guidance_scale=float(args.guidance_scale),
        image_guidance_scale=float(args.image_guidance_scale),
        cond_type=args.cond_type,
        ref=None if args.ref is None else str(args.ref),
        num_frames=num_frames,
        height=height,
        width=width,
        fps=float(args.fps),
        **({} if sp is None else dict(sequence_parallel_size=sp.size)),
        dtype=str(sampler.dtype).replace("torch.", ""),
        device=str(sampler.device),
        **({} if sampler.accelerator is None else dict(jano=dict(vars(sampler.accelerator.config)))),
    )
    if args.streaming:
        return stream_samples(sampler, args, prompts, seeds, (num_frames, height, width), common, save_dir, on_chunk)
    # data parallelism over prompts: with G = world / S groups, group g samples prompts g, g + G, g + 2G, ...
    groups, group = (1, 0) if sp is None else (dist.get_world_size() // sp.size, dist.get_rank() // sp.size)
    mine = list(range(group, len(prompts), groups))
    written, rows = [], []
    for start in range(0, len(mine), batch_size):
        indices = mine[start : start + batch_size]
        chunk = [prompts[i] for i in indices]
        videos = sampler.generate(
            chunk,
            [seeds[i] for i in indices],
            num_frames,
            height,
            width,
            num_steps=int(args.num_steps),
            step_list=step_list,
            guidance_scale=float(args.guidance_scale),
            image_guidance_scale=float(args.image_guidance_scale),
            cond_type=args.cond_type,
            ref=args.ref,
        )
        if not writes:  # a sequence-parallel rank > 0: it took part in the denoising, its group's rank 0 writes
            continue
        for index, prompt, frames in zip(indices, chunk, videos.numpy()):
            stem = save_dir / sample_stem(index, prompt)
            path = save_sample(stem, frames, fps=float(args.fps))
            write_sidecar(
                stem.with_suffix(".json"), dict(index=index, prompt=prompt, seed=seeds[index], path=path.name, **common)
            )
            written.append(path)
            rows.append(dict(index=index, path=path.name, text=prompt))
        if groups == 1:
            write_samples_csv(save_dir, rows)  # rewritten after each batch: usable even if the run stops early
    if groups > 1:  # one samples.csv in prompt order, written by rank 0 from every group's rows
        everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(rows, everyone, dst=0)
        if dist.get_rank() == 0:
            rows = sorted((row for part in everyone for row in part), key=lambda row: row["index"])
    if (groups == 1 and writes) or (groups > 1 and dist.get_rank() == 0):
        write_samples_csv(save_dir, [dict(path=r["path"], text=r["text"]) for r in rows])
    if writes:
        logger.info("wrote %d sample(s) to %s", len(written), save_dir)
    return written


def stream_samples(sampler, args, prompts, seeds, size, common, save_dir, on_chunk=None) -> list:
    """``--streaming``: each batch of prompts is generated chunk by chunk (``StreamingGenerator``) and every chunk is
    appended to the samples' mp4 files as soon as it is decoded."""
    from opensora.inference.io import write_samples_csv, write_sidecar
    from opensora.inference.prompts import sample_stem
    from opensora.inference.streaming.generator import StreamingGenerator
    from opensora.inference.streaming.writer import BatchVideoWriters

    num_frames, height, width = size
    if args.cond_type != "t2v" or args.ref is not None:
        raise UserInputError("--streaming generates text-to-video only (no --cond-type / --ref)")
    if sampler.accelerator is not None:
        raise UserInputError(
            "--streaming and --jano do not combine (the KV cache and the region cache share the attention seam)"
        )
    generator = StreamingGenerator(sampler, **streaming_options(args, sampler.device))
    record = dict(
        common,
        streaming=True,
        window_frames=args.window_frames,
        sink_frames=int(args.sink_frames),
        rollout=str(args.rollout),
        chunk_frames=generator.chunk_frames,
    )
    batch_size = max(1, int(args.batch_size))
    written, rows = [], []
    for start in range(0, len(prompts), batch_size):
        batch = list(range(start, min(start + batch_size, len(prompts))))
        stems = [save_dir / sample_stem(i, prompts[i]) for i in batch]
        seconds = []
        with BatchVideoWriters(stems, height, width, float(args.fps)) as writers:
            for chunk in generator.stream(
                [prompts[i] for i in batch], [seeds[i] for i in batch], num_frames, height, width
            ):
                writers.write(chunk.frames.numpy())
                seconds.append(round(chunk.seconds, 4))
                if on_chunk is not None:
                    on_chunk(chunk, writers.paths)
        for i, stem in zip(batch, stems):
            write_sidecar(
                stem.with_suffix(".json"),
                dict(
                    index=i,
                    prompt=prompts[i],
                    seed=seeds[i],
                    path=stem.with_suffix(".mp4").name,
                    chunk_seconds=seconds,
                    **record,
                ),
            )
            written.append(stem.with_suffix(".mp4"))
            rows.append(dict(path=stem.with_suffix(".mp4").name, text=prompts[i]))
        write_samples_csv(save_dir, rows)
    logger.info("streamed %d sample(s) and samples.csv to %s", len(written), save_dir)
    return written


if __name__ == "__main__":
    sys.exit(run_cli(main, sys.argv[1:], prog="inference.py"))
