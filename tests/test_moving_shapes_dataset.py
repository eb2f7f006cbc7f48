"""MovingShapesDataset: the demo clips rendered on the fly, served like any video table."""

import numpy as np
import pytest

from opensora.datasets import build_dataloader
from opensora.datasets.moving_shapes import clip_motion, dataset_attributes, parse_caption, render_video
from opensora.datasets.moving_shapes_dataset import MovingShapesDataset
from opensora.eval.moving_shapes import read_shape


def _to_uint8(video):
    return ((video.permute(1, 2, 3, 0).numpy() + 1) * 127.5).round().astype(np.uint8)


def test_clips_match_the_generator_and_the_evaluator_reads_them():
    ds = MovingShapesDataset(num=12, seed=3, height=32, width=32, num_frames=16)
    combos = dataset_attributes(12, 3)
    for index in (0, 5, 11):
        sample = ds.load_sample(f"{index}-16-32-32-0")
        assert sample["video"].shape == (3, 16, 32, 32)
        assert parse_caption(sample["text"]) == combos[index]
        expected = render_video(clip_motion(index, combos[index], 3, 32, 32, image=False), 32, 32, 16)
        assert np.abs(_to_uint8(sample["video"]).astype(int) - expected.astype(int)).max() <= 1
        reading = read_shape(_to_uint8(sample["video"]))
        assert (reading.color, reading.shape, reading.direction) == combos[index]


def test_through_the_bucket_loader_with_a_shorter_clip():
    ds = MovingShapesDataset(num=16, seed=0, height=32, width=32, num_frames=16)
    loader, _ = build_dataloader(ds, bucket_config={"32x32": {8: (1.0, 4)}}, seed=0, rank=0, world_size=1)
    batches = list(loader)
    assert len(batches) == 4
    assert all(b["video"].shape == (4, 3, 8, 32, 32) for b in batches)
    assert loader.num_skipped == 0


def test_where_keeps_the_same_clips_of_the_chosen_attributes():
    full = MovingShapesDataset(num=72, seed=0, height=16, width=16, num_frames=4)
    left = MovingShapesDataset(num=72, seed=0, height=16, width=16, num_frames=4, where=dict(direction="left"))
    assert len(left) == 18 and all(text.endswith("moving left") for text in left.texts)
    for i, clip in enumerate(left.clip_ids[:3]):
        assert left.texts[i] == full.texts[clip]
        assert np.array_equal(left.read_frames(i, 4, 0)[0], full.read_frames(clip, 4, 0)[0])
    two = MovingShapesDataset(
        num=72, seed=0, height=16, width=16, num_frames=4, where=dict(shape=["triangle", "square"], color="red")
    )
    assert len(two) == 8
    with pytest.raises(ValueError, match="unknown attribute"):
        MovingShapesDataset(num=72, where=dict(colour="red"))
    with pytest.raises(ValueError, match=r"direction \['sideways'\] unknown"):
        MovingShapesDataset(num=72, where=dict(direction="sideways"))
