"""Streaming sampler: its chunks are what the full causal forward predicts from the earlier clean chunks, it is
deterministic per seed, its cache stays bounded on a 4x-long video, and chunk-wise decoding is exact for a
frame-independent autoencoder and keeps the frame count right for a causal temporal one."""

import gc

import pytest
import torch

from opensora.inference.sampler import VideoSampler
from opensora.inference.streaming.generator import ChunkDecoder, StreamingGenerator
from opensora.registry import MODELS, build_module

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py

TINY = dict(
    type="MMDiT",
    in_channels=48,
    cond_channels=49,
    patch_size=(1, 2, 2),
    hidden_size=32,
    num_heads=2,
    depth_double=1,
    depth_single=1,
    mlp_ratio=2.0,
    text_dim=64,
    pooled_dim=64,
    axes_dims=(4, 6, 6),
    attn_backend="math",
    causal_chunk_frames=2,
)
PROMPTS = ["a red circle moving left", "a blue square moving up"]


def tiny_sampler(seed=0, **overrides) -> VideoSampler:
    torch.manual_seed(seed)
    model = build_module(dict(TINY, **overrides), MODELS).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    vae = build_module(dict(type="PatchVAE", patch_size=4, temporal_patch_size=1), MODELS).eval()
    text = build_module(dict(type="TextConditioner", seed=0), MODELS)
    return VideoSampler(model, vae, text, progress=False)


def unpadded(sampler: VideoSampler) -> VideoSampler:
    """``sampler`` whose text encoder marks every text token valid (the tiny tokenizer pads to its length): the case
    where the text-cached streamed passes attend without a mask."""
    encode = sampler.encode_text
    sampler.encode_text = lambda prompts: tuple(
        dict(d, text_mask=torch.ones_like(d["text_mask"])) for d in encode(prompts)
    )
    return sampler


def test_each_chunk_is_the_full_causal_prediction_given_the_clean_earlier_chunks():
    """One step from t=1 with the cache refilled at t=0: chunk c = noise_c - v, where v is the velocity the full
    causal forward (per-chunk timesteps: 0 for the finished chunks, 1 for chunk c) gives chunk c."""
    sampler = tiny_sampler()
    gen = StreamingGenerator(sampler, step_list=[1.0])
    chunks = list(gen.stream(PROMPTS, [3, 4], num_frames=6, height=16, width=16, decode=False))
    latents = torch.cat([c.latents for c in chunks], dim=2)
    generators = [torch.Generator().manual_seed(s) for s in (3, 4)]
    text, _ = sampler.encode_text(PROMPTS)
    cond = torch.zeros(2, 49, 6, 4, 4)
    with torch.no_grad():
        for c in range(3):
            noise = torch.stack([torch.randn((48, 2, 4, 4), generator=g) for g in generators])
            x = torch.cat((latents[:, :, : 2 * c], noise, torch.zeros(2, 48, 4 - 2 * c, 4, 4)), dim=2)
            times = torch.tensor([[0.0] * c + [1.0] + [1.0] * (2 - c)] * 2)
            v = sampler.model(x, timestep=times, **text, cond=cond)
            expected = noise - v[:, :, 2 * c : 2 * c + 2]
            assert (latents[:, :, 2 * c : 2 * c + 2] - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.parametrize("rollout,guidance", [("renoise", 1.0), ("euler", 3.0)])
def test_streaming_is_deterministic_and_decodes_every_frame(rollout, guidance):
    sampler = tiny_sampler()
    gen = StreamingGenerator(sampler, step_list=[1.0, 0.5], rollout=rollout, guidance_scale=guidance)
    first = gen.generate(PROMPTS, [0, 1], num_frames=6, height=16, width=16)
    second = gen.generate(PROMPTS, [0, 1], num_frames=6, height=16, width=16)
    assert first.shape == (2, 6, 16, 16, 3) and first.dtype == torch.uint8
    assert torch.equal(first, second)
    alone = gen.generate(PROMPTS[1:], [1], num_frames=6, height=16, width=16)
    # the batch does not choose a sample's noise; tiny-row GEMMs may round differently, so compare pixel values
    assert (alone[0].int() - first[1].int()).abs().max() <= 1


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("rollout,guidance,window", [("renoise", 1.0, None), ("euler", 3.0, 4), ("renoise", 2.0, 2)])
def test_text_cache_leaves_the_streamed_video_bit_identical(rollout, guidance, window, padded):
    """The generator with its text cache (default) equals the one recomputing the text every pass, latents and
    frames, chunk by chunk: batch 2, CFG (null text rows), the refill pass, a rolling window. The text cache holds one
    entry per distinct time (the steps and the context time 0), filled by the first chunk and its refill."""
    sampler = tiny_sampler() if padded else unpadded(tiny_sampler())  # unpadded: the cached passes are mask-free
    kwargs = dict(step_list=[1.0, 0.5], rollout=rollout, guidance_scale=guidance, window_frames=window)
    plain = list(StreamingGenerator(sampler, text_cache=False, **kwargs).stream(PROMPTS, [0, 1], 8, 16, 16))
    cached = list(StreamingGenerator(sampler, **kwargs).stream(PROMPTS, [0, 1], 8, 16, 16))
    assert len(plain) == len(cached) == 4
    for a, b in zip(plain, cached):
        assert torch.equal(a.latents, b.latents) and torch.equal(a.frames, b.frames)
        assert (a.cached_frames, a.cache_bytes) == (b.cached_frames, b.cache_bytes)
    rows = 2 * (2 if guidance != 1.0 else 1)
    text_tokens = sampler.encode_text(PROMPTS)[0]["text_emb"].shape[1]
    per_time = 2 * 2 * rows * text_tokens * TINY["hidden_size"] * 4  # 2 blocks, keys and values, fp32
    # the first chunk is handed out before its refill (time 0) ran: 2 entries then, 3 from the second chunk on
    assert plain[-1].text_cache_bytes == 0 and cached[0].text_cache_bytes == 2 * per_time
    assert {c.text_cache_bytes for c in cached[1:]} == {3 * per_time}


def test_long_video_keeps_the_cache_bounded():
    sampler = tiny_sampler()
    gen = StreamingGenerator(sampler, step_list=[1.0], window_frames=6, sink_frames=2)
    chunks = list(gen.stream(PROMPTS[:1], [0], num_frames=32, height=16, width=16))  # 4x an 8-frame clip
    assert len(chunks) == 16 and sum(c.frames.shape[1] for c in chunks) == 32
    assert max(c.cached_frames for c in chunks) == 6
    steady = {c.cache_bytes for c in chunks if c.cached_frames == 6}
    assert len(steady) == 1  # flat once the window is full


def test_chunk_decoder_is_exact_without_temporal_compression():
    sampler = tiny_sampler()
    latents = torch.randn(1, 48, 6, 4, 4)
    decoder = ChunkDecoder(sampler.decode, sampler.vae)
    pieces = [decoder(latents[:, :, s : s + 2]) for s in (0, 2, 4)]
    assert torch.equal(torch.cat(pieces, dim=1), sampler.decode(latents))


def test_chunk_decoder_keeps_frame_counts_of_a_causal_temporal_autoencoder():
    from test_vae import TINY_HUNYUAN

    from opensora.models.vae import HunyuanVideoVAE

    vae = HunyuanVideoVAE(config=TINY_HUNYUAN, seed=0).eval()
    decode = lambda z: vae.decode(z).permute(0, 2, 1, 3, 4)  # noqa: E731  [B, T, C, H, W]: frames on dim 1
    latents = torch.randn(1, vae.latent_channels, 5, 2, 2)
    decoder = ChunkDecoder(decode, vae, overlap=2)
    pieces = [decoder(latents[:, :, s : s + 2]) for s in (0, 2)] + [decoder(latents[:, :, 4:5])]
    assert [p.shape[1] for p in pieces] == [5, 8, 4]  # 1 + 4k pixel frames in all: 17 for 5 latent frames
    assert sum(p.shape[1] for p in pieces) == decode(latents).shape[1]


def test_bidirectional_model_is_refused():
    with pytest.raises(ValueError, match="causal"):
        StreamingGenerator(tiny_sampler(causal_chunk_frames=0))


def random_causal_checkpoint(tmp_path, depth: int = 1):
    """(inference config, checkpoint) of a small random causal MMDiT (chunks of 4 latent frames) on the demo's
    inference config, for CLI tests."""
    from pathlib import Path

    from safetensors.torch import save_file

    from opensora.config import load_config
    from opensora.inference.sampler import role_model_config

    root = Path(__file__).resolve().parents[1]
    config = tmp_path / "causal_demo.py"
    config.write_text(
        f"_base_ = [{str(root / 'configs/diffusion/inference/demo.py')!r}]\n"
        f"model = dict(hidden_size=32, num_heads=2, depth_double={depth}, depth_single={depth}, axes_dims=(4, 6, 6),"
        " causal_chunk_frames=4)\n"
    )
    model = build_module(role_model_config(load_config(str(config))), MODELS)
    torch.manual_seed(0)
    weights = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
    save_file(weights, tmp_path / "causal.safetensors")
    return config, tmp_path / "causal.safetensors"


def test_cli_streaming_appends_each_chunk_to_the_mp4_before_the_next_is_made(tmp_path):
    """A 4x-long video (64 frames, the demo trains on 16) from a random causal checkpoint: after every chunk, the
    mp4 already decodes what was generated so far but the newest frame (see streaming/writer.py)."""
    from opensora.datasets.video_io import read_video
    from opensora.inference import cli

    config, ckpt = random_causal_checkpoint(tmp_path)
    seen = []

    def on_chunk(chunk, paths):
        frames_so_far = 4 * (chunk.index + 1)
        readable = read_video(paths[0]).shape[0]
        assert readable == frames_so_far - 1
        seen.append((chunk.index, readable, chunk.cached_frames))

    written = cli.main(
        [
            str(config),
            "--ckpt",
            str(ckpt),
            "--prompt",
            "a red circle moving left",
            "--streaming",
            "--num-frames",
            "64",
            "--resolution",
            "32x32",
            "--step-list",
            "1.0",
            "--guidance-scale",
            "2.0",
            "--window-frames",
            "12",
            "--sink-frames",
            "4",
            "--device",
            "cpu",
            "--save-dir",
            str(tmp_path / "out"),
            "--progress",
            "false",
        ],
        on_chunk=on_chunk,
    )
    assert len(seen) == 16 and seen[0][1] >= 3  # the first frames were on disk 15 chunks before the end
    assert max(cached for _, _, cached in seen) == 12
    assert read_video(written[0]).shape == (64, 32, 32, 3)
    assert (tmp_path / "out" / "samples.csv").is_file()


def test_streaming_benchmark_runs_its_three_modes_at_smoke_size(tmp_path):
    """benchmarks/streaming.py end to end on the CPU with tiny random checkpoints (the GPU numbers come from the same
    code): every mode writes its JSON with the fields the README table needs."""
    import json
    import sys
    from pathlib import Path

    from safetensors.torch import save_file

    from opensora.config import load_config
    from opensora.inference.sampler import role_model_config

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "benchmarks"))
    import streaming as bench

    tiny = "hidden_size=32, num_heads=2, depth_double=1, depth_single=1, axes_dims=(4, 6, 6)"
    base = (
        f"_base_ = [{str(root / 'configs/diffusion/train/demo.py')!r}]\n"
        "bucket_config = {'_delete_': True, '32x32': {8: (1.0, 2)}}\n"
    )
    (tmp_path / "teacher.py").write_text(base + f"model = dict({tiny})\n")
    (tmp_path / "student.py").write_text(
        base + f"model = dict({tiny}, causal_chunk_frames=2)\nrole = 'model'\n"
        "step_list = [1.0, 0.5]\nguidance_scale = 1.0\nstreaming = True\n"
        "rollout = 'euler'\n"
    )
    for name in ("teacher", "student"):
        model = build_module(role_model_config(load_config(str(tmp_path / f"{name}.py"))), MODELS)
        save_file(
            {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}, tmp_path / f"{name}.safetensors"
        )
    common = ["--device", "cpu", "--out", str(tmp_path / "out")]
    bench.main(
        [
            "quality",
            "--student-config",
            str(tmp_path / "student.py"),
            "--student-ckpt",
            str(tmp_path / "student.safetensors"),
            "--teacher-config",
            str(tmp_path / "teacher.py"),
            "--teacher-ckpt",
            str(tmp_path / "teacher.safetensors"),
            "--teacher-steps",
            "2",
            "--num-prompts",
            "2",
            "--repeats",
            "1",
            "--long-multiple",
            "2",
            *common,
        ]
    )
    quality = json.loads((tmp_path / "out" / "quality.json").read_text())
    assert quality["student"]["chunks"] == 4 and quality["long"]["frames"] == 16
    assert quality["student"]["rollout"] == "euler"  # read from the student config, like inference.py
    assert len(quality["long"]["windows"]) == 3 and quality["long"]["flicker"]["edge_over_inside"] > 0
    bench.main(
        [
            "speed",
            "--config",
            str(tmp_path / "student.py"),
            "--chunk-frames",
            "2",
            "--lengths",
            "1",
            "2",
            "--teacher-steps",
            "1",
            "--step-list",
            "1.0",
            "--cuda-graphs",
            "on",
            "--text-cache",
            "both",
            "--paired",
            "2",
            *common,
        ]
    )
    speed = json.loads((tmp_path / "out" / "speed.json").read_text())
    runs = speed["lengths"]
    # 4 chunks: 4 passes + 3 refills; merged: the 3 refills ride on the next chunks' first passes
    assert runs["1x-window"]["model_passes"] == 7 and runs["1x-window-merged"]["model_passes"] == 4
    assert speed["flops_1x"]["students"]["window"]["ceiling"] > 1
    assert speed["lengths"]["2x-window"]["max_cached_frames"] == speed["window_frames"] == 6
    names = ("window", "window-recompute-text", "window-graphs", "window-graphs-merged", "window-graphs-overlap")
    for name in (*names, "window-graphs-merged-overlap"):  # eager on a CPU
        assert speed["lengths"][f"1x-{name}"]["chunks"] == 4
    assert (
        speed["lengths"]["1x-window"]["text_cache_mib"]
        > 0
        == speed["lengths"]["1x-window-recompute-text"]["text_cache_mib"]
    )
    assert speed["lengths"]["1x-window-graphs"]["cuda_graphs"]["eager"] > 0
    assert {
        "speedup_end_to_end_1x",
        "speedup_end_to_end_1x_recompute_text",
        "speedup_end_to_end_1x_graphs",
        "speedup_end_to_end_1x_graphs_overlap",
        "speedup_vs_graphed_teacher_1x",
    } <= set(speed)
    # both teacher modes timed (on a CPU the "graphs" teacher runs eager), and the paired rounds compare each
    assert speed["teacher_eager"]["seconds"] > 0 and speed["teacher_graphs"]["graphs"] is None
    assert len(speed["paired"]["rounds"]) == 2 and speed["paired"]["ratio_vs_graphs"]["median"] > 0
    bench.main(
        [
            "costs",
            "--config",
            str(tmp_path / "teacher.py"),
            "--num-prompts",
            "2",
            "--teacher-steps",
            "2",
            "--step-list",
            "1.0",
            "--repeats",
            "1",
            *common,
        ]
    )
    costs = json.loads((tmp_path / "out" / "costs.json").read_text())
    assert costs["runs"]["teacher"]["model_passes"] == 2 and costs["runs"]["few-step"]["model_passes"] == 1


class EagerReplayGraphs:
    """``ChunkGraphs`` with the capture replaced by re-running the captured body: the static-buffer plumbing (input
    copies, cached video and text keys/values, outputs cloned into the caches) runs on a CPU."""

    @staticmethod
    def make(model):
        from opensora.inference.streaming.chunk_graphs import ChunkGraphs

        class Graphs(ChunkGraphs):
            @staticmethod
            def usable(x):
                return True

            def _record(self, graph, body):
                body()  # the "capture"
                graph.replay = body

        return Graphs(model)

    @staticmethod
    def make_merged(model, memory=None):
        """``MergedGraphs`` with the same eager "capture" (``memory``: share the chunk graphs' ``GraphMemory``)."""
        from opensora.models.mmdit.causal_refill import MergedGraphs

        class Merged(MergedGraphs):
            @staticmethod
            def usable(x):
                return True

            def _record(self, body):
                body()  # the "capture"
                return body

        return Merged(model, memory)


def assert_streams_bitwise_equal(reference, other, num_frames: int) -> None:
    """Two videos of ``num_frames`` (the second with the prompts reversed: new text keys/values) stream from both
    generators with bit-identical latents and frames."""
    for prompts in (PROMPTS, PROMPTS[::-1]):
        a = list(reference.stream(prompts, [0, 1], num_frames, 16, 16))
        b = list(other.stream(prompts, [0, 1], num_frames, 16, 16))
        for x, y in zip(a, b):
            assert torch.equal(x.latents, y.latents) and torch.equal(x.frames, y.frames)


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("guidance,window", [(1.0, 4), (3.0, 2)])
def test_chunk_graph_plumbing_replays_the_eager_passes_bitwise_on_a_cpu(guidance, window, padded):
    """The CUDA-graph runner's buffers, with an eager 'replay': bit-identical to the plain generator over two videos
    (graphs kept from the first; the second video's prompts differ, so text keys/values are refilled). Unpadded
    text: the text-cached graphs attend without a mask (no mask among their static inputs)."""
    sampler = tiny_sampler() if padded else unpadded(tiny_sampler())
    kwargs = dict(step_list=[1.0, 0.5], guidance_scale=guidance, window_frames=window)
    graphed = StreamingGenerator(sampler, **kwargs)
    graphed.cuda_graphs = EagerReplayGraphs.make(sampler.model)
    plain = StreamingGenerator(sampler, text_cache=False, **kwargs)
    assert_streams_bitwise_equal(plain, graphed, 10)
    graphs = graphed.cuda_graphs.summary
    # 5 chunks x 3 passes per video, less the last chunk's refill (no chunk reads it). Graphs: the first chunk (no
    # cached frames) fills the text cache, one graph for its 2 steps and one for its refill (storing passes have
    # graphs of their own); then 3 times (text-cache hits) per cached-frame count: 2 and 4 (window 4) or 2 (window
    # 2); the second video reuses them all
    assert graphs["failures"] == [] and graphs["eager"] == 0 and graphs["replays"] == 2 * (5 * 3 - 1)
    assert graphs["graphs"] == 2 + 3 * (2 if window == 4 else 1)
    # the shapes (static input sets): the first chunk's (text rows run, masked), then one per cached-frame count
    with_mask = [dict(shape[-1])["mask"] is not None for shape in graphed.cuda_graphs.statics]
    assert with_mask == [True] + [padded] * (2 if window == 4 else 1)


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage alive in the process (each storage once, views included)."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):  # not isinstance: it warns on deprecated objects it looks into
            try:
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError):  # fake / functional tensors other tests left behind
                continue
    return sum(storages.values())


@pytest.mark.parametrize("merge_refill", [False, True])
def test_graphed_streaming_holds_as_much_after_every_chunk_of_a_long_video(merge_refill):
    """What the graphed path keeps between chunks (statics, shared buffers, cached video, text, graphs, per-chunk
    RoPE tables and masks, caches) must stop growing once the rolling window is full: the CPU twin of
    tests/test_streaming_gpu.py's peak-memory test, with the capture swapped for an eager re-run. The chunk graphs
    kept the RoPE tables and mask of the last 8 chunks (one start frame each), so the memory held grew by one
    chunk's mask per chunk until the 8th, and a 24-chunk video held more at its peak than a 12-chunk one."""
    sampler = tiny_sampler()
    gen = StreamingGenerator(sampler, step_list=[1.0, 0.5], window_frames=4, merge_refill=merge_refill)
    gen.cuda_graphs = EagerReplayGraphs.make(sampler.model)
    if merge_refill:
        gen.merged_graphs = EagerReplayGraphs.make_merged(sampler.model, gen.cuda_graphs.memory)

    # the chunks after which the live bytes are counted (a walk over every object: too slow after each of 96
    # chunks): from the third on, where the window is full, around the 8th, where the old growth stopped, and later
    probes = {0, 1, 2, 3, 4, 6, 7, 8, 9, 11, 15, 23, 31, 47}

    def held_per_chunk(frames, measure=True):
        held = []
        for index, chunk in enumerate(gen.stream(PROMPTS, [0, 1], frames, 16, 16)):
            del chunk
            if measure and index in probes:
                held.append((index, live_tensor_bytes()))
        counts = (gen.cuda_graphs.summary["graphs"], len(gen.cuda_graphs.statics), len(gen.cuda_graphs.memory.pasts))
        merged = None if gen.merged_graphs is None else gen.merged_graphs.summary["graphs"]
        return held, counts + (len(gen.cuda_graphs.text_statics), gen.cuda_graphs.memory.nbytes, merged)

    held_per_chunk(24, measure=False)  # warm-up: every state (the refill at a full window) gets its graph
    held_24, book_24 = held_per_chunk(24)
    held_48, book_48 = held_per_chunk(48)
    assert book_48 == book_24  # no graph, static, buffer or text static more
    assert max(i for i, _ in held_48) > max(i for i, _ in held_24) > 8  # both runs probed past the 8th chunk
    # from the third chunk on (window full: 4 cached frames) every chunk leaves the same bytes behind
    after_24, after_48 = {b for i, b in held_24 if i >= 2}, {b for i, b in held_48 if i >= 2}
    assert len(after_24) == 1 and after_48 == after_24, (held_24, held_48)
    assert max(b for _, b in held_48) == max(b for _, b in held_24)


def test_chunk_graphs_fall_back_to_eager_off_the_gpu():
    sampler = tiny_sampler()
    plain = StreamingGenerator(sampler, step_list=[1.0, 0.5]).generate(PROMPTS, [0, 1], 6, 16, 16)
    gen = StreamingGenerator(sampler, step_list=[1.0, 0.5], cuda_graphs=True)
    assert torch.equal(gen.generate(PROMPTS, [0, 1], 6, 16, 16), plain)
    assert gen.cuda_graphs.summary["graphs"] == 0 and gen.cuda_graphs.summary["eager"] == 3 * 3 - 1  # no last refill


@pytest.mark.parametrize("merge_refill", [False, True])
def test_decode_ahead_hands_out_the_serial_frames_after_enqueueing_the_next_chunk(merge_refill):
    """``overlap_decode``: the same chunks (latents, frames, cache records) as the serial order, bitwise; chunk k is
    handed out only once chunk k + 1's passes were issued (off the GPU the decode itself runs at once)."""
    sampler = tiny_sampler()
    kwargs = dict(step_list=[1.0, 0.5], guidance_scale=3.0, window_frames=4, merge_refill=merge_refill)
    runs = {}
    for overlap in (False, True):
        gen = StreamingGenerator(sampler, overlap_decode=overlap, **kwargs)
        chunks, passes = [], []
        for chunk in gen.stream(PROMPTS, [0, 1], 10, 16, 16):
            chunks.append(chunk)
            passes.append(gen.passes)
        runs[overlap] = chunks, passes
    (serial, serial_passes), (ahead, ahead_passes) = runs[False], runs[True]
    assert len(serial) == len(ahead) == 5
    for x, y in zip(serial, ahead):
        assert torch.equal(x.latents, y.latents) and torch.equal(x.frames, y.frames)
        assert (x.index, x.start_frame, x.cached_frames, x.cache_bytes) == (
            y.index,
            y.start_frame,
            y.cached_frames,
            y.cache_bytes,
        )
    assert ahead_passes[:-1] == serial_passes[1:] and ahead_passes[-1] == serial_passes[-1]


def test_cli_refuses_an_unknown_stream_graphs_choice(tmp_path):
    from opensora.cli_errors import UserInputError
    from opensora.inference import cli

    config, ckpt = random_causal_checkpoint(tmp_path)
    with pytest.raises(UserInputError, match="--stream-graphs"):
        cli.main([str(config), "--ckpt", str(ckpt), "--streaming", "--stream-graphs", "maybe", "--device", "cpu"])
