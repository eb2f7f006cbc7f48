"""Self-Forcing / CausVid policy: the DMD CFG identity, the exit step shared by all ranks, the rollout's gradient
and cache policy (a spy records every streaming call), and the rollout's agreement with DMD2's backward
simulation when the whole clip is one chunk."""

import pytest
import torch

from dist_utils import run_distributed
from opensora.diffusion.guidance import text_cfg
from opensora.methods.causal import cfg_scale_to_dmd_guidance, dmd_guidance_to_cfg_scale, shared_randint
from opensora.registry import METHODS, MODELS, build_module

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py


# ---- the DMD CFG convention ---------------------------------------------------------------------------------------
def test_dmd_guidance_c_plus_w_c_minus_u_is_standard_cfg_with_s_equal_w_plus_1():
    torch.manual_seed(0)
    c, u = torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(2, 3, 4, dtype=torch.float64)
    for w in (0.0, 1.5, 3.0, 7.0):
        s = dmd_guidance_to_cfg_scale(w)
        assert s == w + 1 and cfg_scale_to_dmd_guidance(s) == w
        torch.testing.assert_close(c + w * (c - u), u + s * (c - u))
        torch.testing.assert_close(text_cfg(c, u, s), c + w * (c - u))


def test_methods_refuse_the_ambiguous_guidance_key():
    from test_methods_framework import make_components, make_dmd2_roles

    for name in ("CausVid", "SelfForcing"):
        with pytest.raises(ValueError, match="real_guidance_scale"):
            build_module(
                dict(type=name, guidance_scale=4.0), METHODS, roles=make_dmd2_roles(), components=make_components()
            )
        method = build_module(
            dict(type=name, real_guidance_scale=4.0, num_frames_per_chunk=2),
            METHODS,
            roles=causal_student(make_dmd2_roles(), 2),
            components=make_components(),
        )
        assert method.real_guidance_scale == 4.0 == method.guidance_scale  # DMD2 applies it with text_cfg
        with pytest.raises(ValueError, match="causal_chunk_frames=2"):  # the student must be built causal
            build_module(
                dict(type=name, num_frames_per_chunk=2), METHODS, roles=make_dmd2_roles(), components=make_components()
            )


# ---- exit step: drawn on rank 0, broadcast, RNG streams advance alike -------------------------------------------
def _draw_on_ranks(rank, world_size):
    from opensora.training.distributed import init_distributed

    init_distributed()
    torch.manual_seed(100 + rank)  # different streams per rank, as the trainer seeds them
    drawn = [shared_randint(4) for _ in range(20)]
    after = torch.rand(3)  # the RNG advanced by one draw per call on every rank
    torch.manual_seed(100 + rank)
    for _ in range(20):
        torch.randint(0, 4, (1,))
    return drawn, torch.equal(after, torch.rand(3))


def test_exit_step_is_the_same_on_every_rank_and_keeps_rng_streams_aligned():
    (rank0, same0), (rank1, same1) = run_distributed(_draw_on_ranks, world_size=2, timeout=120)
    assert rank0 == rank1 and len(set(rank0)) > 1 and all(0 <= j < 4 for j in rank0)
    assert same0 and same1
    torch.manual_seed(7)
    single = shared_randint(4)  # no process group: a plain draw
    torch.manual_seed(7)
    assert single == int(torch.randint(0, 4, (1,)).item())


# ---- the rollout policy, recorded by a spy -------------------------------------------------------------------------
class SpyCache:
    def __init__(self):
        self.stored = []  # (start_frame, tensor)
        self.cleared = False

    def clear(self):
        self.cleared = True


class StreamingSpy:
    """Wraps an adapter's streaming calls and records each one. With ``fake=True`` a chunk is predicted by the
    full forward on the chunk alone and the cache only records what is stored (context ignored): enough to check
    the policy, which never looks at the network; ``fake=False`` runs the real KV cache."""

    def __init__(self, adapter, fake):
        self.adapter, self.fake, self.calls, self.caches = adapter, fake, [], []
        self._real_new = getattr(adapter, "new_kv_cache", None)
        self._real_predict = getattr(adapter, "predict_x0_streaming", None)
        adapter.new_kv_cache = self.new_kv_cache
        adapter.predict_x0_streaming = self.predict

    def new_kv_cache(self, handle, batch, window_frames=None, sink_frames=0, rope_anchor="absolute"):
        cache = (
            SpyCache()
            if self.fake
            else self._real_new(
                handle, batch, window_frames=window_frames, sink_frames=sink_frames, rope_anchor=rope_anchor
            )
        )
        self.caches.append(cache)
        return cache

    def predict(self, handle, noisy, t, batch, cache, start_frame, store_kv, conditional=True):
        if self.fake:
            out = self.adapter.predict_x0(handle, noisy, t, batch, conditional=conditional)
            if store_kv:
                cache.stored.append((start_frame, noisy.detach().clone()))
        else:
            out = self._real_predict(handle, noisy, t, batch, cache, start_frame, store_kv, conditional=conditional)
        self.calls.append(
            dict(
                start=start_frame,
                t=float(t.flatten()[0]),
                store=bool(store_kv),
                grad=torch.is_grad_enabled(),
                graph=out.requires_grad,
                input=noisy.detach().clone(),
                output=out.detach().clone(),
            )
        )
        return out


def causal_student(roles, chunk):
    """Replace the student by a causal network with the teacher's weights (same parameters, causal attention)."""
    from test_methods_framework import TINY_MMDIT, make_role

    network = build_module(dict(TINY_MMDIT, causal_chunk_frames=chunk), MODELS)
    network.load_state_dict(roles["teacher"].unwrap().state_dict())
    roles["student"] = make_role("student", network, True)
    return roles


def make_self_forcing(fake=True, **kwargs):
    from test_methods_framework import make_components, make_dmd2_roles

    cfg = dict(type="SelfForcing", step_list=[1.0, 0.75, 0.5, 0.25], num_frames_per_chunk=1, real_guidance_scale=2.0)
    cfg.update(kwargs)
    roles = causal_student(make_dmd2_roles(), cfg["num_frames_per_chunk"])
    method = build_module(cfg, METHODS, roles=roles, components=make_components())
    return method, roles, StreamingSpy(method.adapter, fake)


@pytest.mark.parametrize("fake", [True, False], ids=["spy", "kv_cache"])
@pytest.mark.parametrize("exit_index", [0, 2, 3])
def test_only_the_exit_step_keeps_a_graph_and_the_cache_is_refilled_with_clean_x0(exit_index, fake):
    from test_methods_framework import tiny_batch

    method, _, spy = make_self_forcing(fake=fake)
    batch = method.adapter.prepare_batch(tiny_batch(2))
    torch.manual_seed(0)
    video = method.rollout_chunks(method.adapter.noise(batch), batch, exit_index, with_grad=True)
    assert video.shape == batch.latent_shape and video.requires_grad
    chunks = batch.latent_shape[2]  # 1 frame per chunk
    per_chunk = exit_index + 1 + 1
    assert len(spy.calls) == chunks * per_chunk - 1  # no refill after the last chunk
    times = method.step_times.tolist()
    for c in range(chunks):
        calls = spy.calls[c * per_chunk : (c + 1) * per_chunk]
        assert all(call["start"] == c for call in calls)
        for i, call in enumerate(calls[:exit_index]):  # earlier steps: no grad, no graph, no cache writes
            assert not call["grad"] and not call["graph"] and not call["store"]
            assert call["t"] == pytest.approx(times[i])
        exit_call = calls[exit_index]
        assert exit_call["grad"] and exit_call["graph"] and not exit_call["store"]
        assert exit_call["t"] == pytest.approx(times[exit_index])
        torch.testing.assert_close(video[:, :, c : c + 1], exit_call["output"])
        if c + 1 < chunks:  # refill: t = 0, store_kv, no grad, input = the chunk's own x0
            refill = calls[exit_index + 1]
            assert refill["store"] and not refill["grad"] and not refill["graph"] and refill["t"] == 0.0
            torch.testing.assert_close(refill["input"], exit_call["output"])
    cache = spy.caches[0]
    assert len(spy.caches) == 1 and (cache.cleared if fake else cache.num_frames == 0)  # emptied after the rollout
    # the whole video's DMD gradient reaches the student through the exit steps only
    video.sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in method.student.unwrap().parameters())


def test_grad_frames_grades_only_the_last_chunks_and_critic_iterations_build_no_graph():
    from test_methods_framework import tiny_batch

    method, _, spy = make_self_forcing(grad_frames=2)
    batch = method.adapter.prepare_batch(tiny_batch(1))
    method.rollout_chunks(method.adapter.noise(batch), batch, 1, with_grad=True)
    exits = [call for call in spy.calls if not call["store"] and call["t"] == pytest.approx(0.75)]
    assert [call["graph"] for call in exits] == [False, False, True, True]
    spy.calls.clear()
    video = method.rollout_chunks(method.adapter.noise(batch), batch, 1, with_grad=False)
    assert not video.requires_grad and not any(call["graph"] for call in spy.calls)


def test_context_noise_renoises_the_refill_input():
    from test_methods_framework import tiny_batch

    method, _, spy = make_self_forcing(context_noise=0.1)
    batch = method.adapter.prepare_batch(tiny_batch(1))
    method.rollout_chunks(method.adapter.noise(batch), batch, 0, with_grad=False)
    refills = [call for call in spy.calls if call["store"]]
    assert refills and all(call["t"] == pytest.approx(0.1) for call in refills)
    assert not torch.allclose(refills[0]["input"], spy.calls[0]["output"])


@pytest.mark.parametrize("rollout", ["euler", "renoise"])
def test_one_chunk_rollout_is_dmd2_backward_simulation(rollout):
    """With the whole clip as one chunk, the Self-Forcing rollout is DMD2's generate (same noise, same step)."""
    from test_methods_framework import make_components, tiny_batch

    method, roles, _ = make_self_forcing(num_frames_per_chunk=4, rollout=rollout)
    dmd2 = build_module(
        dict(type="DMD2", step_list=[1.0, 0.75, 0.5, 0.25], rollout=rollout),
        METHODS,
        roles=roles,
        components=make_components(),
    )
    batch = method.adapter.prepare_batch(tiny_batch(2))
    noise = method.adapter.noise(batch)
    for j in range(4):
        torch.manual_seed(j)
        ours = method.rollout_chunks(noise, batch, j, with_grad=False)
        torch.manual_seed(j)
        x = dmd2.simulate_student_input(noise, j, batch)
        with torch.no_grad():
            ref = dmd2.adapter.predict_x0(roles["student"], x, dmd2.step_times[j].expand(2), batch)
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


def test_generate_draws_one_exit_step_and_trains_through_the_dmd2_step():
    from test_methods_framework import tiny_batch, trainer_like_step

    method, roles, spy = make_self_forcing(student_update_every=2)
    for iteration in range(3):
        spy.calls.clear()
        loss_map, outputs, grad_norms = trainer_like_step(method, roles, tiny_batch(1), iteration)
        j = outputs["exit_step"]
        assert 0 <= j < 4 and outputs["flops"] > 0
        assert sum(call["store"] for call in spy.calls) == 3  # 4 chunks, 3 refills
        assert len(spy.calls) == 4 * (j + 1) + 3
        assert ("generator_loss" in loss_map) == (iteration % 2 == 0)
        assert set(grad_norms) == ({"critic", "student"} if iteration % 2 == 0 else {"critic"})
        assert torch.isfinite(loss_map["total_loss"])


def test_rollout_context_is_the_cache_of_earlier_clean_chunks():
    """Real KV cache: a chunk's prediction depends on the chunks before it (through the cache), and the cache
    holds exactly the chunks stored so far when the next chunk is predicted."""
    from test_methods_framework import tiny_batch

    method, _, spy = make_self_forcing(fake=False)
    seen = []
    predict = spy.predict

    def recording(handle, noisy, t, batch, cache, start_frame, store_kv, conditional=True):
        seen.append((start_frame, store_kv, cache.num_frames))
        return predict(handle, noisy, t, batch, cache, start_frame, store_kv, conditional)

    method.adapter.predict_x0_streaming = recording
    batch = method.adapter.prepare_batch(tiny_batch(1))
    noise = method.adapter.noise(batch)
    video = method.rollout_chunks(noise, batch, 1, with_grad=False)
    # before chunk c (its steps and its refill) the cache holds frames 0 .. c-1
    assert all(held == start for start, _, held in seen)
    # the same last-chunk noise after different earlier chunks gives a different last chunk
    other = noise.clone()
    other[:, :, :3] = torch.randn_like(other[:, :, :3])
    assert not torch.allclose(method.rollout_chunks(other, batch, 1, with_grad=False)[:, :, 3], video[:, :, 3])


def test_rollout_exiting_at_the_last_step_is_what_the_streaming_sampler_generates():
    """Train/test consistency: with the last exit step, the training rollout (through the adapter) and the
    streaming sampler (opensora.inference.streaming.generator) produce the same latents from the same noise."""
    from test_methods_framework import tiny_batch

    from opensora.inference.sampler import VideoSampler
    from opensora.inference.streaming.generator import StreamingGenerator

    method, roles, _ = make_self_forcing(fake=False, rollout="euler", num_frames_per_chunk=2)
    batch = tiny_batch(2)
    prepared = method.adapter.prepare_batch(batch)
    comp = method.components
    sampler = VideoSampler(roles["student"].unwrap(), comp.vae, comp.text_encoder, progress=False)
    stream = StreamingGenerator(sampler, step_list=[1.0, 0.75, 0.5, 0.25], rollout="euler")
    seeds = [3, 4]
    with torch.no_grad():
        chunks = list(stream.stream(batch["text"], seeds, num_frames=4, height=16, width=16, decode=False))
    streamed = torch.cat([chunk.latents for chunk in chunks], dim=2)
    # the sampler's noise: per sample its own generator, one draw per chunk in order
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    noise = torch.cat(
        [torch.stack([torch.randn((48, 2, 4, 4), generator=g) for g in generators]) for _ in range(2)], dim=2
    )
    rolled = method.rollout_chunks(noise, prepared, exit_index=3, with_grad=False)
    torch.testing.assert_close(rolled, streamed, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["CausVid", "SelfForcing"])
def test_student_samples_are_causal_in_chunks(name):
    """Through both rollouts (CausVid: DMD2's backward simulation with the full causal forward; Self-Forcing: chunk
    by chunk with the cache), new noise in the last chunk changes only the last chunk."""
    from test_methods_framework import make_components, make_dmd2_roles, tiny_batch

    roles = causal_student(make_dmd2_roles(), 2)
    method = build_module(
        dict(type=name, step_list=[1.0, 0.5], num_frames_per_chunk=2, rollout="euler"),
        METHODS,
        roles=roles,
        components=make_components(),
    )
    batch = method.adapter.prepare_batch(tiny_batch(2))
    noise = method.adapter.noise(batch)
    other = noise.clone()
    other[:, :, 2:] = torch.randn_like(other[:, :, 2:])
    samples = []
    for x in (noise, other):
        method.adapter.noise = lambda _batch, x=x: x.clone()  # the rollout's starting noise
        torch.manual_seed(0)  # the same step index / exit step
        with torch.no_grad():
            samples.append(method.generate(batch, with_grad=False)[0])
    torch.testing.assert_close(samples[0][:, :, :2], samples[1][:, :, :2], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(samples[0][:, :, 2:], samples[1][:, :, 2:])
