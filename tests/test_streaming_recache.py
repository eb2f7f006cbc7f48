"""Streaming re-cache and prompt schedules: ``--kv-recache off`` is the plain loop bit for bit; a re-cache leaves the
KV cache a block-causal forward over the kept frames alone computes (a reference built from the model's pieces, not
from ``forward_chunk``); a prompt switch leaves the frames before it as a single-prompt run made them and the text
cache as a run with the new prompt from the start makes it; bad schedules are one line and exit code 2."""

import json

import pytest
import torch
from streaming_reference import stream_reference
from test_streaming import PROMPTS, EagerReplayGraphs, random_causal_checkpoint, tiny_sampler, unpadded

from opensora.cli_errors import UserInputError, run_cli
from opensora.inference.streaming.generator import StreamingGenerator
from opensora.inference.streaming.prompt_schedule import parse_prompt_schedule, switch_chunks
from opensora.inference.streaming.recache import pieces_of, plan_recache
from opensora.models.mmdit.causal import joint_attention_mask
from opensora.models.mmdit.rope import rope_cos_sin, video_position_ids

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py

SWITCHED = ["a green triangle moving right", "a yellow circle moving down"]


def recording(sampler):
    """``sampler`` whose model records every KV cache and text cache it makes (the generator's are local)."""
    model, made = sampler.model, dict(kv=[], text=[])
    new_kv, new_text = model.new_kv_cache, model.new_text_cache
    model.new_kv_cache = lambda *a, **k: made["kv"].append(new_kv(*a, **k)) or made["kv"][-1]
    model.new_text_cache = lambda: made["text"].append(new_text()) or made["text"][-1]
    return made


@torch.no_grad()
def block_causal_kv(model, latents, frame_ids, chunk_frames, text, time=0.0, positions=None, text_time=0):
    """Every block's video keys/values of ONE full forward over ``latents`` [B, C, F, h, w] (frames ``frame_ids``,
    absolute: their RoPE time ids, or ``positions`` when given; the text at ``text_time``), each piece (consecutive
    frames of one chunk) attending to the pieces before it and to itself: what a re-cache must leave in the cache.
    Under ``rope_anchor="window"`` that is the video starting at the anchor: text and sinks there (``positions``)."""
    b = latents.shape[0]
    cond = torch.zeros(b, model.cond_channels, *latents.shape[2:])
    timestep = torch.full((b,), time)
    img, txt, vec, grid = model.embed(latents, timestep, text["text_emb"], text["pooled"], cond)
    ids = video_position_ids(*grid)
    ids[:, 0] = torch.tensor(frame_ids if positions is None else positions)[ids[:, 0]]  # time ids (temporal patch 1)
    text_ids = ids.new_zeros(txt.shape[1], 3)
    text_ids[:, 0] = text_time
    rope = rope_cos_sin(torch.cat((text_ids, ids)), model.axes_dims, model.theta)
    piece = torch.tensor([p for p, frames in enumerate(pieces_of(frame_ids, chunk_frames)) for _ in frames])
    per_frame = grid[1] * grid[2]
    piece = piece.repeat_interleave(per_frame)
    mask = joint_attention_mask(text["text_mask"], txt.shape[1], piece[:, None] >= piece[None, :])
    num_text, captured = txt.shape[1], []

    def capture(k, v, m):
        captured.append((k[:, :, num_text:], v[:, :, num_text:]))
        return k, v, m

    blocks = len(model.double_blocks) + len(model.single_blocks)
    model.run_blocks(img, txt, vec, rope, mask, [capture] * blocks)
    return captured


def assert_cache_is(cache, reference, tolerance=1e-5):
    for i, (k, v) in enumerate(reference):
        ck, cv = cache.block(i)
        for got, want in ((ck, k), (cv, v)):
            assert got.shape == want.shape
            assert (got - want).abs().max() <= tolerance * want.abs().max(), f"block {i}"


# ---- off: nothing changes ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("guidance,window,sinks", [(1.0, 4, 0), (2.0, 6, 2)])
def test_kv_recache_off_is_the_reference_loop_bit_for_bit(guidance, window, sinks):
    """The generator with ``kv_recache="off"`` (and no switch) against the tests' plain streaming loop
    (streaming_reference.py, written apart from the generator): latents bit-identical chunk by chunk, over a video
    long enough that the window rolls several times."""
    sampler = tiny_sampler()
    times = [1.0, 0.5, 0.0]
    kwargs = dict(step_list=times[:-1], guidance_scale=guidance, window_frames=window, sink_frames=sinks)
    chunks = list(StreamingGenerator(sampler, kv_recache="off", **kwargs).stream(PROMPTS, [0, 1], 16, 16, 16))
    text, null = sampler.encode_text(PROMPTS)
    group = dict(branches=[text, null] if guidance != 1.0 else [text], seeds=[0, 1])
    expected, _ = stream_reference(
        sampler.model,
        group,
        (48, 16, 4, 4),
        times,
        guidance_scale=guidance,
        window_frames=window,
        sink_frames=sinks,
    )
    assert len(chunks) == len(expected) == 8
    for chunk, want in zip(chunks, expected):
        assert torch.equal(chunk.latents, want) and chunk.recache is None


# ---- shift: the cache is the kept frames' own forward ---------------------------------------------------------------
def test_recache_plan_keeps_whole_sink_chunks_and_reruns_everything_after_the_first_dropped_frame():
    # window 6, sinks 2, chunks of 2: the refill of frames 6-7 drops 2-3; 0-1 (a whole chunk, older) stay
    plan = plan_recache([0, 1, 2, 3, 4, 5], [0, 1, 4, 5, 6, 7], 2, everything=False)
    assert (plan.keep_frames, plan.pieces, plan.dropped) == (2, [[4, 5], [6, 7]], [2, 3])
    # a sink frame whose chunk lost a frame saw it (inside its chunk): re-run it too
    plan = plan_recache([0, 1, 2, 3], [0, 3, 4, 5], 2, everything=False)
    assert (plan.keep_frames, plan.pieces) == (0, [[0], [3], [4, 5]])
    assert plan_recache([0, 1], [0, 1, 2, 3], 2, everything=False) is None  # nothing leaves: a plain refill
    assert plan_recache([0, 1], [0, 1, 2, 3], 2, everything=True).pieces == [[0, 1], [2, 3]]  # a prompt switch


def kept_forward(model, cache, kept, text):
    """``block_causal_kv`` of the frames ``cache`` holds, at the positions its anchor gives them."""
    return block_causal_kv(model, kept, cache.frame_ids, 2, text, positions=cache.positions, text_time=cache.anchor)


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize(
    "guidance,window,sinks,anchor",
    [(1.0, 6, 2, "absolute"), (2.0, 4, 0, "absolute"), (1.0, 5, 1, "absolute"), (1.0, 6, 2, "window"),
     (2.0, 4, 0, "window"), (1.0, 5, 1, "window")],
)  # fmt: skip
def test_shift_recache_leaves_the_block_causal_forward_of_the_kept_frames(guidance, window, sinks, anchor, padded):
    """After every re-cache the cache holds, block by block, what one full forward over the kept frames' clean
    latents (at their absolute positions, each chunk's frames attending to the kept frames before them) computes;
    the plain rolling cache does not (its frames saw the frames that left). Sinks of a whole chunk, none, and one sink
    frame that splits the first chunk. Under the window RoPE anchor the forward is the kept frames' video starting at
    the anchor (text and sinks there): the re-cache's pieces must see the anchor the cache ends with, not the one of
    the partly refilled cache."""
    sampler = tiny_sampler() if padded else unpadded(tiny_sampler())
    made = recording(sampler)
    kwargs = dict(
        step_list=[1.0, 0.5], guidance_scale=guidance, window_frames=window, sink_frames=sinks, rope_anchor=anchor
    )
    generator = StreamingGenerator(sampler, kv_recache="shift", **kwargs)
    text, null = sampler.encode_text(PROMPTS)
    rows = [text, null] if guidance != 1.0 else [text]
    text = {k: torch.cat([r[k] for r in rows]) for k in ("text_emb", "text_mask", "pooled")}
    latents, checked, moved = {}, 0, 0
    for chunk in generator.stream(PROMPTS, [0, 1], 16, 16, 16, decode=False):
        if chunk.recache is not None:
            assert chunk.recache["reason"] == "shift" and chunk.recache["seconds"] >= 0
            cache = made["kv"][-1]
            stored = list(range(chunk.start_frame))  # every finished frame; the window keeps the sinks and newest
            assert cache.frame_ids == stored[:sinks] + stored[len(stored) - window + sinks :]
            kept = torch.cat([latents[i] for i in cache.frame_ids], dim=2)
            kept = torch.cat([kept] * len(rows))
            assert_cache_is(cache, kept_forward(sampler.model, cache, kept, text))
            assert cache.placed_anchor == cache.anchor and cache.pinned_anchor is None
            moved += cache.anchor > 0
            checked += 1
        for offset in range(chunk.latents.shape[2]):
            latents[chunk.start_frame + offset] = chunk.latents[:, :, offset : offset + 1]
    assert checked >= 3 and (moved >= 3) == (anchor == "window")
    # the plain cache at the end differs from that forward in the blocks after the first
    plain = recording(sampler)
    list(StreamingGenerator(sampler, **kwargs).stream(PROMPTS, [0, 1], 16, 16, 16, decode=False))
    cache = plain["kv"][-1]
    kept = torch.cat([torch.cat([latents[i] for i in cache.frame_ids], dim=2)] * len(rows))
    reference = kept_forward(sampler.model, cache, kept, text)
    assert not torch.allclose(cache.block(1)[0], reference[1][0], atol=1e-4)
    if anchor == "window":  # the pin matters: the partly refilled cache's anchor (0) gives another forward
        absolute = block_causal_kv(sampler.model, kept, cache.frame_ids, 2, text)
        assert not torch.allclose(absolute[1][0], reference[1][0], atol=1e-4)


@pytest.mark.parametrize("anchor", ["absolute", "window"])
def test_graphed_recache_and_switch_replay_the_eager_passes_bitwise_on_a_cpu(anchor):
    """The chunk graphs (eager 'replay': their static buffers and caches on a CPU) run the re-cache and the prompt
    switch's passes, bit-identical to the eager generator (the pinned anchor reaches them through their inputs)."""
    sampler = tiny_sampler()
    kwargs = dict(step_list=[1.0, 0.5], guidance_scale=2.0, window_frames=6, sink_frames=2, kv_recache="shift")
    kwargs.update(rope_anchor=anchor)
    graphed = StreamingGenerator(sampler, **kwargs)
    graphed.cuda_graphs = EagerReplayGraphs.make(sampler.model)
    plain = StreamingGenerator(sampler, **kwargs)
    switches = [(8, SWITCHED)]
    a = list(plain.stream(PROMPTS, [0, 1], 16, 16, 16, switches=switches))
    b = list(graphed.stream(PROMPTS, [0, 1], 16, 16, 16, switches=switches))
    for x, y in zip(a, b):
        assert torch.equal(x.latents, y.latents) and torch.equal(x.frames, y.frames)
        assert (x.recache is None) == (y.recache is None) and x.prompts == y.prompts
    summary = graphed.cuda_graphs.summary
    assert summary["failures"] == [] and summary["eager"] == 0


# ---- prompt switch ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("anchor", ["absolute", "window"])
@pytest.mark.parametrize("kv_recache", ["off", "shift"])
@pytest.mark.parametrize("guidance", [1.0, 2.0])
def test_prompt_switch_keeps_the_frames_before_it_and_takes_the_new_prompts_text(guidance, kv_recache, anchor):
    """A switch at latent frame 8 (chunk 4 of 8): chunks 0-3 equal a single-prompt run's bit for bit; the text cache
    after the switch equals the one of a run with the new prompts from the start (the same keys/values per step time);
    the KV cache right after the switch is the new prompt's block-causal forward over the kept frames."""
    sampler = tiny_sampler()
    made = recording(sampler)
    kwargs = dict(step_list=[1.0, 0.5], guidance_scale=guidance, window_frames=6, sink_frames=2, kv_recache=kv_recache)
    kwargs.update(rope_anchor=anchor)
    single = list(StreamingGenerator(sampler, **kwargs).stream(PROMPTS, [0, 1], 16, 16, 16))
    generator = StreamingGenerator(sampler, **kwargs)
    latents, switched = {}, None
    for chunk in generator.stream(PROMPTS, [0, 1], 16, 16, 16, switches=[(8, SWITCHED)]):
        if chunk.index < 4:
            assert torch.equal(chunk.latents, single[chunk.index].latents)
            assert torch.equal(chunk.frames, single[chunk.index].frames) and chunk.prompts == PROMPTS
        else:  # the new text reaches the passes: each sample's chunks from the switch on differ from a single-prompt run
            assert chunk.prompts == SWITCHED
            assert not any(torch.allclose(a, b) for a, b in zip(chunk.latents, single[chunk.index].latents))
        if chunk.index == 4:
            assert chunk.recache["reason"] == "switch" and chunk.recache["frames"] == 6
            cache = made["kv"][-1]
            text, null = sampler.encode_text(SWITCHED)
            rows = [text, null] if guidance != 1.0 else [text]
            text = {k: torch.cat([r[k] for r in rows]) for k in ("text_emb", "text_mask", "pooled")}
            kept = torch.cat([torch.cat([latents[i] for i in cache.frame_ids], dim=2)] * len(rows))
            assert_cache_is(cache, kept_forward(sampler.model, cache, kept, text))
            assert cache.frame_ids == [0, 1, 4, 5, 6, 7]  # the sinks and the newest 4 frames before the switch
            assert cache.anchor == (2 if anchor == "window" else 0)
            switched = made["text"][-1]
        for offset in range(chunk.latents.shape[2]):
            latents[chunk.start_frame + offset] = chunk.latents[:, :, offset : offset + 1]
    assert switched is not None and switched is not made["text"][-2]  # a fresh text cache for the new prompts
    list(StreamingGenerator(sampler, **kwargs).stream(SWITCHED, [0, 1], 16, 16, 16))
    fresh = made["text"][-1]
    assert sorted(switched.entries) == sorted(fresh.entries)
    for key in fresh.entries:
        if anchor == "absolute":
            for (k1, v1), (k2, v2) in zip(switched.entries[key], fresh.entries[key]):
                assert torch.equal(k1, k2) and torch.equal(v1, v2)
        else:  # the switched run made its entries at a moved text time: the same keys once rotated to one time
            for (k1, v1), (k2, v2) in zip(switched.get(key, 0), fresh.get(key, 0)):
                torch.testing.assert_close(k1, k2, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-5)  # text attention under a shared shift


def test_switch_without_recache_keeps_the_old_prompts_cache():
    sampler = tiny_sampler()
    kwargs = dict(step_list=[1.0], window_frames=6, sink_frames=2)
    kept = StreamingGenerator(sampler, switch_recache=False, **kwargs)
    chunks = list(kept.stream(PROMPTS, [0, 1], 12, 16, 16, switches=[(8, SWITCHED)]))
    assert all(c.recache is None for c in chunks) and chunks[4].prompts == SWITCHED
    recached = list(StreamingGenerator(sampler, **kwargs).stream(PROMPTS, [0, 1], 12, 16, 16, switches=[(8, SWITCHED)]))
    assert torch.equal(chunks[3].latents, recached[3].latents)
    assert not torch.equal(chunks[4].latents, recached[4].latents)
    single = list(StreamingGenerator(sampler, **kwargs).stream(PROMPTS, [0, 1], 12, 16, 16))
    for c in (chunks, recached):  # the switch takes effect with the old keys/values kept too
        assert not any(torch.allclose(x, y) for a, b in zip(c[4:], single[4:]) for x, y in zip(a.latents, b.latents))


# ---- the schedule's text form and its checks ---------------------------------------------------------------------------
def test_prompt_schedule_parses_to_what_the_window_scoring_reads():
    from opensora.eval.moving_shapes_windows import caption_of_window

    schedule = parse_prompt_schedule("0:a red circle moving left; 64 : a blue square moving up: fast")
    assert schedule == [(0, "a red circle moving left"), (64, "a blue square moving up: fast")]
    assert caption_of_window(schedule, 64, 16) == "a blue square moving up: fast"
    assert caption_of_window(schedule, 56, 16) is None
    starts = {0: 0, 16: 4, 32: 8}
    assert switch_chunks([(0, "A"), (16, "B")], starts, 48) == [(4, "B")]
    with pytest.raises(UserInputError, match="can switch at frames 16, 32"):
        switch_chunks([(0, "A"), (20, "B")], starts, 48)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--prompt-schedule", "5:A;9:B"], "must start at frame 0"),
        (["--prompt-schedule", "0:A;x:B"], "whole number"),
        (["--prompt-schedule", "0:A;8:B;4:C"], "must rise"),
        (["--prompt-schedule", "0:A;no frame"], "FRAME:PROMPT"),
        (["--prompt-schedule", "0:A;6:B"], "can switch at frames 4, 8, 12"),
        (["--prompt-schedule", "0:A;40:B"], "past the video's 16 frames"),
        (["--prompt-schedule", "0:A;8:B", "--prompt", "C"], "drop --prompt"),
        (["--kv-recache", "always"], "--kv-recache 'always' is not one of off, shift"),
        (["--prompt-schedule", "0:A;8:B", "--switch-renoise", "1.5"], "--switch-renoise must lie in (--context-time"),
        (["--switch-renoise", "0.5"], "--switch-renoise re-renders at a prompt switch: add --prompt-schedule"),
    ],
)
def test_cli_refuses_a_bad_schedule_in_one_line_with_exit_code_2(tmp_path, capsys, flags, message):
    from opensora.inference import cli

    config, ckpt = random_causal_checkpoint(tmp_path)
    argv = [str(config), "--ckpt", str(ckpt), "--streaming", "--num-frames", "16", "--resolution", "32x32"]
    argv += ["--device", "cpu", "--save-dir", str(tmp_path / "out"), "--progress", "false", *flags]
    if "--prompt-schedule" not in flags:
        argv += ["--prompt", "a red circle moving left"]
    assert run_cli(cli.main, argv, prog="inference.py") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "out").exists()  # refused before the save-dir was made


def test_cli_streams_one_video_for_a_schedule_and_reports_each_recache(tmp_path):
    from opensora.datasets.video_io import read_video
    from opensora.inference import cli

    config, ckpt = random_causal_checkpoint(tmp_path)
    schedule = "0:a red circle moving left;8:a blue square moving up"
    written = cli.main(
        [
            str(config),
            "--ckpt",
            str(ckpt),
            "--streaming",
            "--num-frames",
            "24",
            "--resolution",
            "32x32",
            "--step-list",
            "1.0",
            "--window-frames",
            "8",
            "--sink-frames",
            "4",
            "--kv-recache",
            "shift",
            "--prompt-schedule",
            schedule,
            "--device",
            "cpu",
            "--save-dir",
            str(tmp_path / "out"),
            "--progress",
            "false",
        ]
    )
    assert len(written) == 1 and read_video(written[0]).shape == (24, 32, 32, 3)
    sidecar = json.loads(written[0].with_suffix(".json").read_text())
    assert sidecar["prompt"] == schedule and sidecar["kv_recache"] == "shift"
    assert "switch_renoise" not in sidecar and "rerender_passes" not in sidecar["chunks"][2]["recache"]
    assert sidecar["prompt_schedule"] == [[0, "a red circle moving left"], [8, "a blue square moving up"]]
    chunks = sidecar["chunks"]  # chunks of 4 frames: the switch re-caches before chunk 2, the window rolls at 3, 4, 5
    assert [c["index"] for c in chunks] == list(range(6)) and len(sidecar["chunk_seconds"]) == 6
    assert chunks[0]["prompts"] == ["a red circle moving left"] and chunks[2]["prompts"] == ["a blue square moving up"]
    assert chunks[2]["recache"]["reason"] == "switch" and chunks[2]["recache"]["frames"] == 8
    assert [c.get("recache", {}).get("reason") for c in chunks] == [None, None, "switch", "shift", "shift", "shift"]
    assert all(c["recache"]["seconds"] >= 0 for c in chunks[2:])
    csv = (tmp_path / "out" / "samples.csv").read_text()
    assert schedule in csv
    # the window scoring reads the schedule back from samples.csv: the window with the switch inside is not scored
    import subprocess
    import sys
    from pathlib import Path

    tool = Path(__file__).resolve().parents[1] / "tools/eval_moving_shapes.py"
    report = tmp_path / "windows.json"
    command = [sys.executable, str(tool), str(tmp_path / "out/samples.csv"), "--window", "8", "--stride", "4"]
    subprocess.run(
        [*command, "--json", str(report), "--no-progress"], check=True, capture_output=True, cwd=tool.parents[1]
    )
    windows = json.loads(report.read_text())["windows"]
    assert [w["scored_n"] for w in windows] == [1, 0, 1, 1, 1]  # starts 0, 4 (switch at 8 inside), 8, 12, 16


def test_cli_switch_renoise_rerenders_the_window_at_the_switch_and_records_it(tmp_path):
    """``--switch-renoise 0.75``: the same frames as the plain switch up to it, other frames after it; the sidecar
    names the time and the switch's re-cache counts the re-render's passes."""
    from opensora.datasets.video_io import read_video
    from opensora.inference import cli

    config, ckpt = random_causal_checkpoint(tmp_path)
    argv = [str(config), "--ckpt", str(ckpt), "--streaming", "--num-frames", "16", "--resolution", "32x32"]
    argv += ["--step-list", "1.0,0.5", "--window-frames", "8", "--prompt-schedule", "0:a red circle;8:a blue square"]
    argv += ["--device", "cpu", "--progress", "false"]
    plain = cli.main([*argv, "--save-dir", str(tmp_path / "plain")])
    written = cli.main([*argv, "--save-dir", str(tmp_path / "out"), "--switch-renoise", "0.75"])
    sidecar = json.loads(written[0].with_suffix(".json").read_text())
    assert sidecar["switch_renoise"] == 0.75
    recache = sidecar["chunks"][2]["recache"]  # chunks of 4 latent frames: 8 kept frames, 2 pieces, 2 steps each
    assert recache["reason"] == "switch" and recache["passes"] == 2 and recache["rerender_passes"] == 4
    a, b = read_video(plain[0]), read_video(written[0])
    assert (a[:8] == b[:8]).all() and not (a[12:] == b[12:]).all()
