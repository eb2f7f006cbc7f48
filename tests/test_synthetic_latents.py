"""SyntheticLatentDataset's padded text: one fixed valid count, or per-slot counts drawn in a range (rows of a batch
differ as real prompts do), always a prefix mask as T5 pads."""

import pytest
import torch

from opensora.datasets.synthetic_latents import SyntheticLatentDataset

SMALL = dict(num=32, latent_frames=2, latent_height=2, latent_width=2, text_tokens=64, text_dim=8, pooled_dim=4)


def masks(dataset):
    return torch.stack([dataset.load_sample(i)["text_mask"] for i in range(len(dataset.paths))])


def test_per_slot_valid_counts_are_prefix_masks_in_the_range_and_seeded():
    data = SyntheticLatentDataset(text_valid_range=(5, 40), pool=8, **SMALL)
    got = masks(data)
    counts = got.sum(1)
    assert ((counts >= 5) & (counts <= 40)).all() and len(set(counts.tolist())) > 1
    assert torch.equal(got, torch.arange(64)[None, :] < counts[:, None])  # valid tokens first, then padding
    assert torch.equal(counts[:8], counts[8:16])  # sample i uses pool slot i % pool
    assert torch.equal(masks(SyntheticLatentDataset(text_valid_range=(5, 40), pool=8, **SMALL)), got)
    fixed = masks(SyntheticLatentDataset(text_valid_tokens=12, **SMALL))
    assert (fixed.sum(1) == 12).all()
    assert "text_mask" not in SyntheticLatentDataset(**SMALL).load_sample(0)


@pytest.mark.parametrize("bad", [dict(text_valid_range=(0, 5)), dict(text_valid_range=(9, 5)),
                                 dict(text_valid_range=(5, 65)), dict(text_valid_range=(5, 9), text_valid_tokens=4)])  # fmt: skip
def test_bad_ranges_are_refused(bad):
    with pytest.raises(ValueError, match="text_valid"):
        SyntheticLatentDataset(**bad, **SMALL)
