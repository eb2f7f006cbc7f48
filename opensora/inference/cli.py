"""``scripts/diffusion/inference.py``'s logic, importable: parse config + flags, build a ``VideoSampler``, write samples.

    python scripts/diffusion/inference.py configs/diffusion/inference/demo.py --ckpt outputs/demo/train \
        --prompt-file outputs/demo/data/meta.csv --save-dir outputs/demo/samples --num-steps 30 --seed 0

Every flag is a config key (``--num-steps`` sets ``num_steps``); any other ``--dotted.key`` overrides the config. The
flags, their defaults and checks are ``options.py``'s, one dataclass per feature. ``main`` dispatches to one of three
ways of sampling (the bidirectional sampler, optionally region-cached or sequence parallel; streaming on one GPU;
streaming on two), and all three write through one ``SampleWriter``: ``{save_dir}/{index:04d}_{slug}.mp4`` (``.png``
for one frame) with a ``.json`` sidecar each, ``{save_dir}/samples.csv`` (``path,text``: the input of
``tools/eval_moving_shapes.py``) and the resolved ``{save_dir}/config.py``.
"""

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

from opensora.checkpoint_layout import newest_checkpoint_of
from opensora.checkpoint_manifest import verify_checkpoint
from opensora.cli_errors import UserInputError, run_cli
from opensora.config import load_config_from_cli, save_config
from opensora.inference.cli_help import INFERENCE_HELP, training_clip_defaults
from opensora.inference.options import InferenceOptions
from opensora.inference.save_dir import SaveDirPlan, plan_save_dir
from opensora.quiet_logs import quiet_third_party
from opensora.shape_rules import check_sampling_shape
from opensora.writable import check_writable_dir

logger = logging.getLogger(__name__)

INFERENCE_FLAGS = InferenceOptions.flags()


@dataclass
class SampleRun:
    """One sampling run as ``main`` resolved it, what every way of sampling takes."""

    cfg: object  # the loaded config (mmengine Config)
    options: InferenceOptions
    prompts: List[str]
    seeds: List[int]
    ckpt: Path
    size: Tuple[int, int, int]  # (num_frames, height, width) in pixels
    on_chunk: Optional[Callable] = None  # streaming: called with (chunk, paths) after each chunk is in the files
    sp: object = None  # this rank's SequenceGroup under --sequence-parallel-size > 1
    device: object = None  # the device the sequence-parallel start chose (None: the --device flag)
    save_plan: Optional[SaveDirPlan] = None  # file numbering after the save-dir's earlier samples (save_dir.py)

    def record(self, **fields) -> dict:
        """What every sample's sidecar records of the run, then ``fields``."""
        sampling = self.options.sampling
        num_frames, height, width = self.size
        return dict(
            config=self.options.config,
            checkpoint=str(self.ckpt),
            role=self.options.run.role,
            **sampling.steps_record(),
            guidance_scale=sampling.guidance_scale,
            num_frames=num_frames,
            height=height,
            width=width,
            fps=sampling.fps,
            **fields,
        )


def resolve_checkpoint(path) -> Path:
    """A checkpoint directory or file as given, or the newest complete checkpoint of a training outputs dir."""
    if path is None:
        raise SystemExit("--ckpt PATH is required (a checkpoint directory or a .safetensors file)")
    path = newest_checkpoint_of(path)
    if not path.exists():
        raise SystemExit(f"checkpoint {path} does not exist")
    return path


def main(argv=None, on_chunk=None) -> list:
    """Run the sampling CLI; returns the written sample paths. ``on_chunk(chunk, paths)`` (streaming only) is
    called after each chunk's frames are in the files."""
    quiet_third_party()
    cfg, args = load_config_from_cli(
        argv,
        script_flags=INFERENCE_FLAGS,
        prog="inference.py",
        description="Sample videos from a trained (or distilled) model.",
        flag_help=INFERENCE_HELP,
        config_defaults=training_clip_defaults,
        repeatable=("prompt",),
    )
    options = InferenceOptions.from_args(args)  # the namespace goes no further
    check_writable_dir(Path(str(options.run.save_dir)), "--save-dir")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from opensora.inference.prompts import per_sample_seeds, resolve_prompts
    from opensora.inference.sampler import video_size_for

    run, sampling = options.run, options.sampling
    schedule = options.streaming.schedule()
    try:  # a prompt schedule makes one video: its first prompt starts it
        prompts = [schedule[0][1]] if schedule else resolve_prompts(run.prompt, run.prompt_file)
    except (ValueError, FileNotFoundError) as error:
        raise SystemExit(str(error)) from None
    if isinstance(run.prompt, str) and "|" in run.prompt:
        logger.info("--prompt split at '|' into %d prompts (repeat --prompt to keep a '|' in one)", len(prompts))
    ckpt = resolve_checkpoint(run.ckpt)
    try:
        height, width = video_size_for(str(sampling.resolution), sampling.aspect_ratio)
    except ValueError as error:
        raise UserInputError(f"--resolution / --aspect-ratio: {error}") from None
    check_sampling_shape(cfg, run.role, sampling.num_frames, height, width, str(sampling.resolution))
    if ckpt.is_dir():  # sizes always (a stat per file), checksums with --verify-checkpoint
        verify_checkpoint(ckpt, checksums=bool(run.verify_checkpoint), only=run.role)
    sp, device = start_sequence_parallel(run.sequence_parallel_size, run.device)
    job = SampleRun(
        cfg,
        options,
        prompts,
        per_sample_seeds(sampling.seed, len(prompts)),
        ckpt,
        (sampling.num_frames, height, width),
        on_chunk,
        sp,
        device,
        plan_save_dir(run.save_dir, bool(run.overwrite)),
    )
    try:
        return sample(job)
    finally:
        if sp is not None:
            from opensora.parallel.process_group import release_process_group

            release_process_group(succeeded=True)  # on every path, as before: destroyed, and its cycles collected


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


def sample(job: SampleRun) -> list:
    """Write ``job``'s samples the way its options ask; returns the written sample paths."""
    if job.options.pipeline.enabled:
        from opensora.inference.pipeline_parallel.cli import run_pipelined

        start_save_dir(job)
        return run_pipelined(job)
    sampler = build_sampler(job)
    if job.options.streaming.streaming:
        generator, switches = streaming_generator(job, sampler)  # a bad schedule is refused before the save-dir
        start_save_dir(job)
        return stream_samples(job, sampler, generator, switches)
    start_save_dir(job)  # once the weights have loaded: a refused start leaves no half-made save-dir
    return sample_videos(job, sampler)


def start_save_dir(job: SampleRun) -> None:
    """The save-dir and the run's resolved config (under the name the save-dir plan gives it)."""
    import torch.distributed as dist

    save_dir = Path(job.options.run.save_dir)
    if job.sp is None or job.sp.rank == 0:  # a sequence-parallel group's rank 0 writes its samples
        save_dir.mkdir(parents=True, exist_ok=True)
    if job.sp is None or dist.get_rank() == 0:
        save_config(job.cfg, save_dir, job.save_plan.config_name)


def build_sampler(job: SampleRun):
    """The ``VideoSampler`` of ``job`` (its graphs and region cache set up as the options ask)."""
    from opensora.inference.sampler import VideoSampler

    run, options = job.options.run, job.options
    sampler = VideoSampler.from_config(
        job.cfg,
        job.ckpt,
        role=run.role,
        ema=bool(run.ema),
        device=run.device if job.device is None else job.device,
        dtype=run.dtype,
        offload=bool(run.offload),
        progress=bool(run.progress) and (job.sp is None or job.sp.rank == 0),
    )
    sampler.set_sequence_parallel(job.sp)
    sampler.set_cuda_graphs(options.sampling.cuda_graphs != "off")
    if options.cache.enabled:
        from opensora.inference.cache.jano import JanoCache

        sampler.accelerator = JanoCache(options.cache.jano_config())
    return sampler


def sampler_record(job: SampleRun, sampler) -> dict:
    """The sidecar record of a run sampled by ``sampler``."""
    sampling, weights = job.options.sampling, sampler.weights
    latent_size = sampler.latent_size(*job.size)
    return job.record(
        weights=str(weights.path),
        weights_source=weights.source,
        checkpoint_step=weights.step,
        shift_alpha=None if sampling.step_list is not None else sampler.shift_alpha(latent_size),  # unshifted list
        image_guidance_scale=sampling.image_guidance_scale,
        cond_type=sampling.cond_type,
        ref=None if sampling.ref is None else str(sampling.ref),
        **({} if job.sp is None else dict(sequence_parallel_size=job.sp.size)),
        dtype=str(sampler.dtype).replace("torch.", ""),
        device=str(sampler.device),
        **({} if sampler.accelerator is None else dict(jano=dict(vars(sampler.accelerator.config)))),
    )


def sample_videos(job: SampleRun, sampler) -> list:
    """The bidirectional sampler, a batch of prompts at a time (data parallel over sequence-parallel groups)."""
    import torch.distributed as dist

    from opensora.inference.sample_writer import SampleWriter

    sampling, sp = job.options.sampling, job.sp
    num_frames, height, width = job.size
    logger.info(
        "sampling %d prompt(s) at %dx%dx%d (latent %s) from %s [%s] on %s/%s",
        len(job.prompts),
        num_frames,
        height,
        width,
        sampler.latent_size(*job.size),
        sampler.weights.path,
        sampler.weights.source,
        sampler.device,
        sampler.dtype,
    )
    writer = SampleWriter(
        job.options.run.save_dir, job.prompts, job.seeds, sampling.fps, sampler_record(job, sampler), job.save_plan
    )
    writes = sp is None or sp.rank == 0
    # data parallelism over prompts: with G = world / S groups, group g samples prompts g, g + G, g + 2G, ...
    groups, group = (1, 0) if sp is None else (dist.get_world_size() // sp.size, dist.get_rank() // sp.size)
    mine = list(range(group, len(job.prompts), groups))
    for start in range(0, len(mine), sampling.batch_size):
        indices = mine[start : start + sampling.batch_size]
        videos = sampler.generate(
            [job.prompts[i] for i in indices],
            [job.seeds[i] for i in indices],
            num_frames,
            height,
            width,
            num_steps=sampling.num_steps,
            step_list=sampling.step_list,
            guidance_scale=sampling.guidance_scale,
            image_guidance_scale=sampling.image_guidance_scale,
            cond_type=sampling.cond_type,
            ref=sampling.ref,
        )
        if not writes:  # a sequence-parallel rank > 0: it took part in the denoising, its group's rank 0 writes
            continue
        for index, frames in zip(indices, videos.numpy()):
            writer.video(index, frames)
        if groups == 1:
            writer.write_csv()  # rewritten after each batch: usable even if the run stops early
    if groups > 1:  # one samples.csv in prompt order, written by rank 0 from every group's rows
        everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(writer.rows, everyone, dst=0)
        if dist.get_rank() == 0:
            writer.write_csv([row for part in everyone for row in part])
    if writes:
        logger.info("wrote %d sample(s) to %s", len(writer.written), writer.save_dir)
    return writer.written


def streaming_generator(job: SampleRun, sampler):
    """The ``StreamingGenerator`` of ``job`` and the prompt switches of its ``--prompt-schedule`` (checked against
    the chunks of this video: a one-line error naming the frames a prompt can switch at)."""
    from opensora.inference.streaming.generator import StreamingGenerator

    sampling, streaming = job.options.sampling, job.options.streaming
    generator = StreamingGenerator(sampler, **streaming.generator_kwargs(sampling, sampler.device))
    schedule = streaming.schedule()
    switches = generator.schedule_switches(schedule, *job.size) if schedule else []
    return generator, switches


def stream_samples(job: SampleRun, sampler, generator, switches=()) -> list:
    """``--streaming``: each batch of prompts is generated chunk by chunk (``StreamingGenerator``) and every chunk is
    appended to the samples' mp4 files as soon as it is decoded; ``switches``: the prompt schedule's (one video)."""
    from opensora.inference.sample_writer import SampleWriter
    from opensora.inference.stream_progress import StreamReport, stream_progress_bar
    from opensora.inference.streaming.prompt_schedule import format_schedule

    sampling, streaming = job.options.sampling, job.options.streaming
    record = dict(
        sampler_record(job, sampler), streaming=True, **streaming.record(), chunk_frames=generator.chunk_frames
    )
    # a schedule's video is named and listed (samples.csv) by its whole schedule, which the window scoring reads
    names = [format_schedule(streaming.schedule())] if streaming.prompt_schedule is not None else job.prompts
    writer = SampleWriter(job.options.run.save_dir, names, job.seeds, sampling.fps, record, job.save_plan)
    latent_frames = sampler.latent_size(*job.size)[0]
    bar = stream_progress_bar(
        latent_frames, generator.chunk_frames, len(job.prompts), sampling.batch_size, bool(job.options.run.progress)
    )
    for batch in batches(len(job.prompts), sampling.batch_size):
        report = StreamReport(bar)
        with writer.streams(batch, *job.size[1:]) as files:
            prompts, seeds = [job.prompts[i] for i in batch], [job.seeds[i] for i in batch]
            for chunk in generator.stream(prompts, seeds, *job.size, switches=switches):
                files.write(chunk.frames.numpy())
                report.chunk(chunk)
                if job.on_chunk is not None:
                    job.on_chunk(chunk, files.paths)
        for index, path in zip(batch, files.paths):
            writer.finished(index, path, **report.record())
        writer.write_csv()
        if report.recaches:
            logger.info("%s", report.summary())
    bar.close()
    logger.info("streamed %d sample(s) and samples.csv to %s", len(writer.written), writer.save_dir)
    return writer.written


def batches(count: int, size: int) -> List[Sequence[int]]:
    """Sample indices ``0..count-1`` in batches of ``size`` (the last may be smaller)."""
    return [range(start, min(start + size, count)) for start in range(0, count, size)]


if __name__ == "__main__":
    sys.exit(run_cli(main, sys.argv[1:], prog="inference.py"))
