"""tools/make_table.py through its command line: a folder of clips of mixed sizes, frame rates and lengths with .txt
captions (plus a captions.json entry, an uncaptioned clip and broken files) becomes the table VideoTextDataset trains
from, and the bucket summary agrees with the counts that follow from the written clips."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from opensora.datasets.video_io import write_video

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "configs/diffusion/train/demo_fast.py"  # one bucket: 24x24 x 4 frames
# (name, height, width, fps, frames): three sizes, three rates, 6-40 frames, as a user's own clips might be
CLIPS = [
    ("a/clip_00.mp4", 24, 24, 8, 6),
    ("a/clip_01.mp4", 32, 48, 12, 17),
    ("clip_02.mp4", 48, 32, 24, 40),
    ("b/c/clip_03.mp4", 24, 24, 24, 9),  # 9 frames at 24 fps -> every 3rd at 8 fps: 3 frames, too short
    ("clip_04.mp4", 20, 20, 8, 12),  # smaller than 24x24
]


def _run(*args):
    cmd = [sys.executable, str(ROOT / "tools/make_table.py"), *map(str, args), "--no-progress"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("clips")
    rng = np.random.default_rng(0)
    for name, height, width, fps, frames in CLIPS:
        path = root / name
        write_video(path, rng.integers(0, 255, (frames, height, width, 3), dtype=np.uint8), fps=fps)
        path.with_suffix(".txt").write_text(f"  {Path(name).stem} moving\nleft \n")  # lines joined, spaces cleaned
    write_video(root / "uncaptioned.mp4", rng.integers(0, 255, (5, 24, 24, 3), dtype=np.uint8), fps=8)
    Image.fromarray(rng.integers(0, 255, (30, 40, 3), dtype=np.uint8)).save(root / "still.png")
    (root / "captions.json").write_text(json.dumps({"still.png": "a still frame"}))
    (root / "truncated.mp4").write_bytes((root / "clip_02.mp4").read_bytes()[:300])
    (root / "empty.mov").write_bytes(b"")
    (root / "notes.txt").write_text("not a caption of anything")
    return root


def test_folder_becomes_a_table_the_dataset_reads(folder, tmp_path):
    out = tmp_path / "tables" / "table.csv"
    result = _run(folder, "--out", out)
    assert result.returncode == 0, result.stderr
    table = pd.read_csv(out)
    assert list(table.columns) == ["path", "text", "num_frames", "height", "width", "fps", "duration"]
    # paths are relative to the table's folder, which is how the dataset resolves them
    rows = {
        (out.parent / r["path"]).resolve().relative_to(folder.resolve()).as_posix(): r for r in table.to_dict("records")
    }
    for name, height, width, fps, frames in CLIPS:
        row = rows[name]
        assert (row["num_frames"], row["height"], row["width"]) == (frames, height, width), name
        assert row["fps"] == pytest.approx(fps) and row["duration"] == pytest.approx(frames / fps)
        assert row["text"] == f"{Path(name).stem} moving left"
    assert rows["still.png"]["text"] == "a still frame" and rows["still.png"]["num_frames"] == 1
    assert len(table) == len(CLIPS) + 1  # the uncaptioned clip and the broken files are left out ...
    for name, reason in (("truncated.mp4", ""), ("empty.mov", "empty file"), ("uncaptioned.mp4", "no caption")):
        line = next((ln for ln in result.stderr.splitlines() if name in ln), "")
        assert line and reason in (line + result.stderr), name  # ... and each is listed
    assert "left out, unreadable: 2" in result.stderr

    from opensora.datasets.dataset import VideoTextDataset

    dataset = VideoTextDataset(str(out), num_frames=4, image_size=(24, 24))
    sample = dataset[0]  # relative paths resolve against the table's folder; no probing (metadata columns)
    assert tuple(sample["video"].shape) == (3, 4, 24, 24)


def test_bucket_summary_counts_what_the_config_will_train_on(folder, tmp_path):
    out = tmp_path / "table.parquet"
    result = _run(folder, "--out", out, "--config", TRAIN, "--dataset.target-fps", 8)
    assert result.returncode == 0, result.stderr
    assert len(pd.read_parquet(out)) == len(CLIPS) + 1
    # at 8 fps: interval round(fps / 8) -> usable frames (n - 1) // interval + 1; a clip fits 24x24 x 4 when it has
    # >= 4 of them and both sides >= 24
    fits = [name for name, h, w, fps, n in CLIPS if h >= 24 and w >= 24 and (n - 1) // max(1, round(fps / 8)) + 1 >= 4]
    assert sorted(fits) == ["a/clip_00.mp4", "a/clip_01.mp4", "clip_02.mp4"]
    assert f"bucket 24x24 x 4 frames (probability 1, batch 16): {len(fits)} clips fit it" in result.stdout
    assert f"-> 4 frames at 24x24: {len(fits)} clips, 0 full batches" in result.stdout
    # clip_03 and the image are too short, clip_04 is too small
    assert "fit no bucket: 3 clips (2 too short after the frame interval, 1 smaller than every resolution)" in (
        result.stdout
    )
    assert "no full batch in epoch 0" in result.stdout


def test_bad_input_is_one_line_and_exit_code_2(folder, tmp_path, capsys):
    result = _run(folder, "--out", tmp_path / "t.csv", "--config", TRAIN, "--dataset.target-fsp", 8)
    assert result.returncode == 2 and "did you mean 'dataset.target_fps'" in result.stderr
    assert not (tmp_path / "t.csv").exists()
    empty = tmp_path / "nothing"
    empty.mkdir()
    assert _main(empty, "--out", tmp_path / "t.csv", "--no-progress") == 2  # in this process: no start-up to wait for
    said = capsys.readouterr().err
    assert "nothing to write" in said and len(said.strip().splitlines()) == 1


def _main(*argv) -> int:
    import importlib.util

    from opensora.cli_errors import run_cli

    spec = importlib.util.spec_from_file_location("make_table", ROOT / "tools/make_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return run_cli(module.main, [str(a) for a in argv], prog="make_table.py")
