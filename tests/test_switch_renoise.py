"""The re-rendered context of a prompt switch (``StreamingGenerator(switch_renoise=s)``, ``recache.Rerender``): the
noise-forward step in closed form; the frames before the switch are the plain switch's, the later ones differ; its
noise is its own (the stream's draws are the plain switch's, a sample's video does not depend on its batch); its
passes are counted; and for a window of one piece the stored keys/values and the next chunk equal a re-render built
by hand from ``model.forward_chunk`` with a fresh cache."""

import pytest
import torch
from test_streaming import PROMPTS, tiny_sampler

from opensora.diffusion import flow_matching as fm
from opensora.inference.sampler import noise_from_generators
from opensora.inference.streaming import rules
from opensora.inference.streaming.generator import StreamingGenerator
from opensora.inference.streaming.recache import rerender_seed, rerender_times

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py

SWITCHED = ["a green triangle moving right", "a yellow circle moving down"]
KWARGS = dict(step_list=[1.0, 0.5], window_frames=6, sink_frames=2)


# ---- noise forward --------------------------------------------------------------------------------------------------
def test_noise_forward_is_add_noise_from_a_clean_latent_and_pure_noise_at_one():
    x, noise = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 5)
    for s in (0.0, 0.3, 1.0):
        torch.testing.assert_close(fm.noise_forward(x, noise, 0.0, s), fm.add_noise(x, noise, s), rtol=0, atol=1e-7)
    for c in (0.0, 0.4, 0.9):
        assert torch.equal(fm.noise_forward(x, noise, c, 1.0), noise)
    assert torch.equal(fm.noise_forward(x, noise, 0.5, 0.5), x)  # s = c: nothing added


@pytest.mark.parametrize("c,s", [(0.25, 0.5), (0.5, 0.75), (0.1, 0.95)])
def test_noise_forward_has_the_marginal_of_time_s(c, s):
    """x_c = (1 - c) x0 + c eps carried to s: mean (1 - s) x0, standard deviation s (the two noises independent)."""
    g = torch.Generator().manual_seed(0)
    x0 = torch.full((400_000,), 0.7)
    x_c = fm.add_noise(x0, torch.randn(x0.shape, generator=g), c)
    x_s = fm.noise_forward(x_c, torch.randn(x0.shape, generator=g), c, s)
    assert abs(float(x_s.mean()) - (1 - s) * 0.7) < 0.005
    assert abs(float(x_s.std()) - s) < 0.005
    a = (1 - s) / (1 - c)
    assert abs(a * c) <= s  # the fresh noise's share b = sqrt(s^2 - (a c)^2) is real


def test_noise_forward_refuses_a_time_before_c():
    x = torch.zeros(2)
    for c, s in ((0.5, 0.25), (1.0, 1.0), (0.0, 1.5)):
        with pytest.raises(ValueError, match="noise_forward needs"):
            fm.noise_forward(x, x, c, s)


def test_rerender_times_start_at_s_and_keep_the_schedule_below_it():
    assert rerender_times([1.0, 0.75, 0.5, 0.25, 0.0], 0.6) == [0.6, 0.5, 0.25, 0.0]
    assert rerender_times([1.0, 0.5, 0.0], 1.0) == [1.0, 0.5, 0.0]
    assert rerender_seed(3, 8) != rerender_seed(3, 10) and rerender_seed(3, 8) != rerender_seed(4, 8)


# ---- the generator --------------------------------------------------------------------------------------------------
def stream(sampler, prompts=PROMPTS, seeds=(0, 1), switched=SWITCHED, frames=16, **kwargs):
    generator = StreamingGenerator(sampler, **dict(KWARGS, **kwargs))
    chunks = list(generator.stream(prompts, list(seeds), frames, 16, 16, switches=[(8, switched)]))
    return chunks, generator


def test_a_rerendered_switch_keeps_the_frames_before_it_changes_the_later_ones_and_counts_its_passes():
    sampler = tiny_sampler()
    plain, plain_gen = stream(sampler)
    renoised, gen = stream(sampler, switch_renoise=0.75)
    for a, b in zip(plain, renoised):  # a switch at latent frame 8: chunks 0-3 are handed out before it
        if a.index < 4:
            assert torch.equal(a.latents, b.latents) and torch.equal(a.frames, b.frames)
        else:
            assert not any(torch.allclose(x, y, atol=1e-4) for x, y in zip(a.latents, b.latents))
    record = renoised[4].recache
    # kept frames [0, 1, 4, 5, 6, 7]: 3 pieces, each re-rendered along [0.75, 0.5, 0] (2 passes), then stored
    assert record["reason"] == "switch" and record["passes"] == 3 and record["rerender_passes"] == 6
    assert "rerender_passes" not in plain[4].recache
    assert gen.passes - plain_gen.passes == 6
    again, _ = stream(sampler, switch_renoise=0.75)  # the same seeds, the same video
    assert all(torch.equal(a.latents, b.latents) and torch.equal(a.frames, b.frames) for a, b in zip(renoised, again))
    other, _ = stream(sampler, switch_renoise=1.0)
    assert not torch.allclose(other[4].latents, renoised[4].latents, atol=1e-4)


@pytest.mark.parametrize("context_time,guidance", [(0.0, 1.0), (0.25, 2.0)])
def test_a_samples_rerendered_video_is_the_same_alone_and_in_a_batch(context_time, guidance):
    sampler = tiny_sampler()
    kwargs = dict(switch_renoise=0.75, context_time=context_time, guidance_scale=guidance)
    both, _ = stream(sampler, **kwargs)
    alone, _ = stream(sampler, prompts=PROMPTS[1:], seeds=(1,), switched=SWITCHED[1:], **kwargs)
    for a, b in zip(both, alone):
        torch.testing.assert_close(a.latents[1:], b.latents, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("context_time", [0.0, 0.25])
def test_the_stream_draws_the_plain_switchs_noise_and_the_rerender_its_own(monkeypatch, context_time):
    """Every draw of the stream's ``StreamNoise`` (initial latents, re-noising, context noise) is the plain switch's
    value for value: the re-render draws from generators of its own."""
    sampler = tiny_sampler()
    drawn = []
    draw = rules.StreamNoise.draw
    monkeypatch.setattr(rules.StreamNoise, "draw", lambda self, frames: drawn.append(draw(self, frames)) or drawn[-1])
    stream(sampler, context_time=context_time)
    plain, drawn[:] = list(drawn), []
    stream(sampler, context_time=context_time, switch_renoise=0.5)
    assert len(drawn) == len(plain) and all(torch.equal(a, b) for a, b in zip(plain, drawn))


def test_a_switch_renoise_outside_context_time_to_one_is_refused_in_one_line():
    sampler = tiny_sampler()
    for context_time, s in ((0.0, 0.0), (0.0, 1.5), (0.5, 0.5), (0.5, 0.25)):
        with pytest.raises(ValueError, match=r"switch_renoise must lie in \(context_time=.*, 1\]") as error:
            StreamingGenerator(sampler, context_time=context_time, switch_renoise=s)
        assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="needs switch_recache=True"):  # it would be ignored without the re-cache
        StreamingGenerator(sampler, switch_recache=False, switch_renoise=0.5)


@torch.no_grad()
def test_a_one_piece_window_is_rerendered_as_forward_chunk_with_a_fresh_cache_computes():
    """Window of one chunk (2 frames), no sinks, a switch at the last chunk (frame 4 of 6): the re-cache re-renders
    chunk 1 (frames 2-3) alone under the new prompt. Built by hand: its clean latent noised to s with the re-render's
    own generators, the steps [s, 0.5, 0] as non-storing ``forward_chunk`` passes against a fresh cache, the result
    stored at time 0; then chunk 2 from the stream's noise against that cache. The generator's cache and chunk 2 equal
    it (fp32 tolerance)."""
    sampler = tiny_sampler()
    model, s, seeds = sampler.model, 0.75, [0, 1]
    made = []
    new_kv = model.new_kv_cache
    model.new_kv_cache = lambda *a, **k: made.append(new_kv(*a, **k)) or made[-1]
    generator = StreamingGenerator(sampler, step_list=[1.0, 0.5], window_frames=2, switch_renoise=s)
    chunks = list(generator.stream(PROMPTS, seeds, 6, 16, 16, switches=[(4, SWITCHED)]))
    model.new_kv_cache = new_kv
    assert chunks[2].recache["rerender_passes"] == 2 and made[-1].frame_ids == [2, 3]

    text = sampler.encode_text(SWITCHED)[0]
    args = dict(text_emb=text["text_emb"], text_mask=text["text_mask"], pooled=text["pooled"])
    cond = torch.zeros(2, model.cond_channels, 2, 4, 4)
    cache = model.new_kv_cache(2, 0, "absolute")

    def v(x, t, at, store=False):
        return model.forward_chunk(
            x, timestep=torch.full((2,), t), **args, cond=cond, cache=cache, start_frame=at, store_kv=store
        ).float()

    gens = [torch.Generator().manual_seed(rerender_seed(seed, 4)) for seed in seeds]
    x = (1 - s) * chunks[1].latents + s * noise_from_generators(gens, chunks[1].latents.shape[1:])
    x0 = x - s * v(x, s, 2)
    x = 0.5 * x0 + 0.5 * noise_from_generators(gens, x.shape[1:])
    x0 = x - 0.5 * v(x, 0.5, 2)
    v(x0, 0.0, 2, store=True)
    for i in range(len(model.double_blocks) + len(model.single_blocks)):
        for got, want in zip(made[-1].block(i), cache.block(i)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # chunk 2 from the stream's own noise (chunks 0 and 1 drew an initial latent and one re-noise each)
    noise = rules.StreamNoise(seeds, sampler.vae.latent_channels, (4, 4), [1.0, 0.5, 0.0], "renoise", 0.0)
    for _ in range(4):
        noise.draw(2)
    x = noise.initial(2)
    x0 = x - v(x, 1.0, 4)
    x = 0.5 * x0 + 0.5 * noise.for_step(0, 2)
    x0 = x - 0.5 * v(x, 0.5, 4)
    torch.testing.assert_close(chunks[2].latents, x0, rtol=1e-5, atol=1e-5)
