"""Dataset, buckets, resumable sampler and loader, on tiny real mp4 / png files written with video_io."""

import logging
import shutil

import av
import numpy as np
import pandas as pd
import pytest
import torch

from opensora.datasets import (
    BucketBatchSampler,
    BucketTable,
    VideoTextDataset,
    build_dataloader,
    parse_resolution,
)
from opensora.datasets.dataset import IMAGE_FPS, decode_frames
from opensora.datasets.transforms import resize_center_crop
from opensora.datasets.video_io import read_video, write_video
from opensora.registry import DATASETS

NUM_FRAMES = 20
FPS = 8


def gray_level(frame_index: int, step: int = 12) -> int:
    """Each test frame is a flat grey whose level encodes its index."""
    return 8 + step * frame_index


def indexed_frames(num_frames: int, height: int, width: int, step: int = 12) -> np.ndarray:
    levels = np.array([gray_level(i, step) for i in range(num_frames)], dtype=np.uint8)
    return np.broadcast_to(levels[:, None, None, None], (num_frames, height, width, 3)).copy()


def write_video_with_gop(path, frames: np.ndarray, fps: int, gop: int) -> None:
    """Like write_video but with a key frame every ``gop`` frames, so seeking really skips frames."""
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "18", "g": str(gop), "keyint_min": str(gop), "sc_threshold": "0"}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def make_table(root, rows, name="meta.csv"):
    table = pd.DataFrame(rows, columns=["path", "text", "num_frames", "height", "width", "fps"])
    path = root / name
    if name.endswith(".csv"):
        table.to_csv(path, index=False)
    else:
        table.to_parquet(path, index=False)
    return path


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """Good videos (wide 32x48 and tall 48x32, 20 frames), a 60-frame video with a key frame every 5, a png."""
    root = tmp_path_factory.mktemp("media")
    rows = []
    for i in range(6):
        height, width = (32, 48) if i % 2 == 0 else (48, 32)
        write_video(root / f"clip{i}.mp4", indexed_frames(NUM_FRAMES, height, width), fps=FPS)
        rows.append([f"clip{i}.mp4", f"caption {i}", NUM_FRAMES, height, width, FPS])
    write_video_with_gop(root / "gop.mp4", indexed_frames(60, 32, 48, step=4), fps=FPS, gop=5)
    rows.append(["gop.mp4", "gop", 60, 32, 48, FPS])
    ramp = np.broadcast_to(np.arange(32, dtype=np.uint8)[None, :, None] * 8, (32, 32, 3))
    write_video(root / "still.png", ramp[None].copy())
    rows.append(["still.png", "an image", 1, 32, 32, 0])
    return root, rows


@pytest.fixture(scope="module")
def good_csv(media):
    root, rows = media
    return make_table(root, rows)


# ------------------------------------------------------------------------------------------------ buckets


def test_resolution_names_and_bucket_sizes():
    assert parse_resolution("256px").area == 256 * 256
    assert parse_resolution("144p").area == 144 * 256
    assert parse_resolution("64x48").exact_size == (64, 48)
    with pytest.raises(ValueError, match="unknown resolution"):
        parse_resolution("huge")
    table = BucketTable({"32px": {8: (1.0, 2)}, "16x16": {1: 4}}, size_multiple=8)
    assert [b.num_frames for b in table.frame_buckets] == [8, 1]  # largest area first
    ratios = [name for name, _ in table.aspect_ratios]
    assert table.bucket_shape(0, ratios.index("2:3")) == (8, 24, 40)
    assert table.bucket_shape(0, ratios.index("3:2")) == (8, 40, 24)
    assert table.bucket_shape(0, ratios.index("1:1")) == (8, 32, 32)
    assert table.bucket_shape(1, ratios.index("2:3")) == (1, 16, 16)  # exact size ignores the ratio
    with pytest.raises(ValueError, match="probability, batch_size"):
        BucketTable({"32px": {8: "x"}})


# ------------------------------------------------------------------------------------------------ dataset


def test_sample_shapes_range_and_registry(good_csv):
    dataset = DATASETS.build(dict(type="VideoTextDataset", data_path=str(good_csv), num_frames=4, image_size=(16, 16)))
    sample = dataset["0-8-24-40-0"]
    assert sample["video"].shape == (3, 8, 24, 40) and sample["video"].dtype == torch.float32
    assert -1.0 <= sample["video"].min() <= sample["video"].max() <= 1.0
    assert (sample["text"], sample["fps"], sample["num_frames"], sample["height"], sample["width"]) == (
        "caption 0",
        FPS,
        8,
        24,
        40,
    )
    assert dataset[1]["video"].shape == (3, 4, 16, 16)  # plain int: default clip shape
    assert dataset[(1, 2, 40, 24)]["video"].shape == (3, 2, 40, 24)


@pytest.mark.parametrize("row", [0, 6], ids=["one-keyframe", "gop-5-seek"])
def test_sampled_frames_match_full_decode(good_csv, row):
    """The seek + decode-forward path returns exactly the frames that decoding the whole file gives."""
    dataset = VideoTextDataset(good_csv, frame_interval=3, seed=1)
    full = read_video(dataset.paths[row])
    starts = set()
    for epoch in range(6):
        indices = dataset.frame_indices(row, 5, epoch)
        assert np.diff(indices).tolist() == [3] * 4
        starts.add(indices[0])
        video = dataset.load_sample((row, 5, 32, 48, epoch))["video"]
        torch.testing.assert_close(video, resize_center_crop(full[indices], (32, 48)), atol=0, rtol=0)
        # and the grey levels say these are the right frames (independent of read_video)
        levels = (video.mean(dim=(0, 2, 3)) + 1) * 127.5
        expected = torch.tensor([float(gray_level(i, 4 if row == 6 else 12)) for i in indices])
        torch.testing.assert_close(levels, expected, atol=3.0, rtol=0)
    assert len(starts) > 1  # the start really is random over epochs
    again = VideoTextDataset(good_csv, frame_interval=3, seed=1)
    assert dataset.frame_indices(row, 5, 2) == again.frame_indices(row, 5, 2)


def test_decoded_pixels_equal_pyav_to_ndarray(tmp_path):
    """The shared RGB converter and the decoder thread setting change no pixel: coloured clips of two sizes (yuv420p
    and, for odd sizes, yuv444p), decoded in turn so the converter switches size and format, match
    ``frame.to_ndarray(format="rgb24")`` exactly."""
    rng = np.random.default_rng(0)
    paths = []
    for i, (height, width) in enumerate([(24, 24), (25, 23), (24, 24), (25, 23)]):
        frames = rng.integers(0, 256, size=(6, height, width, 3), dtype=np.uint8)
        paths.append(tmp_path / f"colour{i}.mp4")
        write_video(paths[-1], frames, fps=FPS)
    for threads in (1, 0):
        for path in paths:
            with av.open(str(path)) as container:
                expected = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
            np.testing.assert_array_equal(decode_frames(str(path), [1, 2, 3], threads=threads), expected[1:4])
            np.testing.assert_array_equal(read_video(path), expected)


def test_target_fps_sets_interval_and_fps(good_csv):
    dataset = VideoTextDataset(good_csv, target_fps=FPS / 2)
    assert dataset.frame_intervals[0] == 2
    sample = dataset[(0, 4, 32, 48, 0)]
    assert sample["fps"] == FPS / 2
    assert np.diff(dataset.frame_indices(0, 4, 0)).tolist() == [2, 2, 2]


def test_center_crop_keeps_the_middle_columns():
    ramp = np.broadcast_to(np.arange(48, dtype=np.uint8)[None, None, :, None] * 5, (1, 32, 48, 3)).copy()
    video = resize_center_crop(ramp, (32, 32))
    columns = ((video[0, 0, 0] + 1) * 127.5).round().long()
    assert columns.tolist() == [5 * c for c in range(8, 40)]


def test_image_is_a_one_frame_video(good_csv):
    dataset = VideoTextDataset(good_csv, num_frames=8, image_size=(16, 16))
    sample = dataset[7]
    assert sample["video"].shape == (3, 1, 16, 16) and sample["fps"] == IMAGE_FPS
    assert dataset.usable_frames()[7] == 1


def test_csv_and_parquet_agree(media):
    root, rows = media
    from_csv = VideoTextDataset(make_table(root, rows, "m.csv"))
    from_parquet = VideoTextDataset(make_table(root, rows, "m.parquet"))
    assert from_csv.paths == from_parquet.paths and from_csv.texts == from_parquet.texts
    a, b = from_csv[(2, 3, 24, 24, 1)], from_parquet[(2, 3, 24, 24, 1)]
    torch.testing.assert_close(a["video"], b["video"], atol=0, rtol=0)


def test_missing_metadata_columns_are_probed(media):
    root, rows = media
    path = root / "paths_only.csv"
    pd.DataFrame({"path": [r[0] for r in rows], "text": [r[1] for r in rows]}).to_csv(path, index=False)
    dataset = VideoTextDataset(path)
    assert dataset.num_frames.tolist() == [r[2] for r in rows]
    assert dataset.heights.tolist() == [r[3] for r in rows] and dataset.widths.tolist() == [r[4] for r in rows]


# ------------------------------------------------------------------------------------------------ sampler


class FakeMetadata:
    """Bucketing needs only these arrays: a 120-sample table without files."""

    def __init__(self, n=120, seed=0):
        rng = np.random.default_rng(seed)
        self.num_frames = rng.integers(1, 40, n)
        self.heights = rng.choice([32, 48, 64], n)
        self.widths = rng.choice([32, 48, 64], n)
        self.paths = [f"v{i}.mp4" for i in range(n)]

    def usable_frames(self):
        return self.num_frames


BUCKETS = {"32px": {1: (1.0, 6), 8: (1.0, 4), 16: (0.5, 3)}, "48x48": {8: (1.0, 2)}}


def flat(batches):
    return [list(b) for b in batches]


def test_sampler_is_deterministic_and_honours_batch_sizes():
    meta = FakeMetadata()
    a = BucketBatchSampler(meta, BUCKETS, num_replicas=1, rank=0, seed=3, size_multiple=8)
    b = BucketBatchSampler(meta, BUCKETS, num_replicas=1, rank=0, seed=3, size_multiple=8)
    assert flat(a) == flat(b)
    batch_size = {1: 6, 8: 4, 16: 3}
    for batch in a:
        index, frames, height, width, epoch = map(int, batch[0].split("-"))
        expected = 2 if (height, width) == (48, 48) else batch_size[frames]
        assert len(batch) == expected and epoch == 0
        assert len({k.split("-", 1)[1] for k in batch + batch.spares}) == 1  # one bucket, spares included
        assert not set(batch) & set(batch.spares)
    first = flat(a)
    assert flat(BucketBatchSampler(meta, BUCKETS, num_replicas=1, rank=0, seed=4, size_multiple=8)) != first
    a.set_epoch(1)
    assert [k.rsplit("-", 1)[0] for b in a for k in b] != [k.rsplit("-", 1)[0] for b in first for k in b]
    # probability 0.5 on the 16-frame bucket: long videos land in both 16 and 8
    long_ones = set(np.flatnonzero(meta.num_frames >= 16))
    frames_of_long = {int(k.split("-")[1]) for b in first for k in b if int(k.split("-")[0]) in long_ones}
    assert {8, 16} <= frames_of_long


def test_ranks_get_disjoint_equal_shares():
    meta = FakeMetadata()
    ranks = [BucketBatchSampler(meta, BUCKETS, num_replicas=2, rank=r, seed=0, size_multiple=8) for r in range(2)]
    shares = [[k.split("-")[0] for b in s for k in b] for s in ranks]
    assert len(ranks[0]) == len(ranks[1]) > 5
    assert not set(shares[0]) & set(shares[1])
    assert len(set(shares[0])) == len(shares[0])  # no sample twice in an epoch
    single = BucketBatchSampler(meta, BUCKETS, num_replicas=1, rank=0, seed=0, size_multiple=8)
    assert len(ranks[0]) + len(ranks[1]) in (len(single), len(single) - 1)


def test_sampler_resume_mid_epoch_matches_uninterrupted_run():
    meta = FakeMetadata()
    for rank in range(2):

        def make():
            return BucketBatchSampler(meta, BUCKETS, num_replicas=2, rank=rank, seed=7, size_multiple=8)

        reference = make()
        expected = []
        for epoch in range(2):
            reference.set_epoch(epoch)
            expected += flat(reference)
        interrupted = make()
        seen = []
        for batch in interrupted:
            seen.append(list(batch))
            interrupted.advance()
            if len(seen) == 3:
                break
        state = interrupted.state_dict()
        assert state == {"epoch": 0, "batches_consumed": 3, "seed": 7, "num_replicas": 2}
        resumed = make()
        resumed.load_state_dict(state)
        resumed.set_epoch(0)  # the usual call at the top of the epoch loop keeps the position
        seen += flat(resumed)
        resumed.set_epoch(1)
        seen += flat(resumed)
        assert seen == expected


def test_unbucketable_samples_are_reported(caplog):
    meta = FakeMetadata()
    meta.num_frames[:5] = 0
    with caplog.at_level(logging.WARNING):
        sampler = BucketBatchSampler(meta, {"64x64": {8: (1.0, 2)}}, num_replicas=1, rank=0)
    too_small = (meta.heights < 64) | (meta.widths < 64) | (meta.num_frames < 8)
    assert sampler.unbucketable_indices.tolist() == np.flatnonzero(too_small).tolist()
    assert "fit no bucket" in caplog.text


# ------------------------------------------------------------------------------------------------ loader


@pytest.fixture(scope="module")
def broken_csv(media):
    """The good rows plus a missing, an empty, a truncated and a too-short (metadata says 20) video."""
    root, rows = media
    (root / "empty.mp4").write_bytes(b"")
    data = (root / "clip0.mp4").read_bytes()
    (root / "truncated.mp4").write_bytes(data[: len(data) // 2])
    write_video(root / "short.mp4", indexed_frames(4, 32, 48), fps=FPS)
    bad = ["missing.mp4", "empty.mp4", "truncated.mp4", "short.mp4"]
    bad_rows = [[name, "bad", NUM_FRAMES, 32, 48, FPS] for name in bad]
    return make_table(root, rows[:6] + bad_rows, "broken.csv"), bad


def test_bad_files_are_skipped_counted_and_logged_once(broken_csv, caplog):
    path, bad = broken_csv
    dataset = VideoTextDataset(path)
    config = {"24x24": {8: (1.0, 3)}}
    loader, sampler = build_dataloader(dataset, config, num_workers=2, seed=0, rank=0, world_size=1)
    with caplog.at_level(logging.WARNING):
        seen = []
        for epoch in range(2):
            loader.set_epoch(epoch)
            for batch in loader:
                assert batch["video"].shape == (3, 3, 8, 24, 24)  # replacements keep the batch full
                seen += [p.rsplit("/", 1)[-1] for p in batch["path"]]
    assert not set(seen) & set(bad)
    assert sorted(p.rsplit("/", 1)[-1] for p in loader.bad_paths) == sorted(bad)
    assert loader.num_skipped >= len(bad) and loader.state_dict()["num_bad_files"] == len(bad)
    for name in bad:
        assert sum(name in r.getMessage() for r in caplog.records if r.name.startswith("opensora")) == 1
    reasons = " ".join(loader.bad_paths.values())
    for words in ("missing", "empty", "cannot decode", "too short"):
        assert words in reasons
    assert loader.epoch == 1


def test_loader_resume_with_workers_is_exact(good_csv):
    config = {"24x24": {1: (1.0, 1), 4: (1.0, 1)}}

    def make():
        dataset = VideoTextDataset(good_csv, frame_interval=2, seed=5)
        return build_dataloader(dataset, config, num_workers=2, seed=5, rank=1, world_size=2, prefetch_factor=4)[0]

    def fingerprint(batch):
        return list(zip(batch["index"].tolist(), batch["video"].sum(dim=(1, 2, 3, 4)).tolist()))

    def run_epochs(loader, epochs):
        out = []
        for epoch in epochs:
            loader.set_epoch(epoch)
            out += [fingerprint(b) for b in loader]
        return out

    expected = run_epochs(make(), [0, 1])
    assert len(expected) >= 3
    interrupted = make()
    seen = []
    for batch in interrupted:  # stop after 2 batches while workers have prefetched more
        seen.append(fingerprint(batch))
        if len(seen) == 2:
            break
    state = interrupted.state_dict()
    resumed = make()
    resumed.load_state_dict(state)
    seen += run_epochs(resumed, [state["epoch"], 1])
    assert seen == expected
