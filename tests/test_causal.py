"""Causal MMDiT and the streaming KV cache: chunk-by-chunk streaming reproduces the full block-causal forward,
the attention pattern is the one documented in causal.py, the rolling window bounds the cache, gradients
reach the chunk but not the cache, and the adapter's streaming verbs agree with its full-video verbs.

Exactness: with the ``math`` attention backend the streamed chunk and the full forward run the same operations
in the same order (the full forward's masked keys contribute exact zeros), so the outputs are bit-identical.
PyTorch's own CPU choice (``auto``: a blocked flash kernel) splits keys into blocks whose boundaries differ
between a chunk's key sequence and the full one, so its sums are reordered: there we bound the difference
(relative 1e-5 of the output scale; measured ~5e-7).
"""

import pytest
import torch
from test_mmdit import inputs, perturb, tiny_kwargs

from opensora.models.mmdit import MMDiT
from opensora.models.mmdit.causal import KVCache

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py


def causal_model(chunk=2, backend="math", patch_size=(1, 2, 2), seed=0, **overrides):
    model = MMDiT(
        **tiny_kwargs(causal_chunk_frames=chunk, attn_backend=backend, patch_size=patch_size, **overrides)
    ).eval()
    perturb(model, seed=seed)
    return model


def padded_inputs(t=8, seed=0, batch=2):
    data = inputs(t=t, seed=seed, batch=batch)
    data["text_mask"][0, -2:] = False  # sample 0 has two padded text tokens
    data["cond"] = torch.randn(batch, 5, t, 8, 8, generator=torch.Generator().manual_seed(seed + 1))
    return data


def text_kwargs(data, **overrides):
    """The forward keywords of ``data`` other than x and cond."""
    return dict({key: data[key] for key in ("timestep", "text_emb", "text_mask", "pooled")}, **overrides)


def stream(model, data, chunk, cache=None, store=True):
    """Chunk-by-chunk velocities through ``forward_chunk``, concatenated over time."""
    cache = cache if cache is not None else model.new_kv_cache()
    outs = []
    for start in range(0, data["x"].shape[2], chunk):
        piece = slice(start, start + chunk)
        outs.append(
            model.forward_chunk(
                data["x"][:, :, piece],
                **text_kwargs(data),
                cond=data["cond"][:, :, piece],
                cache=cache,
                start_frame=start,
                store_kv=store,
            )
        )
    return torch.cat(outs, dim=2), cache


@pytest.mark.parametrize("patch_size", [(1, 2, 2), (2, 2, 2)])
def test_streaming_equals_full_causal_forward_bitwise_with_math_attention(patch_size):
    chunk = 2 * patch_size[0]
    model = causal_model(chunk=chunk, patch_size=patch_size)
    data = padded_inputs(t=4 * chunk)
    with torch.no_grad():
        full = model(**data)
        streamed, cache = stream(model, data, chunk)
        again, _ = stream(model, data, chunk)
    assert streamed.dtype == full.dtype == torch.float32
    assert torch.equal(streamed, full), (streamed - full).abs().max()
    assert torch.equal(again, streamed)  # repeated runs are identical
    assert cache.num_frames == 4 * chunk and cache.frame_ids == list(range(4 * chunk))


def test_streaming_matches_full_forward_with_the_default_cpu_attention_kernel():
    model = causal_model(backend="auto")
    data = padded_inputs()
    with torch.no_grad():
        full = model(**data)
        streamed, _ = stream(model, data, 2)
        again, _ = stream(model, data, 2)
    scale = full.abs().max()
    assert (streamed - full).abs().max() <= 1e-5 * scale
    assert torch.equal(again, streamed)


def test_long_padded_prompts_are_trimmed_exactly_in_the_full_forward_and_its_gradients():
    """40 text columns with 3 and 9 valid: the full causal forward trims them to 32 (text_padding.py); it equals the
    untrimmed streamed chunks (which keep all 40 behind the dense mask) and, with gradients, each prompt alone."""
    model = causal_model(backend="auto").train()
    data = padded_inputs(t=4)
    gen = torch.Generator().manual_seed(7)
    data["text_emb"] = torch.randn(2, 40, data["text_emb"].shape[2], generator=gen)
    data["text_mask"] = torch.arange(40)[None] < torch.tensor([[3], [9]])
    with torch.no_grad():
        streamed, _ = stream(model, data, 2)
    full = model(**data)
    assert (full - streamed).abs().max() <= 1e-5 * streamed.abs().max()
    full.square().sum().backward()
    batched = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for row, length in enumerate((3, 9)):  # gradients accumulate: the sum over the two prompts alone
        alone = {k: v[row : row + 1] for k, v in data.items() if k != "text_mask"}
        alone["text_emb"] = alone["text_emb"][:, :length]
        model(**alone).square().sum().backward()
    for name, p in model.named_parameters():  # float reordering only (CPU flash blocks keys by count): ~1e-4 worst
        error, scale = (p.grad - batched[name]).abs().max(), batched[name].abs().max()
        assert error <= 1e-3 * scale, (name, error, scale)


def test_chunks_see_the_past_and_not_the_future():
    model = causal_model()
    data = padded_inputs()
    changed = dict(data, x=data["x"].clone())
    changed["x"][:, :, 4:6] += 1.0  # chunk 2 of 4
    with torch.no_grad():
        before, after = model(**data), model(**changed)
    assert torch.equal(before[:, :, :4], after[:, :, :4])  # chunks 0-1 do not see chunk 2
    assert not torch.allclose(before[:, :, 6:], after[:, :, 6:])  # chunk 3 does


def test_text_stream_ignores_video_so_one_chunk_equals_bidirectional_with_text_rows_masked():
    """With one chunk spanning all frames the only difference to the bidirectional model is that text queries do
    not see video keys. Reference: the bidirectional weights with that mask written out by hand."""
    data = padded_inputs(t=4)
    causal = causal_model(chunk=4)
    bidirectional = MMDiT(**tiny_kwargs(attn_backend="math")).eval()
    bidirectional.load_state_dict(causal.state_dict())
    n_text, n_video = data["text_emb"].shape[1], 4 * 4 * 4
    mask = torch.zeros(2, 1, n_text + n_video, n_text + n_video, dtype=torch.bool)
    for b in range(2):
        for q in range(n_text + n_video):
            for k in range(n_text + n_video):
                key_valid = k >= n_text or bool(data["text_mask"][b, k])
                mask[b, 0, q, k] = key_valid and (q >= n_text or k < n_text)
    with torch.no_grad():
        img, txt, vec, grid = bidirectional.embed(
            data["x"], data["timestep"], data["text_emb"], data["pooled"], data["cond"]
        )
        rope = bidirectional.rope(grid, n_text, data["x"].device)
        from opensora.models.mmdit.model import unpatchify

        reference = unpatchify(bidirectional.run_blocks(img, txt, vec, rope, mask), grid, (1, 2, 2))
        assert torch.equal(causal(**data), reference)
        assert not torch.allclose(bidirectional(**data), reference, atol=1e-4)  # there text attends video


def test_rolling_window_with_sinks_bounds_the_cache_and_keeps_the_right_frames():
    model = causal_model()
    data = padded_inputs(t=32)  # 16 chunks: 4x a "training length" of 8 frames
    window, sinks = 6, 2
    sizes = []
    cache = model.new_kv_cache(window_frames=window, sink_frames=sinks)
    full_cache = model.new_kv_cache()
    with torch.no_grad():
        for start in range(0, 32, 2):
            piece = slice(start, start + 2)
            model.forward_chunk(
                data["x"][:, :, piece],
                **text_kwargs(data),
                cond=data["cond"][:, :, piece],
                cache=cache,
                start_frame=start,
                store_kv=True,
            )
            sizes.append((cache.num_frames, cache.nbytes))
            if start == 12:  # the same chunks once more into an unbounded cache, to compare what the window kept
                for s in range(0, 14, 2):
                    p = slice(s, s + 2)
                    model.forward_chunk(
                        data["x"][:, :, p],
                        **text_kwargs(data),
                        cond=data["cond"][:, :, p],
                        cache=full_cache,
                        start_frame=s,
                        store_kv=True,
                    )
                kept = [0, 1, 10, 11, 12, 13]
                assert cache.frame_ids == kept
                tokens_per_frame = 16
                index = torch.cat([torch.arange(f * tokens_per_frame, (f + 1) * tokens_per_frame) for f in kept])
                # the first block's keys/values depend on their own frame only; the sinks were stored before any
                # trimming, so they agree in every block
                assert torch.equal(cache.keys[0], full_cache.keys[0][:, :, index])
                assert torch.equal(cache.values[0], full_cache.values[0][:, :, index])
                for i in range(cache.num_blocks):
                    assert torch.equal(cache.keys[i][:, :, :32], full_cache.keys[i][:, :, :32])
    assert max(frames for frames, _ in sizes) == window
    steady = [nbytes for frames, nbytes in sizes if frames == window]
    assert len(steady) == 14 and len(set(steady)) == 1  # flat from the window's first fill to 4x the length
    assert cache.frame_ids == [0, 1, 28, 29, 30, 31]


def test_store_kv_false_leaves_the_cache_untouched_and_denoising_steps_repeat():
    model = causal_model()
    data = padded_inputs()
    with torch.no_grad():
        _, cache = stream(model, dict(data, x=data["x"][:, :, :4], cond=data["cond"][:, :, :4]), 2)
        keys = [k.clone() for k in cache.keys]
        args = dict(text_kwargs(data), cond=data["cond"][:, :, 4:6], cache=cache, store_kv=False)
        first = model.forward_chunk(data["x"][:, :, 4:6], **args, start_frame=4)
        second = model.forward_chunk(data["x"][:, :, 4:6], **args, start_frame=4)
    assert torch.equal(first, second)
    assert cache.num_frames == 4 and all(torch.equal(a, b) for a, b in zip(keys, cache.keys))
    with pytest.raises(ValueError, match="overlaps the cache"):
        model.forward_chunk(data["x"][:, :, 4:6], **args, start_frame=2)


@pytest.mark.parametrize("grad_ckpt", [0, 1])
def test_gradients_reach_the_chunk_and_not_the_cache(grad_ckpt):
    model = causal_model(grad_ckpt_double=grad_ckpt, grad_ckpt_single=grad_ckpt).train()
    data = padded_inputs()
    with torch.no_grad():
        _, cache = stream(model, dict(data, x=data["x"][:, :, :4], cond=data["cond"][:, :, :4]), 2)
    x = data["x"][:, :, 4:6].clone().requires_grad_(True)
    out = model.forward_chunk(
        x, **text_kwargs(data), cond=data["cond"][:, :, 4:6], cache=cache, start_frame=4, store_kv=True
    )
    out.square().mean().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert all(p.grad is not None for p in model.img_in.parameters())
    assert cache.num_frames == 6  # checkpoint recomputation did not store the chunk twice
    assert not any(k.requires_grad for k in cache.keys + cache.values)


def test_kv_cache_bookkeeping_and_errors():
    with pytest.raises(ValueError, match="sink_frames"):
        KVCache(4, window_frames=2, sink_frames=3)
    cache = KVCache(2, sink_frames=1)

    def kv(frames):
        return {i: (torch.ones(1, 2, frames * 3, 4), torch.ones(1, 2, frames * 3, 4)) for i in range(2)}

    cache.append(kv(2), start_frame=0, num_frames=2)
    cache.append(kv(2), start_frame=2, num_frames=2)
    assert cache.num_frames == 4 and cache.end_frame == 4 and cache.nbytes == 2 * 2 * 4 * 12 * 8 * 4 // 4
    cache.trim(3)
    assert cache.frame_ids == [0, 2, 3] and cache.keys[0].shape[2] == 9
    with pytest.raises(ValueError, match="overlap"):
        cache.append(kv(2), start_frame=2, num_frames=2)
    cache.clear()
    assert cache.num_frames == 0 and cache.end_frame == 0 and cache.nbytes == 0
    with pytest.raises(ValueError, match="causal"):
        MMDiT(**tiny_kwargs()).forward_chunk(**inputs(), cache=cache, start_frame=0, store_kv=False)
    with pytest.raises(ValueError, match="multiple"):
        MMDiT(**tiny_kwargs(causal_chunk_frames=3, patch_size=(2, 2, 2)))
    with pytest.raises(ValueError, match="flash"):
        MMDiT(**tiny_kwargs(causal_chunk_frames=2, attn_backend="flash"))


class _Handle:
    """The two things an adapter uses of a role: ``model`` (maybe wrapped) and ``unwrap()``."""

    def __init__(self, model):
        self.model = model

    def unwrap(self):
        return self.model


def test_adapter_streaming_x0_matches_its_full_video_x0_and_reports_the_capability():
    from types import SimpleNamespace

    from opensora.adapters.mmdit import MMDiTAdapter
    from opensora.registry import MODELS, build_module

    vae = build_module(dict(type="PatchVAE", patch_size=4, temporal_patch_size=1), MODELS).eval()
    text = build_module(dict(type="TextConditioner", seed=0), MODELS)
    comp = SimpleNamespace(vae=vae, text_encoder=text, device=torch.device("cpu"), null_text=text.null_embeddings(1))
    adapter = MMDiTAdapter(comp)
    arch = dict(
        in_channels=48,
        cond_channels=49,
        hidden_size=32,
        num_heads=2,
        depth_double=1,
        depth_single=1,
        mlp_ratio=2.0,
        text_dim=64,
        pooled_dim=64,
        axes_dims=(4, 6, 6),
        attn_backend="math",
    )
    network = MMDiT(**arch, causal_chunk_frames=2).eval()
    perturb(network, seed=2)
    handle = _Handle(network)
    assert "streaming" in adapter.capabilities_for(handle)
    assert "streaming" not in adapter.capabilities_for(_Handle(MMDiT(**arch)))
    batch = adapter.prepare_batch(dict(video=torch.zeros(2, 3, 6, 16, 16), text=["a red circle", "a blue square"]))
    noisy, t = torch.randn(batch.latent_shape), torch.tensor([0.7, 0.4])
    with torch.no_grad():
        for conditional in (True, False):
            full = adapter.predict_x0(handle, noisy, t, batch, conditional=conditional)
            cache = adapter.new_kv_cache(handle, batch)
            chunks = [
                adapter.predict_x0_streaming(
                    handle,
                    noisy[:, :, s : s + 2],
                    t,
                    batch,
                    cache,
                    start_frame=s,
                    store_kv=True,
                    conditional=conditional,
                )
                for s in (0, 2, 4)
            ]
            assert torch.equal(torch.cat(chunks, dim=2), full)
            assert chunks[0].dtype == torch.float32 and cache.num_frames == 6
    with pytest.raises(ValueError, match="causal"):
        adapter.new_kv_cache(_Handle(MMDiT(**arch)), batch)


def test_per_chunk_timesteps_match_streaming_each_chunk_at_its_own_time():
    """Diffusion forcing / causal ODE init: timestep [B, num_chunks]. Reference: stream the chunks, chunk c at
    time t[:, c], storing each chunk's keys/values at that same time."""
    model = causal_model()
    data = padded_inputs()
    times = torch.rand(2, 4, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(**dict(data, timestep=times))
        cache, outs = model.new_kv_cache(), []
        for c in range(4):
            piece = slice(2 * c, 2 * c + 2)
            outs.append(
                model.forward_chunk(
                    data["x"][:, :, piece],
                    **text_kwargs(data, timestep=times[:, c]),
                    cond=data["cond"][:, :, piece],
                    cache=cache,
                    start_frame=2 * c,
                    store_kv=True,
                )
            )
        same_time = model(**dict(data, timestep=data["timestep"][:, None].expand(2, 4)))
        uniform = model(**data)
    # Not bit-exact: the conditioning vectors here come from one [B * n, hidden] matmul and in streaming from n
    # [B, hidden] ones, and CPU GEMM kernels for such tiny row counts sum in a row-count-dependent order
    # (measured: modulation outputs differ by 2e-5, the velocity by ~1e-6 of its scale).
    streamed = torch.cat(outs, dim=2)
    assert (full - streamed).abs().max() <= 1e-5 * streamed.abs().max()
    assert (same_time - uniform).abs().max() <= 1e-5 * uniform.abs().max()
    with pytest.raises(ValueError, match="per-chunk timesteps"):
        model(**dict(data, timestep=times[:, :3]))


def test_per_chunk_timestep_forward_backpropagates_through_the_context():
    model = causal_model().train()
    data = padded_inputs()
    x = data["x"].clone().requires_grad_(True)
    out = model(**dict(data, x=x, timestep=torch.rand(2, 4)))
    out[:, :, 6:].square().mean().backward()  # loss on the last chunk only
    assert x.grad[:, :, :6].abs().sum() > 0  # reaches the earlier chunks through their keys/values


# ---- the causal text cache (TextKVCache): pure reuse of the text stream, bit-identical -------------------------
def stream_steps(model, data, times, text_cache=None, window=None, chunk=2):
    """Every chunk at every time of ``times`` (the last one stores, as the streaming refill does); all outputs."""
    cache = model.new_kv_cache(window_frames=window)
    outs = []
    for start in range(0, data["x"].shape[2], chunk):
        piece = slice(start, start + chunk)
        for i, t in enumerate(times):
            kwargs = text_kwargs(data, timestep=torch.full((data["x"].shape[0],), t))
            outs.append(
                model.forward_chunk(
                    data["x"][:, :, piece],
                    **kwargs,
                    cond=data["cond"][:, :, piece],
                    cache=cache,
                    start_frame=start,
                    store_kv=i == len(times) - 1,
                    text_cache=text_cache,
                    text_key=t,
                )
            )
    return outs, cache


@pytest.mark.parametrize("backend,patch_size", [("math", (1, 2, 2)), ("auto", (1, 2, 2)), ("math", (2, 2, 2))])
def test_text_cache_is_bitwise_the_uncached_streaming(backend, patch_size):
    """Chunks x (3 step times + the refill at 0), batch 2 with padded text, a rolling window: equal with torch.equal,
    and the KV caches match too. Only the first chunk computes text (one miss per distinct time)."""
    chunk = 2 * patch_size[0]
    model = causal_model(chunk=chunk, backend=backend, patch_size=patch_size)
    data = padded_inputs(t=4 * chunk)
    times = [1.0, 0.6, 0.3, 0.0]
    text_cache = model.new_text_cache()
    with torch.no_grad():
        plain, plain_cache = stream_steps(model, data, times, window=2 * chunk, chunk=chunk)
        cached, cached_cache = stream_steps(model, data, times, text_cache, window=2 * chunk, chunk=chunk)
    assert all(torch.equal(a, b) for a, b in zip(plain, cached))
    assert all(
        torch.equal(a, b)
        for a, b in zip(plain_cache.keys + plain_cache.values, cached_cache.keys + cached_cache.values)
    )
    assert (text_cache.misses, text_cache.hits) == (4, 12) and sorted(text_cache.entries) == sorted(times)
    blocks = len(model.double_blocks) + len(model.single_blocks)
    hidden, text_len = model.hidden_size, data["text_emb"].shape[1]
    assert text_cache.nbytes == len(times) * blocks * 2 * 2 * text_len * hidden * 4  # rows 2, k and v, fp32


def test_text_cache_cfg_rows_share_one_entry_and_the_null_text_is_its_own_rows():
    """CFG as the streaming generator runs it: [prompts; null text] as rows of one batch. A batch whose text differs
    (another prompt set: new tensors) drops the entries and refills."""
    model = causal_model()
    data = padded_inputs(t=6, batch=2)
    null = dict(
        text_emb=torch.zeros_like(data["text_emb"]),
        pooled=torch.zeros_like(data["pooled"]),
        text_mask=torch.ones_like(data["text_mask"]),
    )
    both = dict(
        data,
        x=torch.cat([data["x"]] * 2),
        cond=torch.cat([data["cond"]] * 2),
        **{k: torch.cat((data[k], null[k])) for k in null},
    )
    text_cache = model.new_text_cache()
    with torch.no_grad():
        plain, _ = stream_steps(model, both, [1.0, 0.0])
        cached, _ = stream_steps(model, both, [1.0, 0.0], text_cache)
        assert all(torch.equal(a, b) for a, b in zip(plain, cached))
        assert text_cache.misses == 2 and text_cache.entries[1.0][0][0].shape[0] == 4
        other = dict(both, text_emb=both["text_emb"].flip(0))  # a new prompt set: new tensors
        plain2, _ = stream_steps(model, other, [1.0, 0.0])
        cached2, _ = stream_steps(model, other, [1.0, 0.0], text_cache)
    assert text_cache.misses == 4  # invalidated, refilled once per time
    assert all(torch.equal(a, b) for a, b in zip(plain2, cached2))
    assert not torch.equal(plain2[-1], plain[-1])


def test_text_cache_is_invalidated_by_in_place_text_edits_weights_and_dtype():
    model = causal_model()
    data = padded_inputs(t=4)
    text_cache = model.new_text_cache()

    def run():
        with torch.no_grad():
            return stream_steps(model, data, [1.0, 0.0], text_cache)[0]

    run()
    assert text_cache.misses == 2
    run()  # same tensors, same weights: every pass hits
    assert text_cache.misses == 2 and text_cache.hits == 6
    data["text_emb"].mul_(0.5)  # edited in place: the version counter moves
    assert all(torch.equal(a, b) for a, b in zip(run(), stream_steps(model, data, [1.0, 0.0])[0]))
    assert text_cache.misses == 4
    with torch.no_grad():
        model.double_blocks[0].txt_mlp[0].weight.mul_(1.1)  # a training step between videos
    with torch.no_grad():
        expected = stream_steps(model, data, [1.0, 0.0])[0]
    assert all(torch.equal(a, b) for a, b in zip(run(), expected)) and text_cache.misses == 6
    model.double()
    data64 = {k: v.double() if v.is_floating_point() else v for k, v in data.items()}
    with torch.no_grad():
        out = stream_steps(model, data64, [1.0, 0.0], text_cache)[0]
        expected = stream_steps(model, data64, [1.0, 0.0])[0]
    assert text_cache.misses == 8 and text_cache.entries[1.0][0][0].dtype == torch.float64  # refilled in fp64
    # fp64 CPU GEMMs round rows differently when the row count changes (measured ~5e-14), unlike fp32 ones
    assert all((a - b).abs().max() <= 1e-12 * b.abs().max() for a, b in zip(out, expected))
    with pytest.raises(ValueError, match="text_key"):
        model.forward_chunk(
            data64["x"][:, :, :2],
            **text_kwargs(data64),
            cache=model.new_kv_cache(),
            start_frame=0,
            store_kv=False,
            text_cache=text_cache,
        )
