import pytest
import torch

from opensora.diffusion.conditions import (
    CONDITION_TYPES,
    build_inference_condition,
    build_training_condition,
    condition_frame_table,
    condition_mask_for_types,
    make_cond_input,
    null_condition_like,
    paste_condition_frames,
    reference_condition,
    sample_condition_types,
)
from opensora.diffusion.flow_matching import masked_mse

TYPE = {name: i for i, name in enumerate(CONDITION_TYPES)}


def _latents(batch=6, channels=4, frames=6, height=3, width=5, seed=0):
    return torch.randn(batch, channels, frames, height, width, generator=torch.Generator().manual_seed(seed))


def test_type_frequencies_match_probabilities():
    probs = {"t2v": 0.5, "i2v_head": 0.2, "i2v_tail": 0.1, "i2v_loop": 0.05, "v2v_head": 0.1, "v2v_tail": 0.05}
    ids = sample_condition_types(100_000, probs, generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(ids, minlength=len(CONDITION_TYPES)).float() / ids.numel()
    for name, p in probs.items():
        assert freq[TYPE[name]].item() == pytest.approx(p, abs=0.006), name
    # unnormalised weights and missing names are fine
    ids = sample_condition_types(50_000, {"t2v": 3, "i2v_head": 1}, generator=torch.Generator().manual_seed(1))
    assert set(ids.unique().tolist()) == {TYPE["t2v"], TYPE["i2v_head"]}
    assert (ids == TYPE["i2v_head"]).float().mean().item() == pytest.approx(0.25, abs=0.01)
    with pytest.raises(ValueError, match="unknown condition types"):
        sample_condition_types(4, {"i2v_middle": 1.0})


def test_frame_table_per_type():
    table = condition_frame_table(6, v2v_frames=0.5).int().tolist()
    assert table[TYPE["t2v"]] == [0, 0, 0, 0, 0, 0]
    assert table[TYPE["i2v_head"]] == [1, 0, 0, 0, 0, 0]
    assert table[TYPE["i2v_tail"]] == [0, 0, 0, 0, 0, 1]
    assert table[TYPE["i2v_loop"]] == [1, 0, 0, 0, 0, 1]
    assert table[TYPE["v2v_head"]] == [1, 1, 1, 0, 0, 0]
    assert table[TYPE["v2v_tail"]] == [0, 0, 0, 1, 1, 1]
    assert condition_frame_table(6, v2v_frames=2)[TYPE["v2v_head"]].int().tolist() == [1, 1, 0, 0, 0, 0]
    # types that would give every frame are downgraded to t2v
    assert not condition_frame_table(1).any()
    two = condition_frame_table(2)
    assert not two[TYPE["i2v_loop"]].any() and two[TYPE["i2v_head"]].tolist() == [True, False]
    with pytest.raises(ValueError, match="v2v_frames"):
        condition_frame_table(6, v2v_frames=0)


def test_training_condition_layout_and_masks():
    x0 = _latents()
    type_ids = torch.arange(len(CONDITION_TYPES))
    built = build_training_condition(x0, type_ids=type_ids, v2v_frames=0.5)
    assert built.cond.shape == (6, 5, 6, 3, 5)
    assert built.cond_mask.shape == (6, 1, 6, 1, 1) and built.loss_mask.shape == (6, 1, 6, 1, 1)
    assert built.type_names() == list(CONDITION_TYPES)
    torch.testing.assert_close(built.loss_mask, 1 - built.cond_mask)
    table = condition_frame_table(6, 0.5).float()
    for b in range(6):
        frame_mask = table[b].view(1, 6, 1, 1)
        torch.testing.assert_close(built.cond_mask[b, 0, :, 0, 0], table[b])
        # mask channel first, then x0 on condition frames and zeros elsewhere
        torch.testing.assert_close(built.cond[b, :1], frame_mask.expand(1, 6, 3, 5))
        torch.testing.assert_close(built.cond[b, 1:], x0[b] * frame_mask)
    assert built.cond[TYPE["t2v"]].abs().sum() == 0
    torch.testing.assert_close(built.cond_mask, condition_mask_for_types(type_ids, 6, 0.5))


def test_training_condition_sampled_and_downgraded():
    x0 = _latents(batch=64, frames=1)
    built = build_training_condition(x0, {"i2v_head": 1.0}, generator=torch.Generator().manual_seed(0))
    assert (built.type_ids == TYPE["t2v"]).all()  # a single latent frame leaves nothing to generate
    assert built.cond.abs().sum() == 0 and bool((built.loss_mask == 1).all())
    x0 = _latents(batch=64)
    built = build_training_condition(x0, {"t2v": 0.5, "i2v_loop": 0.5}, generator=torch.Generator().manual_seed(0))
    loop = built.type_ids == TYPE["i2v_loop"]
    assert 0 < int(loop.sum()) < 64
    assert bool((built.cond_mask[loop, 0, :, 0, 0] == torch.tensor([1.0, 0, 0, 0, 0, 1])).all())
    assert bool((built.cond_mask[~loop] == 0).all())


def test_loss_mask_hides_condition_frames_from_the_loss():
    x0 = _latents(batch=2)
    built = build_training_condition(x0, type_ids=torch.tensor([TYPE["i2v_head"], TYPE["v2v_tail"]]))
    target = torch.randn_like(x0)
    pred = torch.randn_like(x0)
    other = pred.clone()
    other[0, :, 0] += 5.0
    other[1, :, 3:] -= 7.0
    assert masked_mse(pred, target, built.loss_mask).item() == masked_mse(other, target, built.loss_mask).item()


def test_inference_condition_matches_training_layout():
    x0 = _latents(batch=2)
    for name, kwargs in [
        ("i2v_head", dict(head=x0[:, :, :1])),
        ("i2v_tail", dict(tail=x0[:, :, -1:])),
        ("i2v_loop", dict(head=x0[:, :, :1], tail=x0[:, :, -1:])),
        ("v2v_head", dict(head=x0[:, :, :3])),
        ("v2v_tail", dict(tail=x0[:, :, 3:])),
    ]:
        train = build_training_condition(x0, type_ids=torch.full((2,), TYPE[name]), v2v_frames=3)
        cond, cond_mask = build_inference_condition(6, **kwargs)
        torch.testing.assert_close(cond, train.cond, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(cond_mask, train.cond_mask, rtol=0, atol=0, msg=name)
    image = x0[:, :, :1]
    cond, _ = reference_condition(image, 6, "i2v_loop")
    torch.testing.assert_close(cond[:, 1:, -1], image[:, :, 0])
    torch.testing.assert_close(null_condition_like(cond), torch.zeros_like(cond))
    with pytest.raises(ValueError, match="latent frames"):
        build_inference_condition(2, head=x0[:, :, :2], tail=x0[:, :, :1])


def test_paste_condition_frames_only_touches_condition_frames():
    x0 = _latents(batch=2)
    cond, cond_mask = build_inference_condition(6, head=x0[:, :, :1])
    generated = torch.randn_like(x0)
    pasted = paste_condition_frames(generated, cond)
    torch.testing.assert_close(pasted[:, :, 0], x0[:, :, 0])
    torch.testing.assert_close(pasted[:, :, 1:], generated[:, :, 1:])
    with pytest.raises(ValueError, match="cond_mask"):
        make_cond_input(x0, cond_mask[:, 0])
