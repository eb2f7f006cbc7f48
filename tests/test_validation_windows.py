"""Validation of long clips: a causal network streams them through its rolling cache, a bidirectional one samples
them whole; both are scored per window and logged as ``val/*_window_min``."""

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_train import DEMO_CONFIG

from opensora.config import ConfigValueError, load_config
from opensora.registry import MODELS, build_module

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py

PROMPTS = ["a red circle moving left", "a blue square moving up"]
WINDOW_KEYS = [f"val/{a}_{k}" for a in ("color", "shape", "direction", "stats") for k in ("window_min", "vs_first_min")]


class RecordingMetrics:
    def __init__(self):
        self.records = []

    def log(self, step, values, prefix="train/"):
        self.records.append((step, dict(values)))

    def log_samples(self, *args, **kwargs):
        pass


def _config(causal: bool, **validation):
    cfg = load_config(DEMO_CONFIG)
    cfg.model.update(hidden_size=32, num_heads=2, depth_double=1, depth_single=1, axes_dims=[4, 6, 6])
    if causal:
        cfg.model.causal_chunk_frames = 1
        cfg.update(window_frames=3, sink_frames=1, rollout="euler")
    cfg.validation = dict(
        every=1,
        prompts=PROMPTS,
        score="moving_shapes",
        resolution="16x16",
        num_frames=4,
        long_frames=8,
        motion="wrap",
        step_list=[1.0, 0.5],
        **validation,
    )
    return cfg


def _validator(cfg, outputs):
    from opensora.training.validation import Validator, validation_settings

    torch.manual_seed(0)
    network = build_module(cfg.model, MODELS)
    with torch.no_grad():  # a fresh MMDiT predicts v = 0: make it say something
        for p in network.parameters():
            p.add_(0.05 * torch.randn_like(p))
    role = SimpleNamespace(unwrap=lambda: network, wait_for_params=lambda: None, ema=None)
    components = SimpleNamespace(vae=build_module(cfg.vae, MODELS), text_encoder=build_module(cfg.text_encoder, MODELS))
    metrics = RecordingMetrics()
    validator = Validator(validation_settings(cfg), cfg, {"model": role}, components, metrics, outputs, is_main=True)
    return validator, metrics, network, components


@pytest.mark.parametrize("causal", [True, False], ids=["streamed", "whole_clip"])
def test_long_clips_are_sampled_scored_per_window_and_logged(causal, tmp_path, caplog):
    from opensora.eval.moving_shapes_windows import score_windows
    from opensora.inference.sampler import VideoSampler

    cfg = _config(causal)
    validator, metrics, network, components = _validator(cfg, tmp_path)
    with caplog.at_level("INFO", logger="opensora.training.validation"):
        record = validator.run(1)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("validation at step 1:"))
    for key in ("val/all_window_min", "val/direction_window_min", "val/stats_window_min"):  # in the log line too
        assert f"{key} " in line, line
    assert record is not None and set(WINDOW_KEYS) <= set(record) and record["val/long_samples"] == 2
    assert all(math.isnan(record[k]) or 0.0 <= record[k] <= 1.0 for k in WINDOW_KEYS if "window_min" in k)
    assert metrics.records and set(WINDOW_KEYS) <= set(metrics.records[-1][1])
    from opensora.training.validation import scored_metrics

    assert set(scored_metrics(validator.settings)) <= set(record)  # every name best_metric may take is logged
    out = tmp_path / "samples/step-0000001/long"
    report = json.loads((out / "windows.json").read_text())
    assert report["long_frames"] == 8 and report["motion"] == "wrap"
    assert [w["start_frame"] for w in report["windows"]] == [0, 4]
    assert (out / "samples.csv").read_text().count(".mp4") == 2
    # the scored clips are what the sampler the user would run makes of the same prompts and seeds
    sampler = VideoSampler(network.eval(), components.vae, components.text_encoder, progress=False)
    with torch.no_grad():
        if causal:
            from opensora.inference.streaming.generator import StreamingGenerator

            stream = StreamingGenerator(  # the CLI's default anchor: the window's start once it rolls
                sampler, step_list=[1.0, 0.5], rollout="euler", window_frames=3, sink_frames=1, rope_anchor="window"
            )
            videos = stream.generate(PROMPTS, [0, 1], 8, 16, 16)
        else:
            videos = sampler.generate(
                PROMPTS, [0, 1], num_frames=8, height=16, width=16, step_list=[1.0, 0.5], guidance_scale=1.0
            )
    expected = score_windows(list(videos.numpy()), PROMPTS, 4, motion="wrap")
    assert report["windows"] == json.loads(json.dumps(expected["windows"]))
    assert np.isclose(record["val/stats_window_min"], expected["stats_window_min"])


@pytest.mark.parametrize(
    "validation, match",
    [
        (dict(score=None), "score"),
        (dict(window_frames=9), "window_frames"),
        (dict(motion="zigzag"), "motion"),
    ],
)
def test_bad_long_clip_settings_are_refused(validation, match):
    from opensora.training.validation import validation_settings

    cfg = _config(False)
    cfg.validation.update(validation)
    with pytest.raises(ConfigValueError, match=match):
        validation_settings(cfg)


def test_clip_length_scores_follow_the_datasets_motion_rule():
    """A wrap run's validation reads its clip-length samples on the torus, as the evaluation does: a ground-truth
    wrap clip whose shape crosses the edge inside the clip is read right under the wrap rule, and the validation's
    motion comes from the dataset when the validation names none."""
    from opensora.datasets.moving_shapes import ShapeMotion, caption, render_video
    from opensora.eval.moving_shapes_windows import score_clips
    from opensora.training.validation import validation_settings

    cfg = _config(False)
    cfg.validation.pop("motion")
    cfg.dataset = dict(motion="wrap")
    assert validation_settings(cfg)["motion"] == "wrap"
    cfg.dataset = dict()
    assert validation_settings(cfg)["motion"] == "linear"
    # a red square crossing the right edge at frame 3 of 8 (wrap motion renders it back in from the left)
    motion = ShapeMotion("red", "square", "right", 12, 54, 32, 28.0, 0.0, "wrap", 8, 64, 64)  # 4 px a frame
    clip = render_video(motion, 64, 64, 8)
    prompt = caption("red", "square", "right")
    assert score_clips([clip], [prompt], "wrap").direction_acc == 1.0
    assert score_clips([clip], [prompt], "linear").rows[0]["pred"]["direction"] == "left"  # the old reading
    assert score_clips([clip], [prompt], "wrap", names=["clip.mp4"]).rows[0]["path"] == "clip.mp4"


def test_a_causal_config_without_a_kv_window_streams_long_clips_in_the_training_clip_window(tmp_path):
    """No ``window_frames`` in the config: the long clips roll a KV window of the validation clip's latent frames minus
    one chunk (what the long-streaming benchmark judges), not a cache that keeps every frame."""
    from opensora.eval.moving_shapes_windows import score_windows
    from opensora.inference.sampler import VideoSampler
    from opensora.inference.streaming.generator import StreamingGenerator

    cfg = _config(True)
    cfg.window_frames = None
    validator, metrics, network, components = _validator(cfg, tmp_path)
    record = validator.run(1)
    report = json.loads((tmp_path / "samples/step-0000001/long/windows.json").read_text())
    sampler = VideoSampler(network.eval(), components.vae, components.text_encoder, progress=False)
    window = sampler.latent_size(4, 16, 16)[0] - network.causal_chunk_frames
    assert report["kv_window_frames"] == window and window < sampler.latent_size(8, 16, 16)[0]
    with torch.no_grad():
        kept = {}
        for kv in (window, None):
            stream = StreamingGenerator(
                sampler, step_list=[1.0, 0.5], rollout="euler", window_frames=kv, sink_frames=1, rope_anchor="window"
            )
            kept[kv] = stream.generate(PROMPTS, [0, 1], 8, 16, 16).numpy()
    assert not np.array_equal(kept[window], kept[None])  # the two regimes differ on these clips
    expected = score_windows(list(kept[window]), PROMPTS, 4, motion="wrap")
    assert report["windows"] == json.loads(json.dumps(expected["windows"]))
    assert np.isclose(record["val/stats_window_min"], expected["stats_window_min"])


def test_a_causal_network_streams_its_clip_length_validation_clips_too(tmp_path):
    """The clip-length samples of a causal network are streamed chunk by chunk (as the student trains and as
    ``--streaming`` samples it), not denoised whole: its scores are those of the streamed clips."""
    from opensora.eval.moving_shapes import score_rows
    from opensora.inference.sampler import VideoSampler
    from opensora.inference.streaming.generator import StreamingGenerator

    cfg = _config(True)
    cfg.validation.long_frames = None
    validator, metrics, network, components = _validator(cfg, tmp_path)
    logged = []
    metrics.log_samples = lambda step, grid, videos, *args, **kwargs: logged.append(np.asarray(videos))
    record = validator.run(1)
    sampler = VideoSampler(network.eval(), components.vae, components.text_encoder, progress=False)
    with torch.no_grad():
        stream = StreamingGenerator(
            sampler, step_list=[1.0, 0.5], rollout="euler", window_frames=3, sink_frames=1, rope_anchor="window"
        )
        streamed = stream.generate(PROMPTS, [0, 1], 4, 16, 16).numpy()
        whole = sampler.generate(
            PROMPTS, [0, 1], num_frames=4, height=16, width=16, step_list=[1.0, 0.5], guidance_scale=1.0
        ).numpy()
    assert not np.array_equal(streamed, whole)  # the two regimes differ on these clips
    np.testing.assert_array_equal(logged[0], streamed)  # the frames validation scored and logged
    expected = score_rows([(f"s{i}", p, v, None) for i, (p, v) in enumerate(zip(PROMPTS, streamed))])
    assert record["val/all_acc"] == expected.all_acc
