"""A host bound on the valid text lengths (``MMDiT.forward(text_length_bound=...)``): a training pass cuts the text at
the bound (rounded up to ``text_length_multiple``) without reading the lengths back from the device, and the rows'
padding is handled from the device mask (zero keys built from it, or the dense key mask). Equal to the masked
computation on the output and every gradient; a bound below a row's valid length is an error, not a silent cut (CPU,
fp32)."""

import pytest
import torch
import torch.nn.functional as F
from test_text_padding import (
    assert_close_at_scale,
    dense_masked_forward,
    loss_and_grads,
    padded_batch,
    perturb,
    qkv_with_garbage_in_padding,
    tiny_kwargs,
)

import opensora.models.mmdit.text_padding as text_padding
from opensora.models.mmdit import MMDiT
from opensora.models.mmdit.attention import attention
from opensora.models.mmdit.zero_key_attention import ZeroKeyRows

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py


@pytest.mark.parametrize("how", ["zero-keys", "dense"])
def test_a_bounded_batch_equals_the_masked_computation_with_no_length_read(how, monkeypatch):
    """Lengths 5 and 37 of 80 columns with the bound 37: the text is cut to 37 rounded up to the multiple (32 -> 64)
    and nothing reads the lengths back (valid_prefix_lengths would raise)."""
    model = MMDiT(**tiny_kwargs(padded_text_attention=how, text_length_multiple=32)).train()
    perturb(model)
    data = padded_batch([5, 37])
    target = torch.randn(2, 4, 2, 8, 8, generator=torch.Generator().manual_seed(3))
    masked = dense_masked_forward(model, data)
    _, masked_grads = loss_and_grads(model, masked, target, data["text_emb"])

    def no_read(_):
        raise AssertionError("the lengths were read back")

    monkeypatch.setattr(text_padding, "valid_prefix_lengths", no_read)
    seen = []
    import opensora.models.mmdit.layers as layers

    real = layers.attention
    monkeypatch.setattr(
        layers,
        "attention",
        lambda q, k, v, mask=None, backend="auto": (
            seen.append((type(mask).__name__, k.shape[2])) or real(q, k, v, mask)
        ),
    )
    out = model(**data, text_mask_has_padding=True, text_length_bound=37)
    _, grads = loss_and_grads(model, out, target, data["text_emb"])
    assert_close_at_scale(out, masked, what="output")
    for name, grad in masked_grads.items():
        if grad is not None:
            assert_close_at_scale(grads[name], grad, what=name)
    kind = "ZeroKeyRows" if how == "zero-keys" else "Tensor"
    assert set(seen) == {(kind, 64 + 32)}  # 64 text columns kept, then 32 video tokens


def test_a_bound_below_a_valid_length_is_an_error():
    model = MMDiT(**tiny_kwargs(text_length_multiple=32)).train()
    with pytest.raises(RuntimeError, match="text_length_bound is below a row's valid length"):
        model(**padded_batch([5, 70]), text_length_bound=20)  # cut at 32, row 1 has 70 valid tokens
    with pytest.raises(ValueError, match="text_length_bound must be >= 0"):
        model(**padded_batch([5, 70]), text_length_bound=-1)


def test_zero_key_rows_from_any_device_mask_equal_sdpa_with_it():
    """``ZeroKeyRows.from_key_mask`` takes any valid pattern (not only a prefix): row 1 has holes."""
    (q, k, v), gen = qkv_with_garbage_in_padding([2, 5], seed=4)
    text_mask = torch.tensor([[True, True, False, False, False], [True, False, True, False, True]])
    with torch.no_grad():  # garbage where row 1's mask has holes
        k[1, :, [1, 3]] = 1e3
        v[1, :, [1, 3]] = -1e3
    rows = ZeroKeyRows.from_key_mask(MMDiT.key_mask(text_mask, 6, has_padding=True), num_text=5)
    assert torch.equal(rows.num_padded, torch.tensor([3.0, 2.0]))
    full = torch.cat((text_mask, torch.ones(2, 6, dtype=torch.bool)), 1)[:, None, None, :]
    out = attention(q, k, v, rows)
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=full).transpose(1, 2).reshape(2, 11, 16)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    grad = torch.randn(out.shape, generator=gen)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(reference, (q, k, v), grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
