"""The Triton kernels of opensora/models/mmdit/fused.py against the eager code they replace.

- Always: ``fused_kernels=True`` where the kernels cannot run gives exactly the eager model (the fallback).
- With Triton on CPU (``TRITON_INTERPRET=1`` and triton installed; skipped otherwise): each kernel's forward and
  backward equal the eager reference, including the strided q/k views and the chunked shift/scale they read.
- GPU: at the 1B block shapes in bf16, forward outputs and every parameter gradient of a double and a single
  block stay as close to an fp32 eager reference as the bf16 eager block does.
"""

import copy

import pytest
import torch

from opensora.models.mmdit import MMDiT, fused, mmdit_config
from opensora.models.mmdit.layers import DoubleStreamBlock, SingleStreamBlock
from opensora.models.mmdit.rope import rope_cos_sin, video_position_ids

TEXT_DIM, POOLED_DIM = 24, 16

interpreted = pytest.mark.skipif(
    not fused.triton_usable(torch.empty(0)), reason="needs triton with TRITON_INTERPRET=1 on CPU"
)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def tiny_model(**overrides):
    kwargs = dict(mmdit_config("tiny"), text_dim=TEXT_DIM, pooled_dim=POOLED_DIM, **overrides)
    kwargs.pop("type")
    torch.manual_seed(0)
    model = MMDiT(**kwargs)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


def tiny_inputs(batch=2, t=2, h=8, w=8, text_len=6):
    gen = torch.Generator().manual_seed(1)
    return dict(
        x=torch.randn(batch, 12, t, h, w, generator=gen),
        timestep=torch.rand(batch, generator=gen),
        text_emb=torch.randn(batch, text_len, TEXT_DIM, generator=gen),
        text_mask=torch.ones(batch, text_len, dtype=torch.bool),
        pooled=torch.randn(batch, POOLED_DIM, generator=gen),
    )


def output_and_grads(model, inputs):
    model.zero_grad()
    out = model(**inputs)
    (out.float() ** 2).mean().backward()
    return out.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_fused_flag_is_recorded_and_toggles_every_block():
    model = tiny_model(fused_kernels=True)
    assert model.arch["fused_kernels"] is True
    assert all(b.fused for b in [*model.double_blocks, *model.single_blocks])
    model.set_fused_kernels(False)
    assert model.arch["fused_kernels"] is False and not any(b.fused for b in model.single_blocks)


@pytest.mark.skipif(fused.triton_usable(torch.empty(0)), reason="checks the fallback, which Triton replaces here")
def test_fused_flag_without_triton_is_exactly_eager():
    eager = tiny_model()
    on = copy.deepcopy(eager)
    on.set_fused_kernels(True)
    inputs = tiny_inputs()
    out_e, grads_e = output_and_grads(eager, inputs)
    out_f, grads_f = output_and_grads(on, inputs)
    torch.testing.assert_close(out_f, out_e, rtol=0, atol=0)
    assert grads_f.keys() == grads_e.keys()
    for name in grads_e:
        torch.testing.assert_close(grads_f[name], grads_e[name], rtol=1e-6, atol=1e-6, msg=name)


@interpreted
@pytest.mark.parametrize("shape,mod_batch", [((2, 37, 96), 2), ((1, 5, 128), 1), ((2, 9, 64), 1)])
def test_modulate_kernel_matches_eager(shape, mod_batch):
    """Also with one shift/scale row broadcast over a batch of 2 (its grads summed over the batch)."""
    b, n, c = shape
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(b, n, c, generator=gen) * 3 + 1).requires_grad_(True)
    chunks = (torch.randn(mod_batch, 1, 6 * c, generator=gen) * 0.5).chunk(6, dim=-1)  # strided, as Modulation gives
    shift, scale = (t.detach().requires_grad_(True) for t in chunks[:2])
    y, y_ref = fused.modulate(x, shift, scale), fused.modulate_reference(x, shift, scale)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    gy = torch.randn(y.shape, generator=gen)
    grads = torch.autograd.grad(y, (x, shift, scale), gy)
    grads_ref = torch.autograd.grad(y_ref, (x, shift, scale), gy)
    for name, g, r in zip(("x", "shift", "scale"), grads, grads_ref):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4, msg=name)


@interpreted
def test_qk_norm_rope_kernel_matches_eager_on_strided_views():
    b, n_txt, heads, head_dim = 2, 5, 3, 16
    ids = torch.cat([torch.zeros(n_txt, 3, dtype=torch.long), video_position_ids(2, 4, 5)])
    cos, sin = rope_cos_sin(ids, (4, 6, 6), 10000.0)
    n = ids.shape[0]
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(b, n, 3, heads, head_dim, generator=gen).requires_grad_(True)
    q, k, _ = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # the strided views split_heads gives
    scales = [(torch.rand(head_dim, generator=gen) + 0.5).requires_grad_(True) for _ in range(2)]
    out = fused.qk_norm_rope(q, k, *scales, cos, sin)
    ref = fused.qk_norm_rope_reference(q, k, *scales, cos, sin)
    assert all(t.is_contiguous() for t in out)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)
    gys = [torch.randn(t.shape, generator=gen) for t in out]
    grads = torch.autograd.grad(out, (qkv, *scales), gys)
    grads_ref = torch.autograd.grad(ref, (qkv, *scales), gys)
    for name, g, r in zip(("qkv", "query_scale", "key_scale"), grads, grads_ref):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4, msg=name)


@interpreted
def test_fused_model_matches_eager_model_under_the_interpreter():
    eager = tiny_model()
    on = copy.deepcopy(eager)
    on.set_fused_kernels(True)
    inputs = tiny_inputs(batch=1, t=1, h=4, w=4, text_len=3)
    out_e, grads_e = output_and_grads(eager, inputs)
    out_f, grads_f = output_and_grads(on, inputs)
    torch.testing.assert_close(out_f, out_e, rtol=1e-4, atol=1e-4)
    assert grads_f.keys() == grads_e.keys()
    for name in grads_e:
        torch.testing.assert_close(grads_f[name], grads_e[name], rtol=1e-3, atol=1e-3, msg=name)


# --------------------------------------------------------------------------------------------------------- GPU


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def block_errors(block, streams, vec, rope):
    """Relative error of outputs, input grads and parameter grads of ``block`` in bf16 (eager and fused) against
    an fp32 eager copy, all on the same inputs and output gradients."""
    device = torch.device("cuda")
    ref = copy.deepcopy(block).to(device, torch.float32)
    runs = {}
    for name, dtype, fused_on in (("ref", torch.float32, False), ("eager", torch.bfloat16, False), ("fused", torch.bfloat16, True)):  # fmt: skip
        model = ref if name == "ref" else copy.deepcopy(ref).to(dtype)
        model.fused = fused_on
        xs = [t.to(dtype).requires_grad_(True) for t in streams]
        outs = model(*xs, vec.to(dtype), rope, None)
        outs = outs if isinstance(outs, tuple) else (outs,)
        gen = torch.Generator(device=device).manual_seed(7)
        grads_out = [torch.randn(o.shape, device=device, generator=gen).to(o.dtype) for o in outs]
        torch.autograd.backward(outs, grads_out)
        runs[name] = (
            [o.detach() for o in outs],
            {n: p.grad.detach() for n, p in model.named_parameters()},
            [t.grad.detach() for t in xs],
        )
    errors = {}
    for name in ("eager", "fused"):
        outs, grads, input_grads = runs[name]
        errors[name] = {f"out{i}": rel_err(o, r) for i, (o, r) in enumerate(zip(outs, runs["ref"][0]))}
        errors[name].update({f"dinput{i}": rel_err(g, r) for i, (g, r) in enumerate(zip(input_grads, runs["ref"][2]))})
        errors[name].update({n: rel_err(g, runs["ref"][1][n]) for n, g in grads.items()})
    return errors


@pytest.mark.gpu
@cuda
@pytest.mark.skipif(fused.triton is None, reason="needs triton")
@pytest.mark.parametrize("kind", ["double", "single"])
def test_fused_block_matches_eager_in_bf16_at_1b_shape_on_gpu(kind):
    """1B shapes (hidden 1536, 12 x 128 heads, 8448 video + 512 text tokens), batch 1, bf16: the fused block's
    outputs, input grads and parameter grads are within bf16 tolerance of an fp32 reference, i.e. no worse than
    1.5x the eager bf16 block's own error plus 2e-3."""
    torch.manual_seed(0)
    hidden, heads, n_txt, n_img = 1536, 12, 512, 8448
    block = DoubleStreamBlock(hidden, heads, 4.0) if kind == "double" else SingleStreamBlock(hidden, heads, 4.0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.02)
    device = torch.device("cuda")
    ids = torch.cat([torch.zeros(n_txt, 3, dtype=torch.long), video_position_ids(8, 32, 33)]).to(device)
    rope = rope_cos_sin(ids, (16, 56, 56), 10000.0)
    vec = torch.randn(1, hidden, device=device)
    if kind == "double":
        streams = [torch.randn(1, n_img, hidden, device=device), torch.randn(1, n_txt, hidden, device=device)]
    else:
        streams = [torch.randn(1, n_txt + n_img, hidden, device=device)]
    errors = block_errors(block, streams, vec, rope)
    bad = {n: (errors["fused"][n], e) for n, e in errors["eager"].items() if errors["fused"][n] > 1.5 * e + 2e-3}
    assert not bad, f"fused worse than eager (fused, eager rel. err. vs fp32): {bad}"
