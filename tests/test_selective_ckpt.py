"""Selective activation checkpointing (``grad_ckpt_double`` / ``grad_ckpt_single``: the first N blocks of each kind
are recomputed in backward, the rest keep their activations) changes memory, never the numbers: in fp32 on CPU the
loss and every gradient equal the no-checkpointing ones bit for bit, for every split."""

import copy

import pytest
import torch

from opensora.models.mmdit import MMDiT, mmdit_config


def _model(**overrides):
    cfg = mmdit_config(
        "tiny", text_dim=24, pooled_dim=16, in_channels=4, hidden_size=64, num_heads=2, axes_dims=(8, 12, 12)
    )
    cfg.pop("type")
    cfg.update(depth_double=3, depth_single=3, **overrides)
    model = MMDiT(**cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # zero-initialised layers too: every block must matter
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.train()


def _loss_and_grads(model):
    gen = torch.Generator().manual_seed(1)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    out = model(
        torch.randn(2, 4, 2, 8, 8, generator=gen),
        timestep=torch.rand(2, generator=gen),
        text_emb=torch.randn(2, 6, 24, generator=gen),
        text_mask=mask,
        pooled=torch.randn(2, 16, generator=gen),
    )
    loss = out.square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("double,single", [(1, 0), (0, 2), (2, 1), (3, 3)])
def test_selective_checkpointing_gives_identical_gradients_in_fp32(double, single):
    torch.manual_seed(0)
    plain = _model()
    selective = copy.deepcopy(plain)
    selective.set_grad_ckpt(double, single)
    ref_loss, ref_grads = _loss_and_grads(plain)
    loss, grads = _loss_and_grads(selective)
    assert torch.equal(loss, ref_loss)
    for name, grad in grads.items():
        assert (grad is None) == (ref_grads[name] is None), name
        assert grad is None or torch.equal(grad, ref_grads[name]), name


def test_selective_checkpointing_is_a_config_knob():
    model = _model(grad_ckpt_double=2, grad_ckpt_single=1)
    assert (model.grad_ckpt_double, model.grad_ckpt_single) == (2, 1)
    assert model.arch["grad_ckpt_double"] == 2 and model.arch["grad_ckpt_single"] == 1
    with pytest.raises(ValueError, match="grad_ckpt"):
        _model(grad_ckpt_double=4)
