"""Two-GPU pipeline overlap: every chunk bit-identical (max |diff| == 0) to single-GPU streaming (the
``StreamingGenerator`` of ``--streaming``), for every overlap mode, on repeated runs, in bf16 with the GPU attention
kernels; the variants the generator lacks (no refill, CFG passes as micro-batches) against the single-GPU loop with
the same options; the bidirectional CFG sampler against one GPU running the same micro-batches; the CUDA-graphed
stages (one host thread) against the generator with its CUDA graphs. Needs 2 CUDA devices (skipped otherwise)."""

import copy

import pytest
import torch
from streaming_reference import stream_reference

from opensora.inference.pipeline_parallel.decoders import device_decoder
from opensora.inference.pipeline_parallel.runtime import HOST_COPY_MODES, Lanes, run_plan
from opensora.inference.pipeline_parallel.schedule import DECODE_STREAM_MODES, OVERLAP_MODES
from opensora.inference.pipeline_parallel.stages import BidirectionalStages, place_model, sample_microbatched
from opensora.inference.pipeline_parallel.streaming_stages import CausalStreamingStages
from opensora.inference.sampler import VideoSampler
from opensora.inference.streaming.chunk_graphs import ChunkGraphs
from opensora.inference.streaming.generator import ChunkDecoder

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]
DEVICES = ["cuda:0", "cuda:1"]
REPEATS = 3
SHAPE = dict(hidden_size=256, num_heads=2, axes_dims=(16, 56, 56), depth_double=2, depth_single=4, attn_backend="auto")


def gpu_sampler(**overrides):
    from test_streaming import tiny_sampler  # tests/ is on sys.path under pytest's default import mode

    cpu = tiny_sampler(**SHAPE, **overrides)
    return VideoSampler(cpu.model.to("cuda:0", torch.bfloat16), cpu.vae.to("cuda:0"), cpu.text_encoder, progress=False)


def lane1_decoder(sampler):
    vae1 = copy.deepcopy(sampler.vae).to(DEVICES[1])
    return lambda *_: ChunkDecoder(device_decoder(vae1, sampler.dtype), vae1)  # sampler.decode's casts, on lane 1


def pipelined(sampler, groups, latent_size, times, split, make_decoder, graphs=False, **kw):
    """Every overlap mode, REPEATS runs each; ``graphs``: CUDA-graphed stages (runners kept across the runs)."""
    pp = copy.deepcopy(sampler.model)
    place_model(pp, split, DEVICES)
    runners = (ChunkGraphs(pp), ChunkGraphs(pp)) if graphs else None
    for mode in OVERLAP_MODES:
        for run in range(REPEATS):
            lanes = Lanes(DEVICES, profile=run == 0)
            stages = CausalStreamingStages(
                pp, lanes, split, groups, latent_size, times, make_decoder=make_decoder, cuda_graphs=runners, **kw
            )
            yield mode, run, run_plan(stages, mode, lanes)[0]
    for runner in runners or ():
        assert runner.summary["eager"] == 0 and runner.summary["failures"] == [], runner.summary


def assert_every_mode_matches(sampler, case, gen, refs, groups, latent_size, graphs=False, **options):
    """The pipeline (split 2) in every mode, REPEATS runs each: every chunk's latents and frames equal ``refs``.
    ``options``: more stage options, as the generator that made ``refs`` had them (sink frames, RoPE anchor)."""
    _, _, guidance, rollout, window, context_time = case
    for mode, run, result in pipelined(
        sampler,
        groups,
        latent_size,
        gen.schedule(latent_size[1:]),
        2,
        lane1_decoder(sampler),
        graphs=graphs,
        rollout=rollout,
        guidance_scale=guidance,
        context_time=context_time,
        window_frames=window,
        **options,
    ):
        for g, chunks in enumerate(refs):
            for chunk in chunks:
                diff = (result.latents[(g, chunk.index)] - chunk.latents.cpu()).abs().max().item()
                assert diff == 0, (mode, run, g, chunk.index, diff)
                assert torch.equal(result.frames[(g, chunk.index)], chunk.frames), (mode, run, g, chunk.index)


GENERATOR_CASES = [
    # (prompt groups, step list, guidance, rollout, window_frames, context_time)
    ([["a red circle moving left"]], [1.0], 1.0, "renoise", None, 0.0),
    ([["a red circle moving left", "a blue square moving up"]], [1.0, 0.6, 0.3], 3.0, "renoise", None, 0.0),
    ([["a red circle moving left"], ["a green star moving down"]], [1.0, 0.5], 3.0, "euler", 4, 0.1),
]


@pytest.mark.parametrize("case", GENERATOR_CASES, ids=lambda c: f"g{len(c[0])}s{len(c[1])}w{c[2]}{c[3]}")
def test_two_gpu_streaming_is_bit_identical_to_the_one_gpu_streaming_generator(case):
    from test_pipeline_parallel import generator_reference

    sampler = gpu_sampler()
    num_frames, size = 9, 32  # 9 latent frames of 8x8: chunks of 2, the last one of 1
    gen, refs, groups, latent_size = generator_reference(sampler, case, num_frames, size)
    assert all(torch.isfinite(c.latents).all() for chunks in refs for c in chunks)
    assert_every_mode_matches(sampler, case, gen, refs, groups, latent_size)


class _Graphs:
    make = ChunkGraphs


@pytest.mark.parametrize("graphed", [False, True])
def test_two_gpu_streaming_under_the_window_anchor_is_bit_identical_to_one_gpu(graphed):
    """``rope_anchor="window"`` (the sampling CLI's default) with sinks, a 4-frame window (anchors 2, 4 at the end):
    each chunk's RoPE tables carry the anchor and both GPUs move their sinks and text keys, eager and graphed."""
    from test_pipeline_parallel import generator_reference

    sampler = gpu_sampler()
    case, options = GENERATOR_CASES[2], dict(sink_frames=2, rope_anchor="window")
    graphs = _Graphs if graphed else None
    gen, refs, groups, latent_size = generator_reference(sampler, case, 9, 32, graphs=graphs, **options)
    _, absolute, _, _ = generator_reference(sampler, case, 9, 32, graphs=graphs, sink_frames=2)
    assert not torch.equal(refs[0][-1].latents, absolute[0][-1].latents)  # the anchor moved
    assert_every_mode_matches(sampler, case, gen, refs, groups, latent_size, graphs=graphed, **options)


@pytest.mark.parametrize("case", GENERATOR_CASES[1:], ids=lambda c: f"g{len(c[0])}s{len(c[1])}w{c[2]}{c[3]}")
def test_two_gpu_graphed_stages_match_the_one_gpu_graphed_streaming_generator(case):
    """Each stage a CUDA graph, both GPUs issued from one host thread, vs ``StreamingGenerator(cuda_graphs=True)``:
    the same captured kernels on the same shapes, so bit for bit too (graphed vs eager may differ: printed)."""
    from test_pipeline_parallel import generator_reference

    sampler = gpu_sampler()
    num_frames, size = 9, 32
    _, eager_refs, _, _ = generator_reference(sampler, case, num_frames, size)
    gen, refs, groups, latent_size = generator_reference(sampler, case, num_frames, size, graphs=_Graphs)
    assert gen.cuda_graphs.summary["replays"] > 0 and gen.cuda_graphs.summary["eager"] == 0
    graphed_vs_eager = max(
        (a.latents - b.latents).abs().max().item() for x, y in zip(refs, eager_refs) for a, b in zip(x, y)
    )
    print(f"graphed vs eager generator: max |diff| {graphed_vs_eager:g}")
    assert_every_mode_matches(sampler, case, gen, refs, groups, latent_size, graphs=True)


@pytest.mark.parametrize("refill,cfg_rows", [(False, True), (True, False)])
def test_two_gpu_streaming_variants_match_the_one_gpu_loop(refill, cfg_rows):
    sampler = gpu_sampler()
    prompts = [["a red circle moving left"], ["a blue square moving up"]]
    groups = []
    for i, p in enumerate(prompts):
        text, null = sampler.encode_text(p)
        groups.append(dict(seeds=[i], branches=[text, null]))
    latent_size, times = (sampler.vae.latent_channels, 6, 8, 8), [1.0, 0.5, 0.0]
    make_ref_decoder = lambda *_: ChunkDecoder(device_decoder(sampler.vae, sampler.dtype), sampler.vae)  # noqa
    kw = dict(refill=refill, guidance_scale=3.0, cfg_rows=cfg_rows)
    refs = [
        stream_reference(sampler.model, g, latent_size, times, make_decoder=make_ref_decoder, device="cuda:0", **kw)
        for g in groups
    ]
    for mode, run, result in pipelined(sampler, groups, latent_size, times, 1, lane1_decoder(sampler), **kw):
        for g, (latents, frames) in enumerate(refs):
            for c in range(3):
                assert torch.equal(result.latents[(g, c)], latents[c].cpu()), (mode, run, g, c)
                assert torch.equal(result.frames[(g, c)], frames[c].cpu()), (mode, run, g, c)


def test_two_gpu_bidirectional_cfg_is_bit_identical_to_one_gpu_microbatches():
    sampler = gpu_sampler(causal_chunk_frames=0)
    model = sampler.model
    groups = []
    for i, p in enumerate(["a red circle moving left", "a blue square moving up"]):
        text, null = sampler.encode_text([p])
        groups.append(dict(seeds=[3 + i], branches=[text, null]))
    shape, times, scale = (sampler.vae.latent_channels, 4, 8, 8), [1.0, 0.8, 0.5, 0.2, 0.0], 5.0
    refs = [sample_microbatched(model, g, shape, times, scale, "cuda:0") for g in groups]
    pp = copy.deepcopy(model)
    split = 1
    place_model(pp, split, DEVICES)
    for mode in OVERLAP_MODES:
        for run in range(REPEATS):
            lanes = Lanes(DEVICES)
            stages = BidirectionalStages(pp, lanes, split, groups, shape, times, scale)
            result, _ = run_plan(stages, mode, lanes)
            for g, (x0, _) in enumerate(refs):
                assert torch.equal(result.latents[(g, 0)], x0.cpu()), (mode, run, g)


def test_a_graph_captured_on_the_second_gpu_while_the_first_is_current_replays_its_work():
    """A capture on cuda:1 after one on cuda:0, with cuda:0 current (what a stage-1 capture looked like when the
    capture stream was torch's process-wide default one, made on cuda:0): it must hold cuda:1's kernels, in a cuda:1
    pool, and leave cuda:0 current."""
    from opensora.models.mmdit.graph_memory import GraphMemory, on_capture_device

    torch.cuda.set_device(0)
    memory = GraphMemory()
    b = torch.randn(64, 64, device="cuda:0")
    memory.capture(lambda: memory.output("out0", b @ b), device=0)
    a = torch.randn(64, 64, device="cuda:1")
    holder = {}
    with on_capture_device(a.device):
        graph = memory.capture(lambda: holder.update(out=memory.output("out1", a @ a)))
    assert torch.cuda.current_device() == 0 and set(memory.pools) == {0, 1}
    a.copy_(torch.randn(64, 64, device="cuda:1"))
    graph.replay()
    torch.cuda.synchronize(1)
    assert holder["out"].device == torch.device("cuda", 1)
    torch.testing.assert_close(holder["out"], a @ a)


def test_cli_two_gpu_streaming_writes_the_one_gpu_streaming_videos(tmp_path):
    """``inference.py --streaming --pp-devices cuda:0,cuda:1`` (graphed stages, the default on GPUs; ``--pp-split
    auto``, calibrated on timed graphed passes) writes the frames that ``--streaming`` on one GPU (graphed chunk
    passes) writes, for each overlap mode."""
    import json

    from test_streaming import random_causal_checkpoint

    from opensora.datasets.video_io import read_video
    from opensora.inference import cli

    config, ckpt = random_causal_checkpoint(tmp_path, depth=2)
    common = [str(config), "--ckpt", str(ckpt), "--prompt", "a red circle moving left", "--streaming"]
    common += ["--num-frames", "32", "--resolution", "32x32", "--step-list", "1.0,0.5", "--guidance-scale", "2.0"]
    common += ["--window-frames", "8", "--progress", "false", "--dtype", "bf16"]
    one = cli.main(common + ["--device", "cuda:0", "--save-dir", str(tmp_path / "one")])
    reference = read_video(one[0])
    for mode in OVERLAP_MODES:
        two = cli.main(
            common + ["--pp-devices", ",".join(DEVICES), "--pp-overlap", mode, "--save-dir", str(tmp_path / mode)]
        )
        assert torch.equal(torch.as_tensor(read_video(two[0])), torch.as_tensor(reference)), mode
        # --pp-split auto: whole stage passes timed as the run replays them (graphed) at the probe split, then the
        # split chosen again on the calibrated times (pipeline_parallel.cli.auto_split)
        report = json.loads(two[0].with_suffix(".json").read_text())["pp_split"]
        passes = report["calibration"]["measured"]
        assert passes["graphed"] and passes["split"] == report["probe_split"], passes
        assert passes["cached_frames"] == report["past_frames"] and passes["stage0"] > 0 and passes["stage1"] > 0
        assert report["split"] in [row["split"] for row in report["candidates"]]


# a small VAE of the real architecture (diffusers AutoencoderKLHunyuanVideo: causal 3D convs, 32-group norms, mid
# attention; 4x time, 8x space) whose latent channels the tiny causal MMDiT takes
SMALL_HUNYUAN_VAE = dict(
    block_out_channels=(32, 64, 64, 64), layers_per_block=1, norm_num_groups=32, latent_channels=48
)


@pytest.mark.parametrize(
    "decode_lanes,decode_stream,host_copies",
    [
        *[(lanes, stream, "shared") for lanes in (None, (0, 1)) for stream in DECODE_STREAM_MODES],
        ((0, 1), "side", "own"),
        ((0, 1), "compute", "own"),
    ],
    ids=lambda v: {None: "last-gpu", (0, 1): "one-per-gpu"}.get(v, v) if not isinstance(v, str) else v,
)
def test_two_gpu_streaming_with_the_exact_chunk_decode_is_bit_identical_to_one_gpu(
    decode_lanes, decode_stream, host_copies
):
    """The exact-once decode (running statistics, conv caches, the fused group norm, graphed decodes) of a
    HunyuanVideo-architecture VAE in bf16: each video's decoder on the GPU the plan gives it, on that GPU's decode
    stream (``side``: it waits for the chunk's x0 by event, a copy of its own from the other GPU) or its compute
    stream, every chunk's frames equal to ``StreamingGenerator(cuda_graphs=True)``'s (graphed passes, graphed
    decode on a side stream)."""
    from opensora.inference.pipeline_parallel.decoders import ChunkDecoders
    from opensora.inference.pipeline_parallel.schedule import DECODE_STREAMS
    from opensora.inference.streaming.generator import StreamingGenerator
    from opensora.models.vae.hunyuan_vae import HunyuanVideoVAE

    sampler = gpu_sampler()
    sampler.vae = HunyuanVideoVAE(config=SMALL_HUNYUAN_VAE, seed=0, dtype="bf16").to("cuda:0").eval()
    gen = StreamingGenerator(sampler, step_list=[1.0, 0.5], cuda_graphs=True)
    num_frames, size = 17, 64  # 5 latent frames: chunks of 2, 2, 1
    refs, groups = [], []
    for g, prompt in enumerate(["a red circle moving left", "a blue square moving up"]):
        refs.append(list(gen.stream([prompt], [g], num_frames, size, size)))
        text, _ = sampler.encode_text([prompt])
        groups.append(dict(seeds=[g], branches=[text]))
    assert gen.exact_decode is not None and gen.exact_decode.failures == []
    latent_size = (sampler.vae.latent_channels, *sampler.latent_size(num_frames, size, size))
    pp = copy.deepcopy(sampler.model)
    place_model(pp, 2, DEVICES)
    runners = (ChunkGraphs(pp), ChunkGraphs(pp))
    decoders = ChunkDecoders.like(gen)
    for mode in OVERLAP_MODES:
        for run in range(2):
            lanes = Lanes(DEVICES, profile=run == 0, host_copies=host_copies)
            stages = CausalStreamingStages(
                pp,
                lanes,
                2,
                groups,
                latent_size,
                gen.schedule(latent_size[1:]),
                make_decoder=decoders,
                cuda_graphs=runners,
                decode_lanes=decode_lanes,
                decode_stream=decode_stream,
            )
            result = run_plan(stages, mode, lanes)[0]
            for row in result.timeline:  # timed on the stream each ran on
                if row["kind"] == "decode":
                    assert row["stream"] == (DECODE_STREAMS[row["lane"]] if decode_stream == "side" else row["lane"])
            for g, chunks in enumerate(refs):
                for chunk in chunks:
                    assert torch.equal(result.latents[(g, chunk.index)], chunk.latents.cpu()), (mode, run, g)
                    frames = result.frames[(g, chunk.index)]
                    diff = (frames.int() - chunk.frames.int()).abs().max().item()
                    assert diff == 0, (mode, run, g, chunk.index, diff)
    assert decoders.summary()["graph_failures"] == []


@pytest.mark.parametrize("host_copies", HOST_COPY_MODES)
def test_a_frames_copy_after_a_decode_holds_back_peer_copies_only_when_shared(host_copies):
    """The 2-GPU runs with the real VAE idled ~30% (busy 0.70 / 0.67, simulated 0.97 / 0.98): ``to_host`` queued each
    chunk's frames copy, waiting for its decode, on the copy stream that every peer copy of that GPU also uses, and
    PyTorch makes a cross-device copy wait for the destination's copy stream too, so each activation hand-off issued
    after a decode waited for it, in both directions. A long kernel on GPU0's decode stream stands in for the decode:
    with ``own`` host-copy streams both peer copies land while it still runs, with ``shared`` only after it."""
    lanes = Lanes(DEVICES, host_copies=host_copies)
    a, b = torch.randn(4096, device=DEVICES[0]), torch.randn(4096, device=DEVICES[1])
    frames = torch.zeros(1 << 20, dtype=torch.uint8, device=DEVICES[0])
    lanes.synchronize()
    with lanes.device_context(0), lanes.decode_stream(0):
        torch.cuda._sleep(int(1e9))  # ~0.5 s at ~2 GHz
        frames.add_(1)
        decoded = lanes.event(0)
    host, copied = lanes.to_host(frames, decoded, 0)
    to1, to0 = lanes.pull(a, None, 1), lanes.pull(b, None, 0)  # GPU0 -> GPU1 and GPU1 -> GPU0
    landed = [lanes.event(1), lanes.event(0)]  # the compute streams wait for the copies
    for event in landed:
        event.synchronize()
    assert decoded.query() is (host_copies == "shared")
    copied.synchronize()
    assert bool((host == 1).all()) and torch.equal(to1.cpu(), a.cpu()) and torch.equal(to0.cpu(), b.cpu())
