"""The "fa4" attention backend: FlashAttention 4 as the zero-key path's kernel (fa4_kernel.py). FA4 runs only on
sm90+ GPUs, so here it is a math stand-in that keeps FA4's conventions: [B, N, heads, D] tensors, the log-sum-exp
as [B, heads, N] in natural log, and a backward that trusts the output and log-sum-exp it is given (as a flash
kernel's does: probabilities recomputed as exp(score - lse), the row term from out and grad_out). Through it the
zero-key path must equal the dense key mask on the output and every gradient; without FA4 the backend is SDPA's
"auto" choice. The real kernel is checked against fp64 math by benchmarks/flash_attention4.py on the GPU."""

import sys
import types

import pytest
import torch
from test_text_padding import assert_padded_batch_matches_the_masked_computation, qkv_with_garbage_in_padding
from test_text_padding_zero_keys import masked_reference

from opensora.models.mmdit import fa4_kernel
from opensora.models.mmdit.attention import attention
from opensora.models.mmdit.zero_key_attention import ZeroKeyRows, zero_key_kernel

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py


def _scores(q, k, scale):
    return torch.einsum("bqhd,bkhd->bhqk", q, k) * (q.shape[-1] ** -0.5 if scale is None else scale)


class MathFA4:
    """``flash_attn.cute.interface``'s two entry points the wrappers call, in math."""

    calls = []

    @classmethod
    def _flash_attn_fwd(cls, q, k, v, softmax_scale=None, return_lse=False, **unused):
        assert q.dim() == 4 and q.stride(-1) == 1 and not unused
        cls.calls.append("fwd")
        dtype, (q, k, v) = q.dtype, (t.double() for t in (q, k, v))  # fp64 inside, as a kernel's fp32 accumulators
        scores = _scores(q, k, softmax_scale)
        lse = scores.logsumexp(-1)  # [B, heads, N]
        out = torch.einsum("bhqk,bkhd->bqhd", (scores - lse[..., None]).exp(), v)
        return out.to(dtype), (lse.float() if return_lse else None), None, None, None

    @classmethod
    def _flash_attn_bwd(cls, q, k, v, out, dout, lse, softmax_scale=None, **unused):
        assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and not unused
        cls.calls.append("bwd")
        dtype, (q, k, v, out, dout, lse) = q.dtype, (t.double() for t in (q, k, v, out, dout, lse))
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        probs = (_scores(q, k, softmax_scale) - lse[..., None]).exp()  # [B, heads, Nq, Nk]
        dv = torch.einsum("bhqk,bqhd->bkhd", probs, dout)
        dprobs = torch.einsum("bqhd,bkhd->bhqk", dout, v)
        row = (dout * out).sum(-1).transpose(1, 2)[..., None]  # [B, heads, Nq, 1]
        dscores = probs * (dprobs - row) * scale
        grads = torch.einsum("bhqk,bkhd->bqhd", dscores, k), torch.einsum("bhqk,bqhd->bkhd", dscores, q), dv
        return tuple(g.to(dtype) for g in grads)


@pytest.fixture
def math_fa4(monkeypatch):
    """FA4 'installed' as the math stand-in, and taken for every tensor (CPU fp32 included)."""
    MathFA4.calls = []
    monkeypatch.setitem(fa4_kernel._STATE, "module", MathFA4)
    monkeypatch.setattr(fa4_kernel, "supports", lambda q: True)
    return MathFA4


@pytest.mark.parametrize("lengths", [[2, 0, 5], [5, 5]])
def test_fa4_zero_keys_equal_sdpa_with_the_boolean_mask(math_fa4, lengths):
    (q, k, v), gen = qkv_with_garbage_in_padding(lengths)
    rows = ZeroKeyRows(lengths, num_text=5, num_video=6, device="cpu")
    assert zero_key_kernel(q, "fa4") == "fa4"
    out = attention(q, k, v, rows, "fa4")
    reference = masked_reference(q, k, v, rows.dense(11))
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    grad = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad(out, (q, k, v), grad)
    for have, want in zip(got, torch.autograd.grad(reference, (q, k, v), grad)):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)
    assert math_fa4.calls == ["fwd", "bwd"]


@pytest.mark.parametrize("grad_ckpt", [0, 1])
def test_a_padded_batch_through_the_model_on_fa4_equals_the_masked_computation(math_fa4, grad_ckpt):
    assert_padded_batch_matches_the_masked_computation(
        "zero-keys", [5, 37], ZeroKeyRows, attn_backend="fa4", grad_ckpt_double=grad_ckpt, grad_ckpt_single=grad_ckpt
    )
    assert "fwd" in math_fa4.calls and "bwd" in math_fa4.calls


def test_without_fa4_the_backend_is_sdpas_auto_choice(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))  # a package with no .cute
    monkeypatch.setattr(fa4_kernel, "_STATE", {})
    assert not fa4_kernel.available() and "flash_attn.cute" in fa4_kernel.unavailable_reason()
    (q, k, v), _ = qkv_with_garbage_in_padding([3, 1])
    rows = ZeroKeyRows([3, 1], num_text=5, num_video=6, device="cpu")
    assert zero_key_kernel(q, "fa4") == zero_key_kernel(q, "auto") == "cpu"
    torch.testing.assert_close(attention(q, k, v, rows, "fa4"), attention(q, k, v, rows, "auto"), rtol=0, atol=0)
    # an unmasked call takes the "auto" order too
    torch.testing.assert_close(attention(q, k, v, None, "fa4"), attention(q, k, v, None, "auto"), rtol=0, atol=0)


def test_fa4_on_the_gpu_runs_only_where_it_can():
    """The eligibility rule without a GPU: CPU and fp32 tensors never take FA4."""
    q = torch.zeros(1, 2, 4, 64, dtype=torch.bfloat16)
    assert not fa4_kernel.supports(q) and not fa4_kernel.supports(q.float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fa4_zero_keys_on_the_gpu_are_as_close_to_fp32_as_cudnn():
    """The real FA4 (installed: benchmarks/fa4_wheels.sh) at a block's layout: bf16, 12 heads of 128, rows of 20 and
    90 valid text tokens of 128 and 512 video tokens. Output and q / k / v gradients against the fp32 masked
    computation, no further from it than the cuDNN zero-key path (plus a margin of bf16 rounding)."""
    if not fa4_kernel.available():
        pytest.skip(f"flash-attn-4 not importable: {fa4_kernel.unavailable_reason()}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    lengths, num_text, num_video = [20, 90], 128, 512
    q, k, v = (torch.randn(2, 12, num_text + num_video, 128, device="cuda", generator=gen) for _ in range(3))
    rows = ZeroKeyRows(lengths, num_text=num_text, num_video=num_video, device="cuda")
    grad = torch.randn(2, num_text + num_video, 12 * 128, device="cuda", generator=gen)

    def run(backend, dtype, mask=None):
        leaves = [t.to(dtype).requires_grad_(True) for t in (q, k, v)]
        if mask is None:
            out = attention(*leaves, rows, backend)
        else:
            out = masked_reference(*leaves, mask)
        grads = torch.autograd.grad(out, leaves, grad.to(dtype))
        return [t.float() for t in (out, *grads)]

    reference = run("math", torch.float32, rows.dense(num_text + num_video, "cuda"))
    assert zero_key_kernel(q.bfloat16(), "fa4") == "fa4"
    fa4, cudnn = run("fa4", torch.bfloat16), run("auto", torch.bfloat16)
    for name, got, base, want in zip(("out", "dq", "dk", "dv"), fa4, cudnn, reference):
        scale = want.abs().max()
        error, cudnn_error = (got - want).abs().max() / scale, (base - want).abs().max() / scale
        assert error <= max(1.5 * cudnn_error, 1e-2), f"{name}: fa4 {error:.3g} vs cudnn {cudnn_error:.3g}"
