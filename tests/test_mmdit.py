"""MMDiT: shapes, adaLN-zero start, condition input, text padding, RoPE, checkpointing, learning, sizes, FLOPs."""

import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from opensora.models.mmdit import MMDIT_CONFIGS, MMDiT, attention, mmdit_config, mmdit_forward_flops, mmdit_train_flops
from opensora.models.mmdit.rope import apply_rope, rope_cos_sin, video_position_ids
from opensora.registry import MODELS, build_module

TEXT_DIM, POOLED_DIM = 24, 16


def tiny_kwargs(**overrides):
    cfg = mmdit_config(
        "tiny",
        text_dim=TEXT_DIM,
        pooled_dim=POOLED_DIM,
        in_channels=4,
        cond_channels=5,
        hidden_size=64,
        num_heads=2,
        axes_dims=(8, 12, 12),
    )
    cfg.pop("type")
    cfg.update(overrides)
    return cfg


def perturb(model: torch.nn.Module, seed: int = 0, skip=()) -> None:
    """Give every parameter (zero-initialised ones too) random values, so outputs depend on every input."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not any(name.startswith(s) for s in skip):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def inputs(batch=2, c=4, t=2, h=8, w=8, text_len=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return dict(
        x=torch.randn(batch, c, t, h, w, generator=gen),
        timestep=torch.rand(batch, generator=gen),
        text_emb=torch.randn(batch, text_len, TEXT_DIM, generator=gen),
        text_mask=torch.ones(batch, text_len, dtype=torch.bool),
        pooled=torch.randn(batch, POOLED_DIM, generator=gen),
    )


@pytest.mark.parametrize("patch_size,out_channels", [((1, 1, 1), None), ((1, 2, 2), 6), ((2, 2, 2), None)])
def test_output_shape(patch_size, out_channels):
    model = MMDiT(**tiny_kwargs(patch_size=patch_size, out_channels=out_channels))
    perturb(model)
    batch = inputs(t=4, h=8, w=12)
    out = model(**batch)
    assert out.shape == (2, out_channels or 4, 4, 8, 12)
    assert out.abs().sum() > 0


def test_registry_build_and_bad_shapes():
    model = build_module(dict(type="MMDiT", **tiny_kwargs()), MODELS)
    assert isinstance(model, MMDiT)
    with pytest.raises(ValueError, match="not divisible by patch_size"):
        model(**inputs(h=7))
    with pytest.raises(ValueError, match="axes_dims"):
        MMDiT(**tiny_kwargs(axes_dims=(8, 8, 8)))


def test_fresh_model_outputs_zero_and_ignores_cond():
    torch.manual_seed(0)
    model = MMDiT(**tiny_kwargs())
    batch = inputs()
    cond = torch.randn(2, 5, 2, 8, 8)
    assert torch.equal(model(**batch), torch.zeros_like(batch["x"]))
    # Everything but the zero-initialised condition projection becomes non-trivial: cond must still not matter.
    perturb(model, skip=("cond_in",))
    without = model(**batch)
    assert without.abs().mean() > 1e-3
    torch.testing.assert_close(model(**batch, cond=cond), without, rtol=0, atol=0)
    perturb(model)  # once cond_in is trained, the condition does change the output
    assert not torch.allclose(model(**batch, cond=cond), model(**batch))


def test_text_padding_is_not_attended():
    torch.manual_seed(0)
    model = MMDiT(**tiny_kwargs()).eval()
    perturb(model)
    valid = 4
    batch = inputs(text_len=7)
    batch["text_mask"][:, valid:] = False
    with torch.no_grad():
        out = model(**batch)
        changed = dict(batch, text_emb=batch["text_emb"].clone())
        changed["text_emb"][:, valid:] = torch.randn_like(changed["text_emb"][:, valid:]) * 10
        torch.testing.assert_close(model(**changed), out, rtol=1e-5, atol=1e-5)
        # Reference: the same prompt without padding (no mask at all, the fast path) gives the same output.
        trimmed = dict(batch, text_emb=batch["text_emb"][:, :valid], text_mask=batch["text_mask"][:, :valid])
        torch.testing.assert_close(model(**trimmed), out, rtol=1e-4, atol=1e-4)
        # And a valid token does matter.
        changed["text_emb"][:, 0] += 1
        assert not torch.allclose(model(**changed), out, atol=1e-4)
    assert MMDiT.key_mask(torch.ones(2, 5, dtype=torch.bool), 10) is None


def test_rope_matches_complex_reference_and_is_relative():
    torch.manual_seed(0)
    axes = (4, 6, 6)
    ids = video_position_ids(3, 4, 5)
    q, k = torch.randn(2, 60, 16), torch.randn(2, 60, 16)
    cos, sin = rope_cos_sin(ids, axes, 10000.0)
    # Reference: channel pairs as complex numbers multiplied by exp(i * pos * freq) per axis.
    freqs = torch.cat([10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d) for d in axes])
    axis_of = torch.repeat_interleave(torch.arange(3), torch.tensor(axes) // 2)
    angle = ids[:, axis_of].double() * freqs
    ref = torch.view_as_real(
        torch.view_as_complex(q.double().unflatten(-1, (-1, 2)).contiguous())
        * torch.polar(torch.ones_like(angle), angle)
    ).flatten(-2)
    torch.testing.assert_close(apply_rope(q, cos, sin), ref.float(), rtol=1e-5, atol=1e-5)
    # Shifting every position by the same (t, h, w) offset leaves all q.k dot products unchanged.
    scores = apply_rope(q, cos, sin) @ apply_rope(k, cos, sin).transpose(-1, -2)
    cos2, sin2 = rope_cos_sin(ids + torch.tensor([7, -3, 11]), axes, 10000.0)
    shifted = apply_rope(q, cos2, sin2) @ apply_rope(k, cos2, sin2).transpose(-1, -2)
    torch.testing.assert_close(shifted, scores, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(scores, q @ k.transpose(-1, -2), atol=1e-2)  # it does rotate
    cos0, sin0 = rope_cos_sin(torch.zeros(5, 3, dtype=torch.long), axes, 10000.0)  # text ids: identity
    torch.testing.assert_close(apply_rope(q[:, :5], cos0, sin0), q[:, :5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_eager_complex_form_matches_real_form_and_its_gradient(dtype):
    """The eager complex-multiply RoPE and the real-arithmetic form compiled code uses: same values and grads, also
    on a strided [B, heads, N, D] view like the ones split_heads returns."""
    from opensora.models.mmdit.rope import _apply_rope_real

    torch.manual_seed(0)
    cos, sin = rope_cos_sin(video_position_ids(2, 3, 4), (4, 6, 6), 10000.0)
    qkv = torch.randn(2, 24, 3, 2, 16).to(dtype)  # [B, N, 3, heads, D] like a fused qkv projection
    x1 = qkv.clone().requires_grad_()
    x2 = qkv.clone().requires_grad_()
    q1, q2 = x1.permute(2, 0, 3, 1, 4)[0], x2.permute(2, 0, 3, 1, 4)[0]
    out1, out2 = apply_rope(q1, cos, sin), _apply_rope_real(q2, cos, sin)
    assert out1.dtype == out2.dtype == dtype and out1.shape == out2.shape == (2, 2, 24, 16)
    # bf16: both round the same fp32 result, so they differ by at most one bf16 rounding step
    torch.testing.assert_close(out1, out2, **(dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else {}))
    weight = torch.randn(out1.shape).to(dtype)
    (out1.float() * weight).sum().backward()
    (out2.float() * weight).sum().backward()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(x1.grad, x2.grad, **tol)
    assert x1.grad[:, :, 1:].abs().sum() == 0  # only the q slice of the fused tensor gets a gradient


def test_gradient_checkpointing_is_exact():
    torch.manual_seed(0)
    plain = MMDiT(**tiny_kwargs())
    perturb(plain)
    ckpt = copy.deepcopy(plain)
    ckpt.set_grad_ckpt(2, 1)
    batch = inputs()
    batch["text_mask"][0, 4:] = False
    cond = torch.randn(2, 5, 2, 8, 8)
    losses = []
    for model in (plain, ckpt):
        model.train()
        loss = model(**batch, cond=cond).square().mean()
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
    for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_few_steps_reduce_flow_matching_loss():
    torch.manual_seed(0)
    model = MMDiT(**tiny_kwargs(grad_ckpt_double=1, grad_ckpt_single=1)).train()
    batch = inputs(seed=1)
    batch["text_mask"][1, 3:] = False
    x0, noise = batch.pop("x"), torch.randn(2, 4, 2, 8, 8, generator=torch.Generator().manual_seed(2))
    t = batch["timestep"].view(-1, 1, 1, 1, 1)
    x_t, target = (1 - t) * x0 + t * noise, noise - x0
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    losses = []
    for _ in range(40):
        loss = (model(x_t, **batch) - target).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def closed_form_params(
    hidden, heads, depth_double, depth_single, mlp_ratio, in_ch, cond_ch, patch, text_dim, pooled_dim, out_ch=None
):
    """Parameter count of the Flux/Open-Sora-2.0 MMDiT written out from the architecture (biases included)."""
    h, m, hd = hidden, int(hidden * mlp_ratio), hidden // heads
    lin = lambda i, o: i * o + o
    stream = lin(h, 6 * h) + lin(h, 3 * h) + 2 * hd + lin(h, h) + lin(h, m) + lin(m, h)
    double = 2 * stream
    single = lin(h, 3 * h + m) + lin(h + m, h) + 2 * hd + lin(h, 3 * h)
    embed = lin(in_ch * patch, h) + lin(text_dim, h) + lin(256, h) + lin(h, h) + lin(pooled_dim, h) + lin(h, h)
    if cond_ch:
        embed += lin(cond_ch * patch, h)
    final = lin(h, 2 * h) + lin(h, (out_ch or in_ch) * patch)
    return embed + depth_double * double + depth_single * single + final


def count_on_meta(name):
    cfg = mmdit_config(name)
    with torch.device("meta"):
        model = build_module(cfg, MODELS)
    got = sum(p.numel() for p in model.parameters())
    expected = closed_form_params(
        cfg["hidden_size"],
        cfg["num_heads"],
        cfg["depth_double"],
        cfg["depth_single"],
        cfg["mlp_ratio"],
        cfg["in_channels"],
        cfg["cond_channels"],
        4,
        cfg["text_dim"],
        cfg["pooled_dim"],
    )
    print(f"MMDiT {name}: {got:,} parameters (closed form {expected:,})")
    assert got == expected
    return got


def test_11b_shape_parameter_count_on_meta():
    # Open-Sora 2.0 reports ~11B; its Flux-dev-shaped MMDiT has 11.8-11.9B with the condition input.
    assert 11.0e9 < count_on_meta("11b") < 12.5e9


def test_1b_parameter_count():
    # diffusers FluxTransformer2DModel at 8+16 blocks, 12x128 has 1.26B.
    assert 1.2e9 < count_on_meta("1b") < 1.4e9


def test_flops_match_flop_counter():
    torch.manual_seed(0)
    model = MMDiT(**tiny_kwargs(attn_backend="math", patch_size=(1, 2, 2)))
    perturb(model)
    batch = inputs(batch=2, t=2, h=8, w=8, text_len=6)
    cond = torch.randn(2, 5, 2, 8, 8)
    num_video, num_text = 2 * 4 * 4, 6
    with FlopCounterMode(display=False) as counter:
        out = model(**batch, cond=cond)
    measured_fwd = counter.get_total_flops()
    expected = mmdit_forward_flops(model, num_video, num_text, batch=2)
    assert expected["total"] == measured_fwd, (expected, measured_fwd)
    # Training: backward = 2x forward except the input-gradient of the first layers (inputs need no grad).
    with FlopCounterMode(display=False) as counter:
        model(**batch, cond=cond).square().mean().backward()
    train = mmdit_train_flops(model, num_video, num_text, batch=2)
    assert abs(counter.get_total_flops() - train) / train < 0.05
    model.set_grad_ckpt(2, 2)
    recompute = 2 * expected["double"] + 2 * expected["single"]
    assert mmdit_train_flops(model, num_video, num_text, batch=2) == train + recompute
    assert mmdit_train_flops(MMDIT_CONFIGS["1b"], 8448, 512, 1) > 0  # plain preset dicts work too


# --------------------------------------------------------------------------- GPU (run on the device machine)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def joint_layouts(device, dtype):
    """q/k/v built exactly as the blocks build them: cat of (text, video) streams, and the single-block split."""
    gen = torch.Generator(device=device).manual_seed(0)
    layouts = {}
    for heads, head_dim, n_txt, n_img in [(24, 128, 77, 1024), (12, 128, 512, 960), (4, 64, 13, 250)]:
        qkv = [torch.randn(2, n, 3, heads, head_dim, device=device, dtype=dtype, generator=gen) for n in (n_txt, n_img)]
        per = [t.permute(2, 0, 3, 1, 4).unbind(0) for t in qkv]
        layouts[f"double_h{heads}_d{head_dim}_n{n_txt}+{n_img}"] = (
            [torch.cat((a, b), dim=2) for a, b in zip(*per)],
            n_txt,
        )
        fused = torch.randn(2, n_txt + n_img, 5 * heads * head_dim, device=device, dtype=dtype, generator=gen)
        q, k, v = fused[..., : 3 * heads * head_dim].view(2, -1, 3, heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        layouts[f"single_h{heads}_d{head_dim}_n{n_txt}+{n_img}"] = (
            [q.contiguous(), k.contiguous(), v.contiguous()],
            n_txt,
        )
    return layouts


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("backend", ["auto", "cudnn", "flash", "efficient"])
@pytest.mark.parametrize("masked", [False, True])
def test_attention_backends_match_math_on_gpu(backend, masked):
    if backend == "flash" and masked:
        pytest.skip("the flash kernel takes no mask; 'auto' leaves it out when there is one")
    device, dtype = torch.device("cuda"), torch.bfloat16
    for name, ((q, k, v), n_txt) in joint_layouts(device, dtype).items():
        mask = None
        if masked:
            keep = torch.ones(q.shape[0], q.shape[2], dtype=torch.bool, device=device)
            keep[0, n_txt // 2 : n_txt] = False
            mask = keep[:, None, None, :]
        grads = {}
        for b in (backend, "math"):
            leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
            out = attention(*leaves, mask=mask, backend=b)
            out.float().square().mean().backward()
            torch.cuda.synchronize()
            grads[b] = (out.float(), *[t.grad.float() for t in leaves])
        for label, got, ref in zip(("out", "dq", "dk", "dv"), grads[backend], grads["math"]):
            err = (got - ref).abs().max().item() / ref.abs().max().item()
            assert err < 2e-2, f"{backend} {name} masked={masked} {label}: relative max error {err:.3g}"


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("backend", ["auto", "cudnn", "flash", "efficient"])
def test_attention_mixed_consumers_in_one_graph_on_gpu(backend):
    """Regression: cuDNN gave NaN grads when one graph fed it dense and strided (cat-consumer) grad_outs."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(2, 2, 212, 128, device=device, dtype=dtype, generator=gen) for _ in range(3))
    extra = torch.randn(2, 212, 1024, device=device, dtype=dtype, generator=gen)
    grads = {}
    for b in (backend, "math"):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        first = attention(*leaves, backend=b)  # dense consumer, like a double-stream block
        second = attention(first.view_as(q), leaves[1], leaves[2], backend=b)  # strided, like a single block
        torch.cat((second, extra), dim=-1).float().square().mean().backward()
        torch.cuda.synchronize()
        grads[b] = [t.grad.float() for t in leaves]
    for label, got, ref in zip(("dq", "dk", "dv"), grads[backend], grads["math"]):
        err = (got - ref).abs().max().item() / ref.abs().max().item()
        assert err < 3e-2, f"{backend} {label}: relative max error {err:.3g}"


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("backend", ["auto", "cudnn", "flash", "efficient"])
def test_model_backends_match_math_on_gpu(backend):
    torch.manual_seed(0)
    kwargs = dict(
        mmdit_config("tiny", hidden_size=256, num_heads=2, axes_dims=(32, 48, 48)),
        text_dim=TEXT_DIM,
        pooled_dim=POOLED_DIM,
    )
    kwargs.pop("type")
    model = MMDiT(**kwargs, grad_ckpt_double=1).cuda().train()
    perturb(model)
    batch = {k: v.cuda() for k, v in inputs(c=12, t=3, h=16, w=16, text_len=20).items()}
    cond = torch.randn(2, 13, 3, 16, 16, device="cuda")
    for mask_padding in (False, True):
        if mask_padding:
            if backend == "flash":
                continue
            batch["text_mask"][1, 11:] = False
        results = {}
        for b in (backend, "math"):
            model.set_attn_backend(b)
            model.zero_grad()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(**batch, cond=cond)
            out.float().square().mean().backward()
            results[b] = (out.float(), model.img_in.weight.grad.float().clone())
        for label, got, ref in zip(("out", "grad"), results[backend], results["math"]):
            err = (got - ref).abs().max().item() / ref.abs().max().item()
            assert err < 3e-2, f"{backend} mask={mask_padding} {label}: relative error {err:.3g}"


def test_an_arch_record_with_the_retired_fused_kernels_switch_still_builds_the_model():
    """Checkpoints written while MMDiT took ``fused_kernels`` record it in arch.json; it is dropped on read."""
    from opensora.convert.arch import arch_from_json, arch_to_json

    model = build_module(mmdit_config("tiny"), MODELS)
    record = arch_to_json(dict(model.arch, fused_kernels=False))
    assert MMDiT(**arch_from_json(record, "arch.json")).arch == model.arch
