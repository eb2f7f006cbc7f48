"""opensora.eval.resampled_criteria: a share-of-clips verdict judged again over paired resamples of the clips,
against closed forms (the binomial tail of a resampled share) and the pairing a shared prompt and seed implies."""

import math

import numpy as np
import pytest

from opensora.datasets import moving_shapes as ms
from opensora.eval.moving_shapes_windows import score_windows
from opensora.eval.resampled_criteria import at_least, hit_string, hits_array, paired_difference, resampled_criterion


def test_hit_strings_round_trip_and_reject_ragged_or_unknown_marks():
    assert hit_string([True, False, None]) == "10."
    table = hits_array(["10.", "011"])
    assert table.shape == (2, 3) and np.isnan(table[0, 2]) and table[1].tolist() == [0.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="same number of windows"):
        hits_array(["10", "101"])
    with pytest.raises(ValueError, match="'x'"):
        hits_array(["1x"])
    with pytest.raises(ValueError, match="at least one"):
        hits_array([])


def _binomial_tail(n: int, p: float, k: int) -> float:
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k, n + 1))


def test_pass_share_of_one_window_against_a_sure_reference_is_the_binomial_tail():
    """A reference every clip hits (share 1) and one window with 90 hits of 100: a resample passes ">= 0.9" when it
    draws >= 90 hits, so the pass share is P(Binomial(100, 0.9) >= 90) = 0.583."""
    values = np.array([[1.0]] * 90 + [[0.0]] * 10)
    line = resampled_criterion(values, np.ones((100, 1)), 0.9, draws=8000, seed=3)
    assert line["observed"] is True and line["worst_ratio"] == pytest.approx(0.9)
    assert line["pass_share"] == pytest.approx(_binomial_tail(100, 0.9, 90), abs=0.02)
    low, high = line["worst_ratio_interval"]  # the 90% interval of a binomial share: 0.9 -+ 1.645 x 0.03
    assert low == pytest.approx(0.85, abs=0.011) and high == pytest.approx(0.95, abs=0.011)


def test_paired_resampling_keeps_a_student_equal_to_its_teacher_clip_for_clip_at_ratio_one():
    """Row i of both tables is the same prompt and seed: a student that hits exactly where the teacher does keeps the
    ratio at 1 in every resample (drawn apart, the two shares would jitter and fail a 0.95 margin about a third of
    the time at 60 of 120)."""
    rng = np.random.default_rng(0)
    teacher = (rng.random((120, 1)) < 0.5).astype(float)
    student = np.repeat(teacher, 4, axis=1)  # four windows, each the teacher's clips
    line = resampled_criterion(student, teacher, 0.95, draws=500)
    assert line["observed"] is True and line["pass_share"] == 1.0 and line["worst_ratio_interval"] == [1.0, 1.0]


def test_the_worst_window_decides_and_unscored_windows_are_skipped():
    values = np.ones((50, 3))
    values[:25, 2] = 0.0  # the last window holds half
    values[:, 1] = np.nan  # nothing scored in the middle window
    line = resampled_criterion(values, np.ones((50, 1)), 0.95, draws=200)
    assert line["observed"] is False and line["worst_ratio"] == pytest.approx(0.5) and line["pass_share"] == 0.0
    clear = resampled_criterion(values[:, :2], np.ones((50, 1)), 0.95, draws=200)  # NaN window only: judged on 0
    assert clear["observed"] is True and clear["pass_share"] == 1.0
    with pytest.raises(ValueError, match="same clips"):
        resampled_criterion(values, np.ones((49, 1)), 0.95)
    with pytest.raises(ValueError, match="draws"):
        resampled_criterion(values, np.ones((50, 1)), 0.95, draws=0)


def test_score_windows_clip_hits_give_each_windows_shares():
    """The per-clip hit strings of rendered wrap clips, one character a window, average to the windows' shares."""
    combos = [("red", "square", "right"), ("blue", "circle", "down"), ("cyan", "triangle", "left")] * 2
    motions = [
        ms.sample_motion(np.random.default_rng(40 + i), *combo, 32, 32, motion="wrap", reference_frames=16)
        for i, combo in enumerate(combos)
    ]
    videos = [ms.render_video(m, 32, 32, 32) for m in motions]
    videos[3] = (videos[3] // 3).astype(np.uint8)  # one clip far too dark: its statistics leave the range
    report = score_windows(videos, [ms.caption(*c) for c in combos], 16, motion="wrap")
    hits = report["clip_hits"]
    # what the clips are: ground truth reads right in every window; the darkened clip's statistics leave the range
    assert hits["stats"] == ["11", "11", "11", "00", "11", "11"]
    for name in ("color", "shape", "direction"):
        assert [h for i, h in enumerate(hits[name]) if i != 3] == ["11"] * 5
    for name, key in (("color", "color_acc"), ("shape", "shape_acc"), ("stats", "stats_in_range")):
        table = hits_array(hits[name])
        assert table.shape == (6, 2)
        assert table.mean(axis=0).tolist() == pytest.approx([w[key] for w in report["windows"]])


def test_a_reference_no_clip_hits_leaves_the_criterion_unjudged_as_the_benchmark_does():
    line = resampled_criterion(np.ones((20, 2)), np.zeros((20, 1)), 0.95, draws=100)
    assert line["observed"] is None and line["pass_share"] is None and line["worst_ratio_interval"] is None


def test_a_share_exactly_at_the_fraction_meets_it_whatever_the_division_rounds_to():
    """323 of 1152 against 340 of 1152 is exactly 95%, but the division of the two shares rounds to 0.9499999999999998:
    it passes here and in the benchmark's own criteria alike; one clip fewer does not."""
    assert (323 / 1152) / (340 / 1152) < 0.95  # the rounding this rule is for
    values = np.array([[1.0]] * 323 + [[0.0]] * 829)
    reference = np.array([[1.0]] * 340 + [[0.0]] * 812)
    assert resampled_criterion(values, reference, 0.95, draws=10)["observed"] is True
    assert at_least((323 / 1152) / (340 / 1152), 0.95) and not at_least((322 / 1152) / (340 / 1152), 0.95)


def _pairs(both_hit: int, first_only: int, second_only: int, neither: int):
    """Two students' one-window hit tables over the same clips, from the four counts of a paired 2x2 table."""
    rows = [(1, 1)] * both_hit + [(1, 0)] * first_only + [(0, 1)] * second_only + [(0, 0)] * neither
    table = np.array(rows, dtype=np.float64)
    return table[:, :1], table[:, 1:]


def test_paired_difference_has_the_spread_of_the_per_clip_differences_not_of_two_independent_shares():
    """200 clips: both hit 140, only the first 40, neither 20. The per-clip difference is 1 on 40 clips and 0 on the
    rest, so the difference is 0.2 with standard error sqrt((0.2 - 0.2^2) / 200) = 0.0283 and a 90% interval of
    0.2 -+ 0.0465; two independent shares (0.9, 0.7) would give 0.0387 and -+ 0.0637."""
    first, second = _pairs(140, 40, 0, 20)
    line = paired_difference(first, second, draws=8000, seed=5)
    assert line["first"] == pytest.approx(0.9) and line["second"] == pytest.approx(0.7)
    assert line["difference"] == pytest.approx(0.2) and line["scored"] == 200
    low, high = line["interval"]
    half = 1.645 * math.sqrt((0.2 - 0.2**2) / 200)
    assert low == pytest.approx(0.2 - half, abs=0.006) and high == pytest.approx(0.2 + half, abs=0.006)
    assert line["ahead_share"] == 1.0 and line["behind_share"] == 0.0  # never a draw without one "only first" clip


def test_paired_difference_of_a_student_with_itself_is_zero_in_every_draw_and_swapping_negates_it():
    first, second = _pairs(100, 30, 10, 60)
    same = paired_difference(first, first, draws=500)
    assert same["difference"] == 0.0 and same["interval"] == [0.0, 0.0]
    assert same["ahead_share"] == 0.0 and same["behind_share"] == 0.0  # ties are neither
    forward, backward = paired_difference(first, second, seed=2), paired_difference(second, first, seed=2)
    assert backward["difference"] == pytest.approx(-forward["difference"]) == pytest.approx(-0.1)
    assert backward["ahead_share"] == forward["behind_share"] and backward["behind_share"] == forward["ahead_share"]
    assert backward["interval"] == pytest.approx([-forward["interval"][1], -forward["interval"][0]])


def test_paired_difference_pools_windows_and_keeps_only_entries_both_students_scored():
    """A window one student has no direction for (unscored) leaves that entry out of both shares; windows pool."""
    first = hits_array(["1.1", "011"])
    second = hits_array(["010", "0.1"])
    line = paired_difference(first, second, draws=200)
    # both scored: windows 0 and 2 of each row; first hits 1, 1 and 0, 1, second 0, 0 and 0, 1
    assert line["scored"] == 4
    assert line["first"] == pytest.approx(3 / 4) and line["second"] == pytest.approx(1 / 4)
    nothing = paired_difference(hits_array(["."]), hits_array(["1"]))
    assert nothing["difference"] is None and nothing["interval"] is None and nothing["scored"] == 0
    with pytest.raises(ValueError, match="one shape"):
        paired_difference(np.ones((3, 2)), np.ones((3, 1)))
    with pytest.raises(ValueError, match="draws >= 1"):
        paired_difference(np.ones((3, 1)), np.ones((3, 1)), draws=0)
