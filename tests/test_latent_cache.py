"""Precomputed latents and text features (``scripts/diffusion/precompute.py`` + ``CachedLatentDataset``) on CPU.

The reference is training from the videos: the demo config (fp32) trained from the cache must give bit-identical
losses, grad norms and final weights, with the same bad samples skipped. Crash safety is checked by killing one of
two precompute ranks with SIGKILL mid-way and rerunning the same command.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from test_train import DEMO_CONFIG, launcher_env, read_metrics, safetensors_weights, write_config

from dist_utils import find_free_port

ROOT = Path(__file__).resolve().parents[1]
STEPS = 10  # 8 batches per epoch: the run crosses into the second stored epoch


def precompute(*argv):
    from opensora.cli_errors import run_cli
    from opensora.latent_cache.precompute import main

    return run_cli(main, [str(a) for a in argv], prog="precompute.py")


def train(config, outputs, *flags):
    """Train in this process as ``train.py`` would; returns the trainer (to look at its components)."""
    from opensora.config import load_config_from_cli
    from opensora.training.launch import TRAIN_FLAGS
    from opensora.training.trainer import Trainer

    cfg, _ = load_config_from_cli([str(config), "--outputs", str(outputs), *map(str, flags)], script_flags=TRAIN_FLAGS)
    trainer = Trainer(cfg)
    trainer.train()
    return trainer


def index_of(cache: Path) -> pd.DataFrame:
    from opensora.latent_cache.store import read_index

    return read_index(cache)[0]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """16 clips of 6 frames (a 4-frame bucket: the start frame varies by epoch) plus a missing and a broken file."""
    from opensora.datasets.moving_shapes import write_dataset

    root = tmp_path_factory.mktemp("latent_cache")
    csv = write_dataset(root / "data", num=16, seed=3, height=32, width=32, num_frames=6, progress=False)
    (root / "data" / "videos" / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 not really a video")
    table = pd.read_csv(csv)
    extra = table.iloc[:2].copy()
    extra["path"] = ["videos/missing.mp4", "videos/broken.mp4"]
    pd.concat([table.iloc[:7], extra, table.iloc[7:]]).to_csv(csv, index=False)
    videos = write_config(
        root / "videos.py",
        DEMO_CONFIG,
        dataset=dict(data_path=str(csv)),
        bucket_config={"_delete_": True, "32x32": {4: (1.0, 2)}},
        num_workers=0,
        warmup_steps=5,
        save_at_end=True,
    )
    cache = root / "cache"
    assert precompute(videos, "--outputs", cache, "--epochs", 2) == 0
    cached = write_config(
        root / "cached.py", videos, dataset=dict(_delete_=True, type="CachedLatentDataset", data_path=str(cache))
    )
    return dict(root=root, csv=Path(csv), videos=videos, cache=cache, cached=cached)


# ---- equivalence --------------------------------------------------------------------------------------------------
def test_training_from_the_cache_is_bit_identical_to_training_from_the_videos(data, monkeypatch):
    import opensora.models.mmdit.text_padding as text_padding

    def no_read(_):
        raise AssertionError("a training step read the text lengths back from the device")

    # both paths give the model the same host bound on the text lengths (the cache's host mask, the tokenizer's
    # count), so neither reads them back and both cut the text alike
    monkeypatch.setattr(text_padding, "valid_prefix_lengths", no_read)
    import opensora.models.mmdit.model as mmdit_model

    cuts = []
    real_cut = mmdit_model.trim_text_to_bound
    monkeypatch.setattr(mmdit_model, "trim_text_to_bound", lambda *a: cuts.append(a[2]) or real_cut(*a))
    reference = train(data["videos"], data["root"] / "from_videos", "--max-steps", STEPS)
    trainer = train(data["cached"], data["root"] / "from_cache", "--max-steps", STEPS)

    want, got = read_metrics(data["root"] / "from_videos"), read_metrics(data["root"] / "from_cache")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert len(cuts) == 2 * STEPS and cuts[:STEPS] == cuts[STEPS:]  # every step cut at the same bound both ways
    for a, b in zip(want, got):
        for key in ("loss", "grad_norm", "lr", "skipped_samples", "bad_files"):
            assert a[key] == b[key], f"step {a['step']} {key}: {a[key]!r} (videos) != {b[key]!r} (cache)"
    assert got[-1]["bad_files"] == 2  # the missing and the broken file, skipped in both runs
    final = f"checkpoints/step-{STEPS:07d}"
    weights = safetensors_weights(data["root"] / "from_videos" / final)
    cached_weights = safetensors_weights(data["root"] / "from_cache" / final)
    assert weights.keys() == cached_weights.keys()
    assert all(torch.equal(weights[k], cached_weights[k]) for k in weights)
    # the cache covered both encoders: neither was built for training
    assert not trainer.components.vae.is_built and not trainer.components.text_encoder.is_built
    assert reference.loader.state_dict()["epoch"] == trainer.loader.state_dict()["epoch"] == 1


def test_resuming_from_a_checkpoint_continues_the_cached_data_exactly(data, tmp_path):
    reference = data["root"] / "from_cache"
    if not (reference / "metrics.jsonl").exists():  # the equivalence test did not run first
        train(data["cached"], reference, "--max-steps", STEPS)
    outputs = tmp_path / "resumed"
    train(data["cached"], outputs, "--max-steps", 7, "--ckpt-every", 7)  # stops mid-epoch
    from opensora.config import load_config_from_cli
    from opensora.training.launch import TRAIN_FLAGS
    from opensora.training.trainer import Trainer

    cfg, _ = load_config_from_cli(
        [str(data["cached"]), "--outputs", str(outputs), "--max-steps", str(STEPS)], script_flags=TRAIN_FLAGS
    )
    trainer = Trainer(cfg)
    trainer.resume(auto=True)
    trainer.train()
    want = {r["step"]: r for r in read_metrics(reference)}
    for record in read_metrics(outputs):
        assert (record["loss"], record["grad_norm"]) == (
            want[record["step"]]["loss"],
            want[record["step"]]["grad_norm"],
        )
    assert max(r["step"] for r in read_metrics(outputs)) == STEPS


def test_validation_builds_the_encoders_when_it_first_samples(data, tmp_path):
    outputs = tmp_path / "validated"
    flags = ("--max-steps", 2, "--validation.every", 2, "--validation.num_steps", 2)
    trainer = train(data["cached"], outputs, *flags, "--validation.prompts", "['a red circle moving left']")
    assert trainer.components.vae.is_built and trainer.components.text_encoder.is_built
    records = [r for r in read_metrics(outputs) if "val/seconds" in r]
    assert [r["step"] for r in records] == [2]


def test_precompute_script_reports_bad_input_in_one_line(data, tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "diffusion" / "precompute.py"), str(data["videos"])]
        + ["--outputs", str(tmp_path / "c"), "--samples-per-shard", "0"],
        env=launcher_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == "precompute.py: error: --samples-per-shard must be >= 1, got 0"
    assert not (tmp_path / "c").exists()


def test_index_lists_every_clip_once_with_what_made_it(data):
    from opensora.latent_cache.store import read_index

    rows, made = read_index(data["cache"])
    ok = rows[rows.status == "ok"]
    assert sorted(rows["sample"].unique()) == list(range(18))
    assert not ok.duplicated(["sample", "flip", "shard", "latents_key"]).any()
    served = [(r.sample, int(s)) for r in ok.itertuples() for s in r.slots]
    assert len(served) == len(set(served)) == 16 * 2  # every good sample, both stored epochs, once
    bad = rows[rows.status == "bad"]
    assert {Path(p).name for p in bad.path} == {"missing.mp4", "broken.mp4"}
    assert made["components"]["vae"]["module"]["cls"].endswith("PatchVAE")
    assert made["components"]["text_encoder"]["module"]["weights_sha256"]
    assert made["bucket_config"] == {"32x32": {"4": [1.0, 2]}}
    listed = pd.read_csv(data["cache"] / "bad_samples.csv")
    assert len(listed) == 2


def test_stored_clips_are_the_training_clips_and_text_is_trimmed(data):
    """Each stored latent equals the VAE's encoding of the clip the training dataset loads for that key."""
    from opensora.datasets.dataset import VideoTextDataset, format_sample_key
    from opensora.latent_cache.reader import FeatureCache
    from opensora.models.text.conditioner import TextConditioner
    from opensora.models.vae import PatchVAE

    rows = index_of(data["cache"])
    source = VideoTextDataset(str(data["csv"]), frame_interval=1)
    vae, text = PatchVAE(patch_size=4), TextConditioner(seed=0)
    cache = FeatureCache(data["cache"])
    for row in rows[rows.status == "ok"].head(6).itertuples():
        key = format_sample_key(row.sample, row.num_frames, row.height, row.width, int(row.slots[0]))
        sample = source.load_sample(key)
        assert list(row.frame_indices) == source.frame_indices(row.sample, row.num_frames, int(row.slots[0]))
        assert torch.equal(cache.tensor(row.shard, row.latents_key), vae.encode(sample["video"][None])[0])
        features = text.encode([sample["text"]])
        valid = int(features["text_mask"][0].sum())
        assert torch.equal(cache.tensor(row.shard, row.text_key), features["text_emb"][0, :valid])
        assert row.text_tokens == valid < text.max_length  # trimmed
        start, length = row.latents_offset, row.latents_nbytes  # raw offsets for readers without safetensors
        raw = np.fromfile(data["cache"] / row.shard, dtype=np.uint8, count=length, offset=start)
        assert raw.tobytes() == cache.tensor(row.shard, row.latents_key).numpy().tobytes()


def test_flip_variants_are_stored_and_drawn(data, tmp_path):
    from opensora.datasets.cached_latents import CachedLatentDataset

    cache = tmp_path / "flip"
    assert precompute(data["videos"], "--outputs", cache, "--flip", "--samples-per-shard", 5) == 0
    rows = index_of(cache)
    ok = rows[rows.status == "ok"]
    assert ok.flip.sum() == (~ok.flip).sum() == 16
    dataset = CachedLatentDataset(str(cache))
    plain, flipped = (ok[ok.flip == f].set_index("sample") for f in (False, True))
    one = plain.loc[0]
    stored = dataset.feature_cache.tensor(one.shard, one.latents_key)
    mirrored = dataset.feature_cache.tensor(flipped.loc[0].shard, flipped.loc[0].latents_key)
    assert torch.equal(mirrored.reshape(3, 4, 4, *stored.shape[1:]).flip(2, -1).reshape(stored.shape), stored)
    draws = [dataset._flipped(i, e) for i in range(18) for e in range(4)]
    assert 0.25 < np.mean(draws) < 0.75
    assert CachedLatentDataset(str(cache), flip_prob=0.0)._flipped(0, 0) is False


# ---- mismatches and bad input: one line, exit code 2, nothing lost -------------------------------------------------
def _train_cli(config, outputs, *flags):
    from opensora.cli_errors import run_cli
    from opensora.training.launch import main

    return run_cli(main, [str(config), "--outputs", str(outputs), "--max-steps", "1", *flags], prog="train.py")


@pytest.mark.parametrize(
    "flags, words",
    [
        (("--text_encoder.seed", "1"), ("text_encoder", "weights_sha256")),
        (("--vae.patch_size", "2"), ("another vae", "cache 48, config 12")),
        (("--precision", "bf16"), ("vae", "dtype")),
        (("--bucket_config", "{'32x32': {2: (1.0, 2)}}"), ("bucket_config", "32x32")),
    ],
)
def test_training_from_a_mismatching_cache_stops_with_one_line(data, tmp_path, capsys, flags, words):
    assert _train_cli(data["cached"], tmp_path / "run", *flags) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("train.py: error: ")
    assert all(word in err for word in words), err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_same_weights_under_another_config_entry_are_accepted(data):
    from opensora.latent_cache.reader import FeatureCache
    from opensora.models.text.conditioner import TextConditioner

    cache = FeatureCache(data["cache"])
    spec = dict(type="TextConditioner", seed=0, cache_size=7)  # another entry, the same encoders
    built = cache.check_component("text_encoder", spec, None, lambda: TextConditioner(seed=0, cache_size=7))
    assert isinstance(built, TextConditioner)
    assert cache.check_component("text_encoder", dict(type="TextConditioner", seed=0), None, None) is None


def test_bad_precompute_input_is_one_line_and_keeps_the_cache(data, tmp_path, capsys):
    def state():  # every file but the run lock (each attempt takes it and writes its pid)
        return {p: p.stat().st_mtime_ns for p in data["cache"].rglob("*") if p.name != ".lock"}

    before = state()
    not_a_cache = tmp_path / "other"
    not_a_cache.mkdir()
    (not_a_cache / "notes.txt").write_text("mine")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    no_vae = write_config(tmp_path / "no_vae.py", data["videos"], vae=None)
    cases = [
        ((data["videos"],), "--outputs"),
        ((data["videos"], "--outputs", data["cache"], "--epochs", 2, "--flip"), "flip"),  # another run's cache
        ((data["videos"], "--outputs", data["cache"], "--epochs", 3), "epochs"),
        ((data["videos"], "--outputs", tmp_path / "n", "--epochs", 0), "--epochs"),
        ((data["videos"], "--outputs", not_a_cache), "no latent cache"),
        ((data["videos"], "--outputs", a_file), "is a file"),
        ((no_vae, "--outputs", tmp_path / "n"), "no vae"),
        ((data["cached"], "--outputs", tmp_path / "n"), "CachedLatentDataset"),
        ((tmp_path / "missing.py", "--outputs", tmp_path / "n"), "missing.py"),
    ]
    for argv, words in cases:
        assert precompute(*argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err, (argv, err)
    assert state() == before
    assert (not_a_cache / "notes.txt").read_text() == "mine" and a_file.read_text() == "x"


def test_a_second_precompute_into_a_directory_being_written_is_refused(data, capsys):
    from opensora.latent_cache.store import hold_lock

    lock = hold_lock(data["cache"])  # as a run in progress holds it
    try:
        assert precompute(data["videos"], "--outputs", data["cache"], "--epochs", 2) == 2
    finally:
        lock.close()
    assert "being written by another precompute run (pid" in capsys.readouterr().err


def test_rerunning_a_finished_cache_changes_nothing(data):
    before = {p: p.stat().st_mtime_ns for p in (data["cache"] / "shards").iterdir()}
    assert precompute(data["videos"], "--outputs", data["cache"], "--epochs", 2) == 0
    assert {p: p.stat().st_mtime_ns for p in (data["cache"] / "shards").iterdir()} == before


# ---- two ranks, one killed -------------------------------------------------------------------------------------
_SLOW_DRIVER = """
import sys, time
from opensora.latent_cache import store
write_shard = store.write_shard
def slow_write_shard(*args, **kwargs):  # slow disks: the kill lands while chunks are still being written
    offsets = write_shard(*args, **kwargs)
    time.sleep(0.4)
    return offsets
store.write_shard = slow_write_shard
from opensora.cli_errors import run_cli
from opensora.latent_cache.precompute import main
sys.exit(run_cli(main, sys.argv[1:], prog="precompute.py"))
"""


def test_two_ranks_killed_mid_way_then_rerun_stores_every_sample_once(data, tmp_path):
    cache = tmp_path / "cache2"
    driver = tmp_path / "slow_precompute.py"
    driver.write_text(_SLOW_DRIVER)
    argv = [str(data["videos"]), "--outputs", str(cache), "--epochs", "2", "--samples-per-shard", "1"]
    env, port = launcher_env(), str(find_free_port())
    ranks = [
        subprocess.Popen(
            [sys.executable, str(driver), *argv],
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for r in range(2)
    ]
    try:
        deadline = time.monotonic() + 120
        while len(list((cache / "progress").glob("chunk-*.json"))) < 4:  # a few chunks of each rank
            assert time.monotonic() < deadline and ranks[1].poll() is None, "rank 1 did not get going"
            time.sleep(0.05)
        os.kill(ranks[1].pid, signal.SIGKILL)
        time.sleep(0.5)
        os.kill(ranks[0].pid, signal.SIGKILL)  # as torchrun's agent does when one rank dies
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=60)  # gone, its lock with it (a loaded machine takes a moment to tear a process down)
    finished = len(list((cache / "progress").glob("chunk-*.json")))
    assert not (cache / "index.parquet").exists() and finished < 18, "the kill came too late to test anything"

    # the rerun on one rank (in this process: no start-up cost) takes over the killed ranks' unfinished chunks
    assert precompute(*argv) == 0
    rows = index_of(cache)
    ok = rows[rows.status == "ok"]
    served = [(r.sample, int(s)) for r in ok.itertuples() for s in r.slots]
    assert (
        sorted(served) == sorted({(i, s) for i in set(ok["sample"]) for s in (0, 1)}) and len(set(ok["sample"])) == 16
    )
    reference_rows = index_of(data["cache"])
    assert sorted(rows["sample"].unique()) == list(range(18))
    assert len(rows[rows.status == "bad"]) == len(reference_rows[reference_rows.status == "bad"])
    assert not list(cache.rglob(".*.tmp"))
    # the same clips as the uninterrupted single-process cache
    reference = reference_rows.query("status == 'ok'").set_index(["sample", "latents_key"])
    from opensora.latent_cache.reader import FeatureCache

    mine, theirs = FeatureCache(cache), FeatureCache(data["cache"])
    for row in ok.itertuples():
        other = reference.loc[(row.sample, row.latents_key)]
        assert torch.equal(mine.tensor(row.shard, row.latents_key), theirs.tensor(other.shard, row.latents_key))
    assert json.loads((cache / "plan.json").read_text())["samples_per_shard"] == 1


# ---- the benchmark's CPU mode ----------------------------------------------------------------------------------
def test_latent_cache_benchmark_tiny_mode(tmp_path):
    from benchmarks import latent_cache as bench
    from opensora.models.vae import HunyuanVideoVAE

    out = tmp_path / "result.json"
    bench.main(["--tiny", "--warmup", "1", "--iters", "2", "--samples-per-shard", "8", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["precompute"]["clips"] == 16 and result["precompute"]["precompute_clips_per_s"] > 0
    assert result["on_the_fly"]["encoders_built"] == {"vae": True, "text_encoder": True}
    assert result["from_cache"]["encoders_built"] == {"vae": False, "text_encoder": False}
    assert result["from_cache"]["steps"] == result["on_the_fly"]["steps"] == 2
    # the storage table's latent shapes are the ones a HunyuanVideo VAE with the real compression gives
    vae = HunyuanVideoVAE(config=bench.TINY_VAE)
    for name, size in {"256px_x33": (33, 256, 256), "480x832_x129": (129, 480, 832)}.items():
        shape = [vae.latent_channels, *vae.get_latent_size(size)]
        assert result["storage"][name]["latent_shape"] == shape
        assert result["storage"][name]["latent_mib"] == np.prod(shape) * 2 / 2**20
