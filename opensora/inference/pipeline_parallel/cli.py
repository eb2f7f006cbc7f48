"""``inference.py --streaming --pp-devices cuda:0,cuda:1``: streaming generation on two GPUs (pipeline_parallel/).

    python scripts/diffusion/inference.py CONFIG --ckpt CKPT --prompt "..." --streaming --step-list 1.0,0.75,0.5,0.25 \
        --pp-devices cuda:0,cuda:1 --pp-overlap aggressive --pp-split auto [--profile]

Same sampler as ``--streaming`` on one GPU (``StreamingGenerator``: its schedule, rollout, CFG layout, noise order,
cache refill at ``--context-time``, rolling window, chunk decoder), so the videos are bit-identical to it; each
prompt group (``--batch-size`` prompts) is one item in flight (several groups overlap fully). GPU0: text features,
noise, embedders and blocks[0..split]; GPU1: the other blocks, the final layer and the sampler update; each video's
chunk decoder (``--streaming``'s decode rule, exact-once by default) on the GPU ``--pp-split auto`` places it (GPU1
unless the measured plan says otherwise; GPU1 with an explicit split). ``--pp-cfg-rows false`` runs the CFG passes
as separate micro-batches (two items in flight per prompt group; same math, other GEMM shapes, so equal to one GPU
running those micro-batches, not to ``--streaming``); ``--stream-refill false`` lets the last denoising step write
the cache (another sampler). Unlike ``--streaming``, the mp4s are written once all chunks are done (by the same
writer, so equal frames give equal files). ``--profile`` writes ``pp_profile.json`` (per task: GPU, start/end ms;
per GPU: busy/idle) to the save dir and logs the per-stage summary. ``--pp-split auto`` (``auto_split``) chooses the
split as ``benchmarks/pipeline_parallel.py`` does: per-block probe times calibrated to a few timed whole stage
passes (``pipeline_parallel.calibrated_split``); the JSON's ``pp_split`` records both; an explicit ``--pp-split N``
skips it. ``--pp-decode-stream side`` (the default) decodes on a stream of its own per GPU, beside the passes;
``compute`` decodes on the GPU's compute stream, in front of the passes issued after it (same frames either way).
"""

from __future__ import annotations

import json
import logging

logger = logging.getLogger(__name__)


def dump_json(path, payload) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)


def auto_split(model, devices, mode, groups, latent_size, times, stage_kw, generator, decoders=None, contention=None):
    """``--pp-split auto``, as ``benchmarks/pipeline_parallel.py`` chooses it: the per-block probe
    (``measure_stage_times`` on devices[0] at ``typical_past_frames`` cached frames) and the run's own chunk decode
    (``measure_chunk_decode``: ``decoders``, a ``ChunkDecoders``, over one video's chunks) -> a probe split; the
    model placed there and a few whole stage0 / stage1 passes timed (``measure_stage_passes``, graphed when the run
    will be) -> the probe times calibrated to those passes and the split and the decode placement chosen on them
    (``calibrated_split(place_decode=True)``: the decode counts on the GPU that runs it). Leaves ``model`` placed at
    the returned split. Returns (split, the split report: probe times, decode times, candidates, the measured
    passes, the calibrated choice and ``decode_lanes``). Neither choice changes a value: each video is decoded in
    order by one decoder of the one-GPU rule, wherever it lives. ``contention``: the simulator's (None: its
    default; see ``schedule.simulate``)."""
    import torch

    from .decoders import measure_chunk_decode
    from .runtime import Lanes
    from .split import calibrated_split, choose_split
    from .stage_times import measure_stage_passes, measure_stage_times, typical_past_frames
    from .stages import place_model, seeded_latent_noise
    from .streaming_stages import CausalStreamingStages

    graphed = bool(stage_kw.get("cuda_graphs"))
    probe = CausalStreamingStages(model, Lanes([devices[0], devices[0]]), 0, groups, latent_size, times, **stage_kw)
    plan, rows = probe.plan, probe.text[0][0]
    del probe
    x = seeded_latent_noise(groups[0]["seeds"], (latent_size[0], generator.chunk_frames, *latent_size[2:]))
    x = torch.cat([x] * (rows["text_emb"].shape[0] // x.shape[0])).to(devices[0])
    # a graphed stage costs its kernels, an eager one its launches: the split follows what will run
    past = typical_past_frames(latent_size[1], generator.chunk_frames, generator.window_frames)
    probe_ms = measure_stage_times(model, x, rows, cuda_graphs=graphed, past_frames=past)
    decode_report = None
    if decoders is not None:  # the run's decoder over a video's chunks (a causal decoder's chunks differ in cost)
        video = seeded_latent_noise(groups[0]["seeds"], latent_size)
        chunks = list(video.split(generator.chunk_frames, dim=2))
        decode_report = measure_chunk_decode(decoders, devices[0], chunks)
        probe_ms["decode_ms"] = decode_report["mean_ms"]
    embed, final = probe_ms["embed_ms"], probe_ms["final_ms"]
    shared = {} if contention is None else dict(contention=contention)
    probe_split, _ = choose_split(
        plan, mode, probe_ms["block_ms"], embed, final, decode_ms=probe_ms["decode_ms"], **shared
    )
    logger.info(
        "pp-split auto, probe: split %d (per unit, a chunk after %d cached frames: embed %.2f ms, blocks %s ms, "
        "final %.2f ms, decode %.2f ms)",
        probe_split,
        past,
        embed,
        [round(t, 2) for t in probe_ms["block_ms"]],
        final,
        probe_ms["decode_ms"],
    )
    place_model(model, probe_split, devices)
    sampler_kw = {k: v for k, v in stage_kw.items() if k not in ("make_decoder", "cuda_graphs")}
    passes = measure_stage_passes(
        model, devices, probe_split, groups[0], latent_size, times, past, cuda_graphs=graphed, **sampler_kw
    )
    split, table, details = calibrated_split(
        plan, mode, probe_ms, len(model.double_blocks), passes, place_decode=decoders is not None, **shared
    )
    if split != probe_split:
        place_model(model, split, devices)
    best = next(r for r in table if r["split"] == split and tuple(r["decode_lanes"]) == details["decode_lanes"])
    logger.info(
        "pp-split auto: GPU0 = embed + blocks[0..%d], GPU1 = blocks[%d..] + final; decode of each video on GPU %s "
        "(%.1f ms per chunk; simulated busy GPU0/GPU1 %.2f/%.2f) (whole passes at split "
        "%d%s: stage0 %.2f ms, stage1 %.2f ms, where the probe summed %.2f / %.2f ms; calibrated: stage0 %.2f ms, "
        "stage1 %.2f ms, simulated plan time %.1f ms, the shortest of %d splits)",
        split,
        split + 1,
        list(details["decode_lanes"]) or [1] * len(groups),
        probe_ms["decode_ms"],
        *best["simulated_busy"],
        probe_split,
        ", graphed" if passes["graphed"] else "",
        passes["stage0"],
        passes["stage1"],
        embed + sum(probe_ms["block_ms"][: probe_split + 1]),
        sum(probe_ms["block_ms"][probe_split + 1 :]) + final,
        best["stage0_ms"],
        best["stage1_ms"],
        best["simulated_ms"],
        len(table),
    )
    report = dict(
        stage_times=probe_ms,
        past_frames=past,
        candidates=table,
        probe_split=probe_split,
        calibration=details,  # its ``measured``: the timed passes
        decode=decode_report,
        decode_lanes=list(details["decode_lanes"]),
        decode_stream=plan.decode_stream,
        simulated_busy=best["simulated_busy"],
        simulated_ms=best["simulated_ms"],
    )
    return split, report


def run_pipelined(job) -> list:
    """Generate ``job``'s prompts (a ``cli.SampleRun``) with the two-GPU streaming pipeline; returns the written
    sample paths."""
    from opensora.inference.sample_writer import SampleWriter
    from opensora.inference.sampler import VideoSampler
    from opensora.inference.streaming.generator import StreamingGenerator

    from .decoders import ChunkDecoders
    from .runtime import Lanes, run_plan
    from .split import parse_split
    from .stages import all_blocks, place_model
    from .streaming_stages import CausalStreamingStages

    run, sampling, streaming, pipeline = (
        job.options.run,
        job.options.sampling,
        job.options.streaming,
        job.options.pipeline,
    )
    devices, mode = pipeline.devices(), pipeline.pp_overlap
    sampler = VideoSampler.from_config(
        job.cfg, job.ckpt, role=run.role, ema=bool(run.ema), device=devices[0], dtype=run.dtype, progress=False
    )
    model = sampler.model
    generator = StreamingGenerator(sampler, **streaming.generator_kwargs(sampling, devices[0]))
    graphed = generator.cuda_graphs is not None
    latent = sampler.latent_size(*job.size)
    times = generator.schedule(latent)
    guidance, batch = sampling.guidance_scale, sampling.batch_size
    groups = []
    for start in range(0, len(job.prompts), batch):
        text, null = sampler.encode_text(job.prompts[start : start + batch])
        seeds = job.seeds[start : start + batch]
        groups.append(dict(seeds=seeds, branches=[text] + ([null] if guidance != 1.0 else [])))
    sampler.vae.to(devices[0])
    # one decoder per video with --streaming's decode rule (exact-once by default), on the GPU the plan gives it
    make_decoder = ChunkDecoders.like(generator)

    latent_size = (sampler.vae.latent_channels, *latent)
    kw = dict(
        refill=bool(pipeline.stream_refill),
        rollout=streaming.rollout,
        guidance_scale=guidance,
        context_time=streaming.context_time,
        window_frames=generator.window_frames,
        sink_frames=generator.sink_frames,
        rope_anchor=generator.rope_anchor,
        cfg_rows=bool(pipeline.pp_cfg_rows),
        make_decoder=make_decoder,
        decode_stream=pipeline.pp_decode_stream,
        cuda_graphs=graphed,  # every stage's pass a CUDA graph, all issued from one host thread
    )
    split = parse_split(pipeline.pp_split, len(all_blocks(model)))
    split_report = dict(requested=str(pipeline.pp_split))
    costs, decode_lanes = None, None  # the schedule's default costs and decode on GPU1, unless auto measured them
    if split is None:
        split, report = auto_split(model, devices, mode, groups, latent_size, times, kw, generator, make_decoder)
        split_report.update(report)
        costs, decode_lanes = report["calibration"]["costs"], report["decode_lanes"]
    split_report["split"] = split
    place_model(model, split, devices)  # auto: already there
    lanes = Lanes(devices, profile=bool(pipeline.profile), host_copies=pipeline.pp_host_copies)
    stages = CausalStreamingStages(model, lanes, split, groups, latent_size, times, decode_lanes=decode_lanes, **kw)
    result, sim = run_plan(stages, mode, lanes, costs=costs)  # auto: the calibrated costs (issue order only)
    num_chunks = stages.plan.num_chunks
    placed = [stages.plan.decode_lane(g) for g in range(len(groups))]
    logger.info(
        "two-GPU streaming (%s, split %d, decode of each video on GPU %s): %d prompt(s) x %d chunks in %.2f s "
        "(%.1f latent frames/s; simulated busy GPU0/GPU1 %.2f/%.2f)",
        mode,
        split,
        placed,
        len(job.prompts),
        num_chunks,
        result.seconds,
        len(job.prompts) * latent[0] / result.seconds,
        *sim.busy_fraction,
    )
    pp_record = dict(
        pp_devices=devices,
        pp_overlap=mode,
        pp_decode_stream=pipeline.pp_decode_stream,
        pp_host_copies=pipeline.pp_host_copies,
        pp_split=split_report,
        decode_lanes=placed,
        decode=make_decoder.summary(),
        simulated_busy=list(sim.busy_fraction),
        stream_times=times,
        stream_refill=bool(pipeline.stream_refill),
        seconds=result.seconds,
        streaming=True,
        **streaming.record(),
        context_time=streaming.context_time,
        chunk_frames=generator.chunk_frames,
    )
    lane_summary = result.summary.get("lanes", {})
    if costs is not None:  # the calibrated plan's time, to set beside a profile's span
        pp_record["simulated_ms"] = sim.makespan
    if lane_summary:  # measured (--profile): the busy fraction per GPU
        pp_record["busy"] = {lane: round(v["busy_fraction"], 4) for lane, v in lane_summary.items()}
        pp_record["measured_span_ms"] = result.summary["span_ms"]
    save_dir = job.options.run.save_dir
    if pipeline.profile:
        dump_json(f"{save_dir}/pp_profile.json", dict(summary=result.summary, timeline=result.timeline, **pp_record))
        for lane, s in result.summary.get("lanes", {}).items():
            logger.info(
                "profile %s: busy %.1f ms, idle %.1f ms, busy fraction %.2f",
                lane,
                s["busy_ms"],
                s["idle_ms"],
                s["busy_fraction"],
            )
        logger.info("profile ms per stage: %s", {k: round(v, 2) for k, v in result.summary["ms_per_kind"].items()})
    writer = SampleWriter(save_dir, job.prompts, job.seeds, sampling.fps, job.record(**pp_record), job.save_plan)
    for g, group in enumerate(groups):
        indices = [g * batch + i for i in range(len(group["seeds"]))]
        with writer.streams(indices, *job.size[1:]) as files:  # as --streaming writes them
            for c in range(num_chunks):
                files.write(result.frames[(g, c)].numpy())
        for index, path in zip(indices, files.paths):
            writer.finished(index, path)
    writer.write_csv()
    return writer.written
