"""Long-rollout DMD policy: the student streams past the clip length through its rolling cache (sink frames kept),
only the judged window keeps graphs, nothing after the window is generated, and one clip-length rollout is exactly
Self-Forcing's (a spy records every streaming call, as in test_self_forcing.py)."""

import pytest
import torch
from test_self_forcing import StreamingSpy, causal_student

from opensora.registry import METHODS, build_module

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py

CLIP = 4  # latent frames of test_methods_framework.tiny_batch
STEPS = [1.0, 0.6, 0.3]  # make_long_rollout's step list


def make_long_rollout(fake=False, **kwargs):
    from test_methods_framework import make_components, make_dmd2_roles

    cfg = dict(
        type="LongRollout",
        step_list=list(STEPS),
        num_frames_per_chunk=1,
        real_guidance_scale=2.0,
        rollout_multiple=3,
        kv_window_frames=3,
        kv_sink_frames=1,
    )
    cfg.update(kwargs)
    roles = causal_student(make_dmd2_roles(), cfg["num_frames_per_chunk"])
    method = build_module(cfg, METHODS, roles=roles, components=make_components())
    return method, roles, StreamingSpy(method.adapter, fake)


def fixed_draws(method, exit_index, end):
    method.draw_exit_step = lambda: exit_index
    method.draw_window_end = lambda clip_chunks: end


@pytest.mark.parametrize("end", [4, 9, 12])
def test_only_the_window_keeps_graphs_and_nothing_after_it_is_generated(end):
    from test_methods_framework import tiny_batch

    method, _, spy = make_long_rollout()
    fixed_draws(method, 1, end)
    held = []
    predict = spy.predict

    def recording(handle, noisy, t, batch, cache, start_frame, store_kv, conditional=True):
        held.append((start_frame, list(cache.frame_ids)))
        return predict(handle, noisy, t, batch, cache, start_frame, store_kv, conditional)

    method.adapter.predict_x0_streaming = recording
    batch = method.adapter.prepare_batch(tiny_batch(2))
    window, _ = method.generate(batch, with_grad=True)
    assert window.shape == batch.latent_shape and window.requires_grad
    start = end - CLIP
    assert method.last_window == (start, end)
    assert max(call["start"] for call in spy.calls) == end - 1  # chunks after the window never run
    exits = [call for call in spy.calls if not call["store"] and call["t"] == pytest.approx(0.6)]
    assert [call["start"] for call in exits] == list(range(end))
    assert [call["graph"] for call in exits] == [c >= start for c in range(end)]  # graphs: the window's chunks only
    assert not any(call["graph"] for call in spy.calls if call["store"] or call["t"] != pytest.approx(0.6))
    torch.testing.assert_close(window, torch.cat([call["output"] for call in exits[start:]], dim=2))
    # the rolling cache: at most 3 frames, frame 0 kept as a sink once the window rolls
    assert all(len(ids) <= 3 and (ids[:1] == [0] or not ids) for _, ids in held)
    assert all(ids == [0, s - 2, s - 1] for s, ids in held if s >= 3)
    window.sum().backward()  # the DMD gradient reaches the student through the window's exit steps
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in method.student.unwrap().parameters())
    spy.calls.clear()
    assert not method.generate(batch, with_grad=False)[0].requires_grad  # critic iterations build no graph
    assert not any(call["graph"] for call in spy.calls)


def test_one_clip_rollout_is_self_forcing():
    """rollout_multiple=1: the window is the clip and the cache never rolls, so the sample is Self-Forcing's."""
    from test_methods_framework import make_components, tiny_batch

    method, roles, _ = make_long_rollout(rollout_multiple=1, kv_window_frames=None, kv_sink_frames=0)
    reference = build_module(
        dict(type="SelfForcing", step_list=[1.0, 0.6, 0.3], num_frames_per_chunk=1, real_guidance_scale=2.0),
        METHODS,
        roles=roles,
        components=make_components(),
    )
    batch = method.adapter.prepare_batch(tiny_batch(2))
    noise = method.adapter.noise(batch)
    for m in (method, reference):  # the same starting noise and exit step (the two draw them in another order)
        m.adapter.noise = lambda shaped, noise=noise: noise[:, :, : shaped.latent_shape[2]].clone()
        m.draw_exit_step = lambda: 2
    method.draw_window_end = lambda clip_chunks: clip_chunks  # the one draw Self-Forcing does not make
    torch.manual_seed(3)  # the same re-noising draws
    ours, _ = method.generate(batch, with_grad=False)
    torch.manual_seed(3)
    theirs, _ = reference.generate(batch, with_grad=False)
    assert method.last_window == (0, CLIP)
    torch.testing.assert_close(ours, theirs)


def test_window_draws_cover_the_rollout_and_last_takes_the_end():
    method, _, _ = make_long_rollout()
    torch.manual_seed(0)
    ends = {method.draw_window_end(CLIP) for _ in range(200)}
    assert ends == set(range(CLIP, 3 * CLIP + 1))
    last, _, _ = make_long_rollout(window="last")
    assert {last.draw_window_end(CLIP) for _ in range(5)} == {3 * CLIP}


def test_a_first_window_share_draws_the_clips_first_window_that_often_and_zero_keeps_the_rng_stream():
    from test_methods_framework import tiny_batch

    always, _, _ = make_long_rollout(first_window_share=1.0)
    assert {always.draw_window_end(CLIP) for _ in range(20)} == {CLIP}
    always.draw_exit_step = lambda: 1
    always.generate(always.adapter.prepare_batch(tiny_batch(1)), with_grad=False)
    assert always.last_window == (0, CLIP)  # the clip's own rollout: nothing past it runs
    half, _, _ = make_long_rollout(first_window_share=0.5)
    torch.manual_seed(0)
    ends = [half.draw_window_end(CLIP) for _ in range(400)]
    share = ends.count(CLIP) / len(ends)  # 0.5 + 0.5 / 9 expected: a uniform draw lands there too
    assert 0.45 < share < 0.67 and set(ends) == set(range(CLIP, 3 * CLIP + 1)), share
    plain, zero = make_long_rollout()[0], make_long_rollout(first_window_share=0.0)[0]
    torch.manual_seed(1)
    drawn, after = [plain.draw_window_end(CLIP) for _ in range(30)], torch.rand(3)
    torch.manual_seed(1)  # a share of 0 draws nothing more: the same windows, the generator left where it was
    assert [zero.draw_window_end(CLIP) for _ in range(30)] == drawn and torch.equal(torch.rand(3), after)


def test_trains_a_few_steps_with_finite_losses_on_the_two_time_scale_rule():
    from test_methods_framework import tiny_batch, trainer_like_step

    method, roles, _ = make_long_rollout(student_update_every=2)
    before = {k: v.clone() for k, v in roles["student"].unwrap().state_dict().items()}
    for iteration in range(3):
        loss_map, outputs, grad_norms = trainer_like_step(method, roles, tiny_batch(1), iteration)
        assert all(torch.isfinite(v) for v in loss_map.values())
        assert ("generator_loss" in loss_map) == (iteration % 2 == 0)
        assert set(grad_norms) == ({"critic", "student"} if iteration % 2 == 0 else {"critic"})
        start, end = outputs["window_start_frame"], outputs["rollout_frames"]
        assert end - start == CLIP and CLIP <= end <= 3 * CLIP and outputs["flops"] > 0
    after = roles["student"].unwrap().state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_critic_windows_are_cut_from_the_one_rollout_and_only_the_judged_one_keeps_a_graph():
    """critic_windows=3, the judged window ending at chunk 6 and two more at 4 and 9: one rollout to chunk 9 (not
    three), graphs on the judged window's chunks 2-5 only, the other windows the same rollout's chunks 0-3 and 5-8,
    detached."""
    from test_methods_framework import tiny_batch

    method, _, spy = make_long_rollout(critic_windows=3)
    ends = iter([6, 4, 9])
    method.draw_exit_step = lambda: 1
    method.draw_window_end = lambda clip_chunks: next(ends)
    batch = method.adapter.prepare_batch(tiny_batch(2))
    judged, _ = method.generate(batch, with_grad=True)
    assert judged.shape == batch.latent_shape and judged.requires_grad
    assert max(call["start"] for call in spy.calls) == 8  # chunk 8 is the furthest window's last
    exits = {call["start"]: call for call in spy.calls if not call["store"] and call["t"] == pytest.approx(0.6)}
    assert sorted(exits) == list(range(9))  # every chunk stops at the iteration's exit step (t = 0.6)
    chunks = [exits[c]["output"] for c in range(9)]
    assert [exits[c]["graph"] for c in range(9)] == [2 <= c < 6 for c in range(9)]
    torch.testing.assert_close(judged, torch.cat(chunks[2:6], dim=2))
    assert len(method.extra_windows) == 2 and not any(w.requires_grad for w in method.extra_windows)
    torch.testing.assert_close(method.extra_windows[0], torch.cat(chunks[0:4], dim=2))
    torch.testing.assert_close(method.extra_windows[1], torch.cat(chunks[5:9], dim=2))
    assert method.last_window == (2, 9) and method.last_critic_windows == [2, 0, 5]


def test_the_critic_judges_every_window_under_its_own_samples_prompt():
    """The stacked critic loss is the mean of each window's loss with the batch's prompts in order (two different
    prompts: a wrong row order would pair a window with the other sample's prompt)."""
    import torch.nn.functional as F
    from test_methods_framework import tiny_batch

    method, _, _ = make_long_rollout(critic_windows=3)
    batch = method.adapter.prepare_batch(tiny_batch(2))
    repeated = method.adapter.repeat_batch(batch, 3)
    assert repeated.latent_shape == (6, *batch.latent_shape[1:])
    for key, value in batch.text.items():
        torch.testing.assert_close(repeated.text[key], torch.cat([value] * 3))
    assert not torch.equal(batch.text["text_emb"][0], batch.text["text_emb"][1])
    judged = torch.randn(batch.latent_shape)
    method.extra_windows = [torch.randn(batch.latent_shape) for _ in range(2)]
    windows = [judged, *method.extra_windows]
    torch.manual_seed(5)
    stacked = method.critic_loss(judged, batch)
    assert method.extra_windows == []  # used once
    torch.manual_seed(5)
    t = method.sample_timesteps(repeated)
    noise = torch.randn(6, *batch.latent_shape[1:])
    each = []
    for k, x0 in enumerate(windows):
        rows = slice(2 * k, 2 * k + 2)
        noisy = method.adapter.add_noise(x0, noise[rows], t[rows])
        velocity = method.adapter.predict_velocity(method.critic, noisy, t[rows], batch, conditional=True)
        each.append(F.mse_loss(velocity, method.adapter.velocity_target(x0, noise[rows])))
    torch.testing.assert_close(stacked, torch.stack(each).mean())


def test_critic_windows_train_with_finite_losses_and_count_their_passes():
    from test_methods_framework import tiny_batch, trainer_like_step

    flops = {}
    for windows in (1, 3):
        method, roles, _ = make_long_rollout(student_update_every=2, critic_windows=windows)
        method.draw_exit_step = lambda: 1  # the same passes in both runs (the extra window draws move the RNG)
        method.draw_window_end = lambda clip_chunks: 3 * clip_chunks  # every window the last: the same rollout
        torch.manual_seed(0)
        for iteration in range(2):
            loss_map, outputs, _ = trainer_like_step(method, roles, tiny_batch(2), iteration)
            assert all(torch.isfinite(v) for v in loss_map.values())
        flops[windows] = outputs["flops"]
    pass_flops = method.adapter.forward_flops(method.critic, method._last_batch)
    assert flops[3] == pytest.approx(flops[1] + 6 * pass_flops)  # the same rollout either way: 2 more critic passes


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(rollout_multiple=0), "rollout_multiple"),
        (dict(window="middle"), "window"),
        (dict(kv_window_frames=2, kv_sink_frames=2), "kv_sink_frames"),
        (dict(switch_prob=1.5), "switch_prob"),
        (dict(kv_rope_anchor="middle"), "kv_rope_anchor"),
        (dict(context_steps="some"), "context_steps"),
        (dict(critic_windows=0), "critic_windows"),
        (dict(first_window_share=-0.1), "first_window_share"),
        (dict(critic_windows=2, switch_prob=0.25), "critic_windows > 1 does not combine with switch_prob"),
        (dict(critic_windows=2, context_steps="full"), "critic_windows > 1 does not combine with context_steps"),
        (dict(critic_windows=2, window="last"), "critic_windows > 1 does not combine with window='last'"),
    ],
)
def test_bad_settings_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        make_long_rollout(**bad)


def test_default_cache_window_needs_room_beside_the_sinks():
    from test_methods_framework import tiny_batch

    method, _, _ = make_long_rollout(kv_window_frames=None, kv_sink_frames=3)  # default window: 4 - 1 = 3 frames
    with pytest.raises(ValueError, match="sink frames"):
        method.generate(method.adapter.prepare_batch(tiny_batch(1)), with_grad=False)


def sampler_stream_and_noise(method, roles, batch, anchor, switches=()):
    """The streaming sampler of ``method``'s student on ``batch`` (seeds 3 and 4, 3x the clip in 2-frame chunks,
    window 4, 2 sinks, ``anchor``, ``switches``): its chunks, their latents, and the noise it drew as one tensor for
    ``rollout_chunks``."""
    from opensora.inference.sampler import VideoSampler
    from opensora.inference.streaming.generator import StreamingGenerator

    comp = method.components
    sampler = VideoSampler(roles["student"].unwrap(), comp.vae, comp.text_encoder, progress=False)
    stream = StreamingGenerator(
        sampler, step_list=list(STEPS), rollout="euler", window_frames=4, sink_frames=2, rope_anchor=anchor
    )
    seeds = [3, 4]
    with torch.no_grad():
        chunks = list(
            stream.stream(batch["text"], seeds, num_frames=3 * CLIP, height=16, width=16, decode=False,
                          switches=switches)
        )  # fmt: skip
    generators = [torch.Generator().manual_seed(s) for s in seeds]  # the sampler's noise: one draw per chunk
    noise = torch.cat(
        [torch.stack([torch.randn((48, 2, 4, 4), generator=g) for g in generators]) for _ in range(6)], dim=2
    )
    return chunks, torch.cat([chunk.latents for chunk in chunks], dim=2), noise


@pytest.mark.parametrize(
    "switch_chunk, anchor", [(None, "absolute"), (3, "absolute"), (None, "window"), (3, "window"), (4, "window")]
)
def test_long_rollout_at_the_last_exit_step_is_what_the_streaming_sampler_generates(switch_chunk, anchor):
    """Train/test consistency past the clip length: the training rollout through the rolling cache with a sink (3x the
    clip, exit at the last step) equals the streaming sampler's latents with the same window and sink frames; with a
    prompt switch at chunk 3 (each sample takes the other's prompt) it equals the sampler's switch with the re-cache;
    with the window RoPE anchor (text and sinks at the window's start) it equals the sampler's anchored stream, with
    a switch too (the re-cache pins the anchor on both sides; at chunk 4 the window has rolled twice)."""
    from test_methods_framework import tiny_batch

    steps = STEPS
    method, roles, _ = make_long_rollout(
        num_frames_per_chunk=2, rollout="euler", kv_window_frames=4, kv_sink_frames=2, kv_rope_anchor=anchor
    )
    batch = tiny_batch(2)
    prepared = method.adapter.prepare_batch(batch)
    switches, switch = (), None
    if switch_chunk is not None:
        prompts = list(batch["text"])
        switches = [(switch_chunk * 2, prompts[-1:] + prompts[:-1])]  # latent frame of chunk 3; sample i takes i - 1
        switch = (switch_chunk, method.adapter.roll_prompts(prepared))
    chunks, streamed, noise = sampler_stream_and_noise(method, roles, batch, anchor, switches)
    assert max(chunk.cached_frames for chunk in chunks) == 4  # the cache rolled
    rolled = method.rollout_chunks(noise, prepared, exit_index=len(steps) - 1, with_grad=False, switch=switch)
    torch.testing.assert_close(rolled, streamed, rtol=1e-4, atol=1e-5)
    if anchor == "window":  # the anchor moved the text and the sinks once the cache rolled: a different stream
        absolute = make_long_rollout(
            num_frames_per_chunk=2, rollout="euler", kv_window_frames=4, kv_sink_frames=2, kv_rope_anchor="absolute"
        )[0]
        absolute.student = method.student  # the same network, only the anchor differs
        plain = absolute.rollout_chunks(noise, prepared, exit_index=len(steps) - 1, with_grad=False)
        assert (rolled - plain).abs().max() > 1e-3
    if switch_chunk is not None:  # the switch changed what follows it, not what precedes it
        plain = method.rollout_chunks(noise, prepared, exit_index=len(steps) - 1, with_grad=False)
        torch.testing.assert_close(rolled[:, :, : 2 * switch_chunk], plain[:, :, : 2 * switch_chunk])
        assert (rolled[:, :, 2 * switch_chunk :] - plain[:, :, 2 * switch_chunk :]).abs().max() > 1e-3


@pytest.mark.parametrize("anchor", ["absolute", "window"])
def test_full_context_steps_give_the_window_the_streaming_samplers_context(anchor):
    """``context_steps="full"``: whatever the exit step, the chunks before the judged window run every step, so
    each one is the chunk the streaming sampler generates from the same noise (its cache, sinks and anchor
    included); the window's chunks still stop at the exit step and alone keep graphs. The default ("exit") stops
    every chunk at the exit step, so its context differs."""
    from test_methods_framework import tiny_batch

    flags = dict(num_frames_per_chunk=2, rollout="euler", kv_window_frames=4, kv_sink_frames=2, kv_rope_anchor=anchor)
    method, roles, spy = make_long_rollout(context_steps="full", **flags)
    batch = tiny_batch(2)
    prepared = method.adapter.prepare_batch(batch)
    _, streamed, noise = sampler_stream_and_noise(method, roles, batch, anchor)
    with torch.no_grad():
        rolled = method.rollout_chunks(
            noise, prepared, exit_index=0, with_grad=False, keep_from=4, context_exit_index=len(STEPS) - 1
        )
    passes = [call for call in spy.calls if not call["store"]]
    context = {call["start"]: call["output"] for call in passes if call["t"] == pytest.approx(0.3)}
    assert sorted(context) == [0, 2, 4, 6]  # every context chunk ran to the last step, no window chunk did
    torch.testing.assert_close(torch.cat([context[s] for s in (0, 2, 4, 6)], dim=2), streamed[:, :, :8])
    assert [c["start"] for c in passes if c["start"] >= 8] == [8, 10]  # the window: one pass each (exit step 0)
    assert rolled.shape[2] == 4
    default = make_long_rollout(**flags)[0]
    default.student = method.student  # the same network; only the context's steps differ
    exit_context = default.rollout_chunks(noise, prepared, exit_index=0, with_grad=False, keep_from=4)
    assert (exit_context - rolled).abs().max() > 1e-5  # a random tiny network leans little on its context


def test_full_context_steps_keep_graphs_on_the_window_and_count_their_passes():
    """The graded rollout under ``context_steps="full"``: graphs only on the window's exit steps, every context chunk
    at every step, and the FLOP count's extra passes include them."""
    from test_methods_framework import tiny_batch

    method, _, spy = make_long_rollout(context_steps="full")  # 3 steps (exit indices 0-2), 1-frame chunks
    fixed_draws(method, 0, 9)
    batch = method.adapter.prepare_batch(tiny_batch(2))
    window, _ = method.generate(batch, with_grad=True)
    passes = [call for call in spy.calls if not call["store"]]
    assert [len([c for c in passes if c["start"] == s]) for s in range(9)] == [3] * 5 + [1] * 4
    assert [c["start"] for c in spy.calls if c["graph"]] == [5, 6, 7, 8] and window.requires_grad
    # refills 8 + context 5 x 3 + window 4 x 1 passes, less DMD2's own count of one clip (4 x 1), over 4 chunks
    assert method.last_extra_passes == pytest.approx((8 + 15 + 4 - 4) / 4)


def test_demo_config_trains_a_few_steps_at_the_demo_clip_shape():
    """configs/distill/long_rollout_demo.py's method (its chunk size, cache window and sink) on 32x32x16 clips with
    the tests' tiny networks (16 latent frames; a rollout of up to 4x the clip): finite losses, the student moves on
    its iterations only, the critic every iteration."""
    from test_methods_framework import make_components, make_dmd2_roles, trainer_like_step

    from opensora.config import load_config

    cfg = load_config("configs/distill/long_rollout_demo.py")
    method_cfg = {k: v for k, v in cfg.method.items() if k != "adapter"}
    method_cfg.update(student_update_every=2, step_list=[1.0, 0.5])  # two steps per chunk keep the test short
    roles = causal_student(make_dmd2_roles(), cfg.method.num_frames_per_chunk)
    method = build_module(method_cfg, METHODS, roles=roles, components=make_components())
    batch = dict(video=torch.rand(1, 3, 16, 32, 32) * 2 - 1, text=["a red circle moving left"])
    student = roles["student"].unwrap()
    torch.manual_seed(0)  # the same window draws every run
    for iteration in range(2):
        before = [p.detach().clone() for p in student.parameters()]
        loss_map, outputs, grad_norms = trainer_like_step(method, roles, batch, iteration)
        assert all(torch.isfinite(v) for v in loss_map.values()) and set(loss_map) >= {"critic_loss", "total_loss"}
        moved = any(not torch.equal(a, b) for a, b in zip(before, student.parameters()))
        assert moved == (iteration == 0) and ("student" in grad_norms) == (iteration == 0)
        start, end = outputs["window_start_frame"], outputs["rollout_frames"]
        chunk = cfg.method.num_frames_per_chunk
        assert end - start == 16 and 16 <= end <= 64 and end % chunk == 0
    # the config's cache: a window of the demo clip's latent frames minus one chunk, one chunk of sink frames
    assert method.cache_window(method.adapter.prepare_batch(batch)) == cfg.window_frames == 4 - chunk
    assert method.kv_sink_frames == cfg.sink_frames == chunk


@pytest.mark.parametrize("batch_size, end, switched", [(2, 9, True), (2, 4, False), (1, 9, False)])
def test_a_prompt_switch_is_judged_with_the_new_prompts(batch_size, end, switched):
    """switch_prob=1: where the window starts after the first chunk and the batch has another prompt to switch to,
    the window is made and judged (teacher, critic) with each sample's switched prompt; otherwise nothing switches."""
    from test_methods_framework import tiny_batch

    method, roles, _ = make_long_rollout(switch_prob=1.0)
    fixed_draws(method, exit_index=1, end=end)
    prepared = method.adapter.prepare_batch(tiny_batch(batch_size))
    seen = []
    real_and_fake = method.real_and_fake_x0
    method.real_and_fake_x0 = lambda x0, batch: seen.append(batch) or real_and_fake(x0, batch)
    critic_loss = method.critic_loss
    method.critic_loss = lambda x0, batch: seen.append(batch) or critic_loss(x0, batch)
    method.adapter.prepare_batch = lambda batch: prepared
    loss_map, outputs = method.single_train_step(tiny_batch(batch_size), iteration=0)
    assert outputs["prompt_switch"] == int(switched) and torch.isfinite(loss_map["total_loss"])
    assert len(seen) == 2 and seen[0] is seen[1]  # teacher / critic scores and the critic's loss: one batch
    judged = seen[0].text["text_emb"]
    expected = prepared.text["text_emb"].roll(1, dims=0) if switched else prepared.text["text_emb"]
    assert torch.equal(judged, expected)
    if switched:
        assert not torch.equal(judged, prepared.text["text_emb"])  # the two prompts differ


def test_the_gpu_configs_cache_flags_reach_the_method():
    """``--window-frames / --sink-frames / --rope-anchor`` on the command line set the sampler's keys and the method's
    copies alike (``_links_``), so training and streaming keep one regime."""
    from opensora.config import load_config

    path = "configs/distill/long_rollout_gpu.py"
    cfg = load_config(path, ["--rope-anchor", "window", "--sink-frames", "0", "--window-frames", "12"])
    assert (cfg.rope_anchor, cfg.sink_frames, cfg.window_frames) == ("window", 0, 12)
    assert (cfg.method.kv_rope_anchor, cfg.method.kv_sink_frames, cfg.method.kv_window_frames) == ("window", 0, 12)
    plain = load_config(path)
    assert (plain.method.kv_rope_anchor, plain.method.kv_sink_frames) == (plain.rope_anchor, plain.sink_frames)
