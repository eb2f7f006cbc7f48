"""The two-GPU streaming pipeline with a causal (stateful) VAE decode: frames bit-identical to the one-device
``StreamingGenerator`` under the exact-once decode rule, wherever the plan puts each video's decoder (both lanes on
the CPU here); and the planner's decode placement and split from synthetic costs (pure)."""

import pytest
import torch

from opensora.inference.pipeline_parallel.decoders import ChunkDecoders, measure_chunk_decode
from opensora.inference.pipeline_parallel.runtime import HOST_COPY_MODES, Lanes, run_plan
from opensora.inference.pipeline_parallel.schedule import (
    DECODE_STREAM_MODES,
    OVERLAP_MODES,
    Plan,
    build_graph,
    natural_order,
    schedule,
)
from opensora.inference.pipeline_parallel.split import choose_split, choose_split_and_decode, decode_placements
from opensora.inference.pipeline_parallel.stages import place_model
from opensora.inference.sampler import VideoSampler
from opensora.models.vae.exact_chunk_decode import ExactChunkDecode
from opensora.models.vae.hunyuan_vae import HunyuanVideoVAE

# a tiny HunyuanVideo-style causal VAE (4x time, 8x space) whose latent channels the tiny causal MMDiT takes
TINY_VAE = dict(block_out_channels=(8, 8, 16, 16), layers_per_block=1, norm_num_groups=4, latent_channels=48)


def causal_vae_sampler():
    from test_streaming import tiny_sampler  # tests/ is on sys.path under pytest's default import mode

    cpu = tiny_sampler(depth_double=2, depth_single=2, attn_backend="auto")
    vae = HunyuanVideoVAE(config=TINY_VAE, seed=0).eval()
    return VideoSampler(cpu.model, vae, cpu.text_encoder, progress=False)


def one_device_streams(sampler, prompt_groups, step_list, num_frames, size, **gen_kw):
    from opensora.inference.streaming.generator import StreamingGenerator

    gen = StreamingGenerator(sampler, step_list=step_list, **gen_kw)
    refs, groups, seed = [], [], 0
    for prompts in prompt_groups:
        seeds = list(range(seed, seed + len(prompts)))
        seed += len(prompts)
        refs.append(list(gen.stream(prompts, seeds, num_frames, size, size)))
        text, _ = sampler.encode_text(prompts)
        groups.append(dict(seeds=seeds, branches=[text]))
    return gen, refs, groups


@pytest.mark.parametrize("decode_stream", DECODE_STREAM_MODES)
@pytest.mark.parametrize("mode", OVERLAP_MODES)
@pytest.mark.parametrize(
    "prompt_groups,decode_lanes",
    [
        ([["a red circle moving left"]], None),  # the default: the last lane decodes
        ([["a red circle moving left"]], (0,)),
        ([["a red circle moving left"], ["a blue square moving up", "a green star"]], (0, 1)),
    ],
    ids=["g1-lane1", "g1-lane0", "g2-alternating"],
)
def test_pipeline_with_the_exact_chunk_decode_is_bit_identical_to_the_streaming_generator(
    prompt_groups, decode_lanes, mode, decode_stream, one_thread
):
    """Exact-once decode (running statistics, conv caches): each video's decoder is fed its chunks in order on the
    lane the plan gives it, on its decode stream or its compute stream, with either host-copy stream (``Lanes``), so
    the frames equal the one-device generator's bit for bit (the overlap rule would differ from it); several videos
    in flight each keep their own decoder state."""
    sampler = causal_vae_sampler()
    num_frames, size = 17, 32  # 5 latent frames: chunks of 2, 2, 1 -> 5, 8, 4 pixel frames
    gen, refs, groups = one_device_streams(sampler, prompt_groups, [1.0, 0.5], num_frames, size)
    assert isinstance(gen.exact_decode, ExactChunkDecode) and gen.decode_rule == "running"
    from opensora.inference.pipeline_parallel.streaming_stages import CausalStreamingStages

    latent_size = (sampler.vae.latent_channels, *sampler.latent_size(num_frames, size, size))
    place_model(sampler.model, 1, ["cpu", "cpu"])
    decoders = ChunkDecoders.like(gen)
    for host_copies in HOST_COPY_MODES:  # the decoders (and their state tensors) are reused by a second run
        lanes = Lanes(["cpu", "cpu"], host_copies=host_copies)
        stages = CausalStreamingStages(
            sampler.model,
            lanes,
            1,
            groups,
            latent_size,
            gen.schedule(latent_size[1:]),
            make_decoder=decoders,
            decode_lanes=decode_lanes,
            decode_stream=decode_stream,
        )
        result, _ = run_plan(stages, mode, lanes, threads=True)
        assert stages.plan.decode_stream == decode_stream
        for g, chunks in enumerate(refs):
            assert stages.plan.decode_lane(g) == (decode_lanes[g] if decode_lanes else 1)
            for chunk in chunks:
                assert torch.equal(result.latents[(g, chunk.index)], chunk.latents), (g, chunk.index)
                assert torch.equal(result.frames[(g, chunk.index)], chunk.frames), (g, chunk.index)
    assert [f.shape[1] for c, f in sorted(result.frames.items()) if c[0] == 0] == [5, 8, 4]
    assert len(decoders.exact) == len(groups)  # one exact decoder per video


def test_pipeline_decoders_follow_the_generator_rule():
    """``decode_rule="overlap"`` on one device: the pipeline's decoders re-decode the overlap too (same frames)."""
    sampler = causal_vae_sampler()
    gen, refs, groups = one_device_streams(
        sampler, [["a red circle moving left"]], [1.0], 17, 32, decode_rule="overlap"
    )
    decoders = ChunkDecoders.like(gen)
    decoder = decoders(torch.device("cpu"), 0)
    assert decoder.exact is None and decoder.overlap == 2
    for chunk in refs[0]:
        assert torch.equal(decoder(chunk.latents), chunk.frames)


def test_measure_chunk_decode_averages_a_video_of_chunks_after_a_warm_up():
    calls = []

    class Decoder:
        def __init__(self):
            self.n = 0

        def __call__(self, x):
            calls.append(self.n)
            self.n += 1
            return x

    chunks = [torch.zeros(1, 4, 2, 2, 2)] * 3
    out = measure_chunk_decode(lambda device, group: Decoder(), "cpu", chunks, repeats=2)
    assert calls == [0, 1, 2] * 3  # every video starts with a fresh decoder (the first chunk of a clip)
    assert len(out["per_chunk_ms"]) == 3 and out["mean_ms"] >= 0


# ---- the plan (pure) ---------------------------------------------------------------------------------------------
def test_decode_lanes_put_each_groups_decode_on_its_gpu():
    plan = Plan(num_groups=2, num_chunks=3, num_steps=2, refill=True, decode_lanes=(0, 1))
    decodes = [t for t in natural_order(plan) if t.kind == "decode"]
    assert [(t.group, t.device) for t in decodes] == [(0, 0)] * 3 + [(1, 1)] * 3
    deps = build_graph(plan)
    assert all(d.device == t.device for t in decodes for d in deps[t] if d.kind == "decode")
    for mode in OVERLAP_MODES:
        schedule(plan, mode)  # a valid order with decodes on both GPUs
    with pytest.raises(ValueError, match="decode_lanes"):
        Plan(num_groups=2, decode_lanes=(1,))
    assert Plan(num_groups=3).decode_lane(2) == 1
    assert decode_placements(1) == [(1,), (0,)] and (0, 1) in decode_placements(2)


BLOCKS = [1.0] * 24  # ms per block and pass: 24 blocks, one chunk's 5 passes ~ 125 ms of blocks


def test_a_dear_decode_of_one_video_moves_blocks_to_gpu0_and_stays_on_the_last_gpu():
    """The real VAE: a chunk decode costs about a chunk's DiT passes. Counted on the GPU that decodes it, it moves
    blocks to GPU0 (GPU0 runs most blocks, the last GPU the rest + the decode), faster than the split chosen as if
    the decode were free."""
    plan = Plan(num_groups=1, num_chunks=6, num_steps=4, refill=True)
    free_split, _ = choose_split(plan, "basic", BLOCKS, 0.5, 0.5)
    split, lanes, rows = choose_split_and_decode(plan, "basic", BLOCKS, 0.5, 0.5, decode_ms=100.0)
    assert 10 <= free_split <= 12 and lanes == (1,)
    assert split > free_split + 6, (free_split, split)
    time_of = {(r["split"], tuple(r["decode_lanes"])): r["simulated_ms"] for r in rows}
    assert time_of[(split, lanes)] < 0.95 * time_of[(free_split, (1,))]


@pytest.mark.parametrize("decode_stream,gain", [("compute", 0.8), ("side", 0.95)])
@pytest.mark.parametrize("decode_ms", [60.0, 100.0, 300.0])
def test_a_dear_decode_of_two_videos_puts_one_decoder_on_each_gpu(decode_ms, decode_stream, gain):
    """Two videos in flight: one decoder per GPU keeps both busy (a decode on a GPU's compute stream holds back that
    GPU's passes behind it, so piling both videos' decodes onto one GPU stalls the other's passes; on a decode stream
    it slows them while they overlap, which costs less); one video's decode cannot be split (its decoder carries
    state), and the placement never changes a frame."""
    plan = Plan(num_groups=2, num_chunks=6, num_steps=4, refill=True, decode_stream=decode_stream)
    split, lanes, rows = choose_split_and_decode(plan, "basic", BLOCKS, 0.5, 0.5, decode_ms=decode_ms)
    assert lanes in {(0, 1), (1, 0)}, (split, lanes)
    best = next(r for r in rows if r["split"] == split and tuple(r["decode_lanes"]) == lanes)
    assert min(best["simulated_busy"]) > 0.95, best
    last_gpu = min(r["simulated_ms"] for r in rows if tuple(r["decode_lanes"]) == (1, 1))
    assert best["simulated_ms"] < gain * last_gpu


def test_a_free_decode_keeps_the_default_placement():
    plan = Plan(num_groups=2, num_chunks=4, num_steps=2, refill=True)
    _, lanes, _ = choose_split_and_decode(plan, "aggressive", BLOCKS, 0.5, 0.5, decode_ms=0.0)
    assert lanes == (1, 1)
