"""Long MovingShapes clips (bounce / wrap motion) and their per-window scoring, against the generator's ground truth."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from opensora.datasets import moving_shapes as ms
from opensora.eval.moving_shapes_windows import (
    background_by_frame,
    bounce_step_directions,
    chunk_edge_flicker,
    score_windows,
    stats_in_range,
    window_starts,
)

REPO = Path(__file__).resolve().parents[1]
SIZE, FRAMES, LONG, WINDOW = 32, 16, 64, 16
# a few clips covering every colour, shape and direction
COMBOS = [
    ("red", "triangle", "left"),
    ("cyan", "circle", "up"),
    ("blue", "square", "right"),
    ("yellow", "triangle", "down"),
]


def long_clips(motion, num_frames=LONG, size=SIZE, seed=10):
    motions = [
        ms.sample_motion(np.random.default_rng(seed + i), *combo, size, size, motion=motion, reference_frames=FRAMES)
        for i, combo in enumerate(COMBOS)
    ]
    return motions, [ms.render_video(m, size, size, num_frames) for m in motions], [ms.caption(*c) for c in COMBOS]


# ---- the generator ----------------------------------------------------------------------------------------------
def test_reflect_is_a_triangle_wave_between_the_walls():
    assert [ms.reflect(v, 2.0, 5.0) for v in (2.0, 4.0, 5.0, 6.0, 8.0, 9.0, 11.0, 0.0)] == [2, 4, 5, 4, 2, 3, 5, 4]


@pytest.mark.parametrize("motion", ["bounce", "wrap"])
def test_long_modes_continue_the_linear_clip_at_its_speed(motion):
    """A training (linear) clip keeps its shape in frame, so bounce / wrap at the same speed equal it for its length,
    then go on: the centre keeps moving (dx, dy) per training clip, the shape never shrinks or leaves."""
    linear = ms.sample_motion(np.random.default_rng(3), "green", "square", "left", SIZE, SIZE)
    long = replace(linear, motion=motion, reference_frames=FRAMES, canvas_height=SIZE, canvas_width=SIZE)
    frames = ms.render_video(long, SIZE, SIZE, 8 * FRAMES)
    np.testing.assert_array_equal(frames[:FRAMES], ms.render_video(linear, SIZE, SIZE, FRAMES))
    speed = abs(linear.dx) / (FRAMES - 1)
    steps = [long.unfolded_centre(t + 1, 8 * FRAMES)[0] - long.unfolded_centre(t, 8 * FRAMES)[0] for t in range(50)]
    np.testing.assert_allclose(steps, -speed)
    coverage = (frames.astype(float) - ms.BACKGROUND).sum(axis=(1, 2, 3))
    np.testing.assert_allclose(coverage, coverage[0], rtol=0.05)  # the whole shape in view (anti-aliasing: +-3%)
    directions = {long.direction_at(t, 8 * FRAMES) for t in range(8 * FRAMES - 1)}
    assert directions == ({"left", "right"} if motion == "bounce" else {"left"})


def test_bounce_direction_is_the_sign_of_the_centre_step_and_reverses_at_the_walls():
    motion = ms.sample_motion(np.random.default_rng(5), "red", "circle", "down", SIZE, SIZE, motion="bounce")
    half = motion.size / 2
    for t in range(LONG - 1):
        y, y_next = motion.centre(t, LONG)[1], motion.centre(t + 1, LONG)[1]
        assert half - 1e-9 <= y <= SIZE - half + 1e-9
        assert motion.direction_at(t, LONG) == ("down" if y_next > y else "up")
    assert motion.direction_at(0, LONG) == "down"  # the caption names the direction at frame 0


def test_dataset_serves_long_mode_windows_and_keeps_linear_clips_unchanged():
    from opensora.datasets.moving_shapes_dataset import MovingShapesDataset

    linear = MovingShapesDataset(num=6, seed=1, height=SIZE, width=SIZE, num_frames=FRAMES)
    wrap = MovingShapesDataset(num=6, seed=1, height=SIZE, width=SIZE, num_frames=FRAMES, motion="wrap")
    for index in range(6):
        combo = ms.dataset_attributes(6, 1)[index]
        expected = ms.render_video(ms.clip_motion(index, combo, 1, SIZE, SIZE, False), SIZE, SIZE, FRAMES)
        np.testing.assert_array_equal(linear.read_frames(index, FRAMES, 0)[0], expected)
        motion = ms.clip_motion(index, combo, 1, SIZE, SIZE, False, "wrap", FRAMES)
        np.testing.assert_array_equal(
            wrap.read_frames(index, FRAMES, 0)[0], ms.render_video(motion, SIZE, SIZE, FRAMES)
        )
        assert wrap.texts[index] == ms.caption(*combo)
    with pytest.raises(ValueError, match="motion"):
        MovingShapesDataset(num=2, motion="zigzag")


# ---- per-window scoring against the ground truth ----------------------------------------------------------------
@pytest.mark.parametrize("motion", ["bounce", "wrap"])
def test_ground_truth_scores_one_in_every_window(motion):
    motions, videos, prompts = long_clips(motion)
    starts = window_starts(LONG, WINDOW)
    truth = [[m.window_direction(s, WINDOW, LONG) for s in starts] for m in motions]
    for expected in (truth, None):  # the generator's directions, then the rule tracked on the clips themselves
        report = score_windows(videos, prompts, WINDOW, motion=motion, expected_directions=expected)
        assert len(report["windows"]) == LONG // WINDOW
        for key in ("color", "shape", "direction", "stats"):
            assert report[f"{key}_window_min"] == 1.0, (key, expected is None, report["windows"])
    if motion == "bounce":  # the tracked rule finds the generator's turning points (to a frame step)
        for m, video in zip(motions, videos):
            truth = [m.direction_at(t, LONG) for t in range(LONG - 1)]
            turns = sum(a != b for a, b in zip(truth, truth[1:]))
            tracked = bounce_step_directions(video, m.direction)
            assert turns >= 2 and sum(a != b for a, b in zip(tracked, truth)) <= turns


def test_motion_reversed_midway_scores_low_on_direction_in_the_later_windows():
    _, videos, prompts = long_clips("wrap")
    mid = LONG // 2
    # frames after the middle retrace the first half backwards: same shapes and colours, motion reversed
    reversed_ = [np.concatenate([v[:mid], v[mid - 1 :: -1][: LONG - mid]]) for v in videos]
    report = score_windows(reversed_, prompts, WINDOW, motion="wrap")
    directions = [w["direction_acc"] for w in report["windows"]]
    assert directions[: mid // WINDOW] == [1.0] * (mid // WINDOW)
    assert max(directions[mid // WINDOW :]) <= 0.25
    assert report["color_window_min"] == report["shape_window_min"] == 1.0
    assert report["direction_vs_first_min"] <= 0.25


def test_a_bounce_that_turns_mid_canvas_is_wrong_after_the_turn():
    """The bounce rule reads the clip's own wall contacts: a shape that turns back before reaching a wall (here: a
    wrap clip, which never turns, scored as bounce after its first contact) breaks the rule from there on."""
    motions, videos, prompts = long_clips("bounce")
    report = score_windows(videos, prompts, WINDOW, motion="bounce")
    assert report["direction_window_min"] == 1.0
    _, wrapped, _ = long_clips("wrap")
    wrong = score_windows(wrapped, prompts, WINDOW, motion="bounce")  # straight on through the walls
    assert wrong["direction_window_min"] < 0.75


def test_frame_statistics_catch_a_darkening_background_and_a_changed_shape_for_every_caption():
    """Ground truth is in range (above) and stays so 2 grey levels darker (a sampler's colour bias); 5 levels darker
    (the drift seen in long rollouts: frame means 18-21 over a background of 24) is out for dim and bright captions
    alike, and so is a shape of twice its area (beyond the size range) or half its contrast; a linear clip whose shape has
    left the frame is out too."""
    _, videos, prompts = long_clips("wrap")

    def shifted(delta):
        return [np.clip(v.astype(int) + delta, 0, 255).astype(np.uint8) for v in videos]

    assert score_windows(shifted(-2), prompts, WINDOW, motion="wrap")["stats_window_min"] == 1.0
    report = score_windows(shifted(-5), prompts, WINDOW, motion="wrap")
    assert report["stats_window_min"] == 0.0 and report["color_window_min"] == 1.0
    n = len(videos)  # which statistic left its range, and which way: the darker background, below
    assert all(w["stats_outside"]["background"] == [n, 0] for w in report["windows"])
    truth = score_windows(videos, prompts, WINDOW, motion="wrap")["windows"]
    assert all(side == [0, 0] for w in truth for side in w["stats_outside"].values())
    faded = [(ms.BACKGROUND + (v.astype(float) - ms.BACKGROUND) * 0.5).round().astype(np.uint8) for v in videos]
    assert score_windows(faded, prompts, WINDOW, motion="wrap")["stats_window_min"] == 0.0
    motions, _, _ = long_clips("wrap")
    grown = [ms.render_video(replace(m, size=m.size * 2**0.5), SIZE, SIZE, LONG) for m in motions]
    report = score_windows(grown, prompts, WINDOW, motion="wrap")
    assert report["stats_window_min"] == 0.0
    assert all(w["stats_outside"]["shape_mean"] == [0, n] for w in report["windows"])  # a bigger shape: mean high
    for video, combo in zip(videos, COMBOS):
        assert stats_in_range(video[:WINDOW], *combo[:2]) and not stats_in_range(video[:WINDOW], "red", None)
    # a linear clip carried on at the training speed past the training length: the shape leaves the frame
    motions, _, _ = long_clips("linear")
    scale = (4 * FRAMES - 1) / (FRAMES - 1)
    linear = [ms.render_video(replace(m, dx=m.dx * scale, dy=m.dy * scale), SIZE, SIZE, 4 * FRAMES) for m in motions]
    out = score_windows(linear, prompts, WINDOW, motion="linear")
    assert out["windows"][0]["stats_in_range"] == 1.0 and out["windows"][-1]["stats_in_range"] < 0.5


def test_background_by_frame_is_the_rendered_level_and_shows_where_a_darkening_starts():
    """Ground truth sits at the generator's background in every frame; darkening every clip by 10 grey levels from
    frame 20 on moves exactly frames 20 and later, by 10."""
    _, videos, _ = long_clips("bounce")
    levels = background_by_frame(videos)
    assert len(levels) == LONG and levels == [float(ms.BACKGROUND[0])] * LONG
    darker = [np.concatenate([v[:20], (v[20:].astype(int) - 10).clip(0, 255).astype(np.uint8)]) for v in videos]
    shifted = background_by_frame(darker)
    assert shifted[:20] == levels[:20] and shifted[20:] == [float(ms.BACKGROUND[0]) - 10] * (LONG - 20)


def test_background_and_frame_steps_of_uint8_clips_match_numpys_median_and_float_means():
    """The histogram median and the integer frame steps (the fast paths for uint8 clips) give what ``np.median`` and
    float means give, on noise and on frames of an odd and an even pixel count; float clips take the plain path."""
    rng = np.random.default_rng(3)
    for height, width in ((4, 4), (5, 7)):
        videos = rng.integers(0, 256, size=(3, 6, height, width, 3), dtype=np.uint8)
        grey = videos.astype(np.float64).mean(axis=-1).reshape(3, 6, -1)
        assert background_by_frame(videos) == pytest.approx(np.median(grey, axis=-1).mean(axis=0), abs=1e-9)
        assert background_by_frame(list(videos.astype(np.float32))) == pytest.approx(background_by_frame(videos))
        steps = np.abs(np.diff(videos.astype(np.float64), axis=1)).mean(axis=(0, 2, 3, 4))
        is_edge = np.zeros(5, dtype=bool)
        is_edge[1::2] = True
        flicker = chunk_edge_flicker(videos, 2, 2)
        assert flicker["edge_over_inside"] == pytest.approx(steps[is_edge].mean() / steps[~is_edge].mean(), rel=1e-12)
        assert chunk_edge_flicker(videos.astype(np.float32), 2, 2) == pytest.approx(flicker, rel=1e-9)


def test_chunk_edge_flicker_finds_seams_in_the_window_where_they_are():
    _, videos, _ = long_clips("wrap")
    smooth = np.stack(videos)  # rendered motion has no chunks: its steps at any 2-frame edges match the rest
    flicker = chunk_edge_flicker(smooth, 2, 2, window=WINDOW)
    assert 0.85 < flicker["edge_over_inside"] < 1.15 and len(flicker["by_window"]) == LONG // WINDOW
    assert all(0.8 < r < 1.25 for r in flicker["by_window"]), flicker
    # a stream that moves half a step inside each 2-frame chunk and a step and a half across its edge, in the first
    # window only: that window's seams show (about 3x), the later ones do not, the whole run's ratio lies between
    stutter = smooth.astype(np.float32)
    stutter[:, 1:WINDOW:2] = (stutter[:, 0:WINDOW:2] + stutter[:, 1:WINDOW:2]) / 2
    seams = chunk_edge_flicker(stutter.round().astype(np.uint8), 2, 2, window=WINDOW)
    assert seams["by_window"][0] > 2.0 and all(0.8 < r < 1.25 for r in seams["by_window"][1:]), seams
    assert flicker["edge_over_inside"] < seams["edge_over_inside"] < seams["by_window"][0]
    assert "by_window" not in chunk_edge_flicker(smooth, 2, 2)  # one number unless windows are asked for
    # by hand: 9 frames, chunks of 2 after a first chunk of 1 (edges at steps 0, 2, 4, 6), windows of 4 frames; a
    # step belongs to the window of its first frame, so step 3 (frames 3 -> 4, inside a chunk) is window 0's
    steps = np.array([2.0, 1.0, 2.0, 4.0, 6.0, 3.0, 2.0, 1.0])
    frames = np.concatenate([[0.0], np.cumsum(steps)])[None, :, None, None, None] * np.ones((1, 1, 1, 1, 3))
    by_hand = chunk_edge_flicker(frames, 2, 1, window=4)
    assert by_hand["by_window"] == pytest.approx([(2 + 2) / 2 / ((1 + 4) / 2), (6 + 2) / 2 / ((3 + 1) / 2)])
    assert by_hand["edge_over_inside"] == pytest.approx((2 + 2 + 6 + 2) / 4 / ((1 + 4 + 3 + 1) / 4))


def test_a_prompt_switch_is_scored_against_the_caption_in_force():
    """A schedule [(0, A), (32, B)]: windows before the switch are scored against A, after it against B, a window
    with the switch inside is not scored; a video that ignores the switch fails every window after it."""
    _, videos, prompts = long_clips("wrap")
    mid = LONG // 2
    order = [1, 2, 3, 0]  # each video switches to the next clip's content and caption
    switched = [np.concatenate([videos[i][:mid], videos[j][mid:]]) for i, j in enumerate(order)]
    schedules = [[(0, prompts[i]), (mid, prompts[j])] for i, j in enumerate(order)]
    report = score_windows(switched, schedules, WINDOW, stride=WINDOW // 2, motion="wrap")
    straddling = [w for w in report["windows"] if w["start_frame"] < mid < w["start_frame"] + WINDOW]
    assert [w["start_frame"] for w in straddling] == [mid - WINDOW // 2]
    assert straddling[0]["scored_n"] == 0 and straddling[0]["color_acc"] is None
    for key in ("color", "shape", "direction", "stats"):
        assert report[f"{key}_window_min"] == 1.0, key
    ignored = score_windows(videos, schedules, WINDOW, motion="wrap")  # the stream kept the first prompt's content
    after = [w for w in ignored["windows"] if w["start_frame"] >= mid]
    assert all(w["color_acc"] == 0.0 for w in after) and ignored["color_vs_first_min"] == 0.0
    with pytest.raises(ValueError, match="bounce"):
        score_windows(switched, schedules, WINDOW, motion="bounce")


def test_worker_processes_give_the_same_report_as_one_process():
    """``workers=2``: the clips scored in spawned processes give the report one process gives, field for field, on
    a mix that exercises every branch: right clips, a reversed half (direction reads), a darkened one (stats sides),
    a prompt switch (unscored windows) and known directions."""
    motions, videos, prompts = long_clips("wrap")
    mid = LONG // 2
    mixed = [videos[0], np.concatenate([videos[1][:mid], videos[1][mid - 1 :: -1][: LONG - mid]])]
    mixed += [
        np.clip(videos[2].astype(int) - 6, 0, 255).astype(np.uint8),
        np.concatenate([videos[3][:mid], videos[0][mid:]]),
    ]
    schedules = [prompts[0], prompts[1], prompts[2], [(0, prompts[3]), (mid, prompts[0])]]
    one = score_windows(mixed, schedules, WINDOW, stride=WINDOW // 2, motion="wrap")
    assert one == score_windows(mixed, schedules, WINDOW, stride=WINDOW // 2, motion="wrap", workers=2)
    assert one["direction_window_min"] < 1.0 and one["stats_window_min"] < 1.0  # the branches above were taken
    known = [[ms.parse_caption(p)[2]] * len(window_starts(LONG, WINDOW)) for p in prompts]
    assert score_windows(videos, prompts, WINDOW, motion="wrap", expected_directions=known) == score_windows(
        videos, prompts, WINDOW, motion="wrap", expected_directions=known, workers=3
    )


def test_window_scoring_refuses_bad_input():
    _, videos, prompts = long_clips("wrap", num_frames=FRAMES)
    with pytest.raises(ValueError, match="window"):
        score_windows(videos, prompts, FRAMES + 1)
    with pytest.raises(ValueError, match="motion"):
        score_windows(videos, prompts, WINDOW, motion="zigzag")
    with pytest.raises(ValueError, match="one prompt per video"):
        score_windows(videos, prompts[:1], WINDOW)


def test_eval_tool_scores_windows_of_a_written_long_dataset(tmp_path):
    meta = ms.write_dataset(
        tmp_path / "d",
        num=3,
        seed=2,
        height=SIZE,
        width=SIZE,
        num_frames=2 * FRAMES,
        progress=False,
        motion="wrap",
        reference_frames=FRAMES,
    )
    out = tmp_path / "w.json"
    env_cmd = [sys.executable, str(REPO / "tools/eval_moving_shapes.py"), str(meta), "--window", str(WINDOW)]
    run = subprocess.run(
        env_cmd + ["--motion", "wrap", "--json", str(out), "--no-progress"], capture_output=True, text=True, cwd=REPO
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    assert [w["start_frame"] for w in report["windows"]] == [0, FRAMES]
    assert report["color_window_min"] == report["direction_window_min"] == report["stats_window_min"] == 1.0
    assert "flicker" not in report
    chunked = tmp_path / "w3.json"  # rendered motion has no chunk seams: its 2-frame edges step like the rest
    run = subprocess.run(env_cmd + ["--motion", "wrap", "--json", str(chunked), "--no-progress", "--chunk-frames", "2"],
                         capture_output=True, text=True, cwd=REPO)  # fmt: skip
    assert run.returncode == 0 and "chunk-edge flicker" in run.stdout, run.stderr
    flicker = json.loads(chunked.read_text())["flicker"]
    assert len(flicker["by_window"]) == 2 and 0.7 < flicker["edge_over_inside"] < 1.3, flicker
    pooled = tmp_path / "w2.json"  # the clips scored in two processes spawned by the tool: the same report
    run = subprocess.run(
        env_cmd + ["--motion", "wrap", "--json", str(pooled), "--no-progress", "--workers", "2"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(pooled.read_text()) == report
    bad = subprocess.run(env_cmd[:-1] + ["999", "--no-progress"], capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and "window" in bad.stderr
    no_window = env_cmd[:-2] + ["--chunk-frames", "2", "--no-progress"]  # the flicker is reported by window
    bad = subprocess.run(no_window, capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and "--chunk-frames" in bad.stderr
    bad = subprocess.run(env_cmd + ["--workers", "0", "--no-progress"], capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and "--workers 0" in bad.stderr


def test_eval_tool_track_shows_where_a_shape_stops(tmp_path):
    """--track prints each clip's windows: a 'left' clip frozen from frame 16 reads left, then static with no travel
    from the same start in every later window; a 'right' clip moves right by the same travel in each window."""
    from opensora.inference.io import save_sample, write_samples_csv

    prompts = ["a red circle moving left", "a blue square moving right"]
    rows = []
    for i, prompt in enumerate(prompts):
        video = ms.render_from_attributes(*ms.parse_caption(prompt), 64, 64, 48, 7 + i, motion="wrap",
                                          reference_frames=FRAMES)  # fmt: skip
        if "left" in prompt:
            video[16:] = video[16]
        rows.append(dict(path=save_sample(tmp_path / f"{i}", video).name, text=prompt))
    write_samples_csv(tmp_path, rows)
    cmd = [sys.executable, str(REPO / "tools/eval_moving_shapes.py"), str(tmp_path / "samples.csv"), "--no-progress"]
    run = subprocess.run(
        cmd + ["--window", "16", "--motion", "wrap", "--track"], capture_output=True, text=True, cwd=REPO
    )
    assert run.returncode == 0, run.stderr
    left, right = [line for line in run.stdout.splitlines() if line.startswith(("0.mp4", "1.mp4"))]
    cells = [cell.split() for cell in left.split(": ", 1)[1].split(" | ")]
    assert [c[:2] for c in cells] == [["0", "left"], ["16", "static"], ["32", "static"]]
    travel = [abs(float(v.strip("(),"))) for v in cells[1][2:4]]
    assert cells[1][4:] == cells[2][4:] and max(travel) < 0.5  # stopped where it stands
    assert [cell.split()[1] for cell in right.split(": ", 1)[1].split(" | ")] == ["right"] * 3
    bad = subprocess.run(cmd + ["--track"], capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2 and "--track" in bad.stderr


# ---- the benchmark's own setting: 64x64, 16-frame windows of 128 frames, its prompts and seeds -----------------------
BENCH_SIZE, BENCH_LONG = 64, 128
BENCH_PROMPTS = ms.all_captions()[::9]  # 8 of benchmarks/long_streaming_quality.py's 72: every colour/shape/direction


def bench_clips(motion, num_frames=BENCH_LONG, seed=424242):
    return [
        ms.render_from_attributes(
            *ms.parse_caption(p), BENCH_SIZE, BENCH_SIZE, num_frames, seed + i, motion=motion, reference_frames=FRAMES
        )
        for i, p in enumerate(BENCH_PROMPTS)
    ]


def through_model_range(video):
    """The trip a generated video takes: the dataset's [-1, 1] scaling, bf16, then the sampler's uint8 conversion."""
    import torch

    from opensora.inference.io import to_uint8_frames

    x = (torch.from_numpy(video).float().permute(3, 0, 1, 2)[None] / 127.5 - 1.0).to(torch.bfloat16)
    return to_uint8_frames(x)[0].numpy()


@pytest.mark.parametrize("motion", ["bounce", "wrap"])
def test_ground_truth_at_the_benchmark_size_scores_one_in_every_window_and_corruptions_score_low(motion):
    """What the long-streaming benchmark scores, done to the generator's own clips: every window of 128 frames reads
    right (shapes crossing an edge or bouncing off a wall included), and the model's value range and uint8 round trip
    leave the clips unchanged; a wrong colour, a frozen clip and a darkening background (24 -> 10, as in long rollouts) do not."""
    videos = bench_clips(motion)
    for video in videos:  # the round trip is exact: generated videos are scored on the generator's own scale
        np.testing.assert_array_equal(through_model_range(video), video)
    for w in score_windows(videos, BENCH_PROMPTS, FRAMES, motion=motion)["windows"]:
        for key in ("color_acc", "shape_acc", "direction_acc", "stats_in_range"):
            assert w[key] >= 0.95, (key, w)
        assert w["direction_n"] >= len(BENCH_PROMPTS) // 2
    short = [v[: 2 * FRAMES] for v in videos]
    recoloured = score_windows([v[..., [1, 2, 0]] for v in short], BENCH_PROMPTS, FRAMES, motion=motion)
    assert recoloured["color_window_min"] == 0.0
    frozen = score_windows([np.repeat(v[:1], 2 * FRAMES, 0) for v in short], BENCH_PROMPTS, FRAMES, motion=motion)
    assert max(w["direction_acc"] or 0.0 for w in frozen["windows"]) <= 0.25
    drift = np.linspace(0, -14, BENCH_LONG)[:, None, None, None]
    darkening = [np.clip(v + drift, 0, 255).astype(np.uint8) for v in videos]
    windows = score_windows(darkening, BENCH_PROMPTS, FRAMES, motion=motion)["windows"]
    assert windows[0]["stats_in_range"] == 1.0 and max(w["stats_in_range"] for w in windows[2:]) == 0.0
    if motion == "wrap":  # played backwards: the opposite direction in every window
        backwards = score_windows([v[::-1] for v in short], BENCH_PROMPTS, FRAMES, motion=motion)
        assert backwards["direction_window_min"] == 0.0 and backwards["color_window_min"] == 1.0


def test_direction_relation_tells_reversed_sideways_and_stopped_shapes_apart():
    from opensora.eval.moving_shapes import STATIC
    from opensora.eval.moving_shapes_windows import direction_relation

    assert direction_relation("right", "right") == "match"
    assert direction_relation("left", "right") == direction_relation("up", "down") == "reverse"
    assert direction_relation("up", "right") == direction_relation("left", "down") == "sideways"
    assert direction_relation(STATIC, "left") == "static"
