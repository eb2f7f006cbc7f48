"""How often a "share of clips >= fraction x a reference share" verdict repeats when the prompts are drawn again.

A criterion such as "in every window the share of clips in range is >= 95% of the teacher's share" compares shares of
a few hundred clips: one clip moves a share of 288 by 0.0035, and the standard error of a share near 0.5 is 0.03, more
than the 5% margin. So a verdict is reported with how stable it is: the clips are resampled with replacement (paired:
a student's clip and the teacher's clip of the same prompt and seed are drawn together), the criterion is judged again
on every draw, and the share of draws that pass says whether the verdict is a property of the models or of the draw.

Per-clip hits travel as strings, one character per window: ``"1"`` a hit, ``"0"`` a miss, ``"."`` not scored (a
prompt switch inside the window, or no direction to score), so a report keeps them compactly.
"""

from typing import Optional, Sequence

import numpy as np

HIT, MISS, UNSCORED = "1", "0", "."
# a ratio this close below the fraction still meets it: a share exactly at 95% of another (114 of 288 against 120)
# must not pass or fail by the floating-point rounding of the division
TIE = 1e-9
DRAWS_PER_BLOCK = 256  # resamples judged at once (1152 clips x 8 windows x 256 draws: 19 MB a table)


def hit_string(hits: Sequence[Optional[bool]]) -> str:
    """One clip's hits over its windows as a string (None: not scored)."""
    return "".join(UNSCORED if h is None else (HIT if h else MISS) for h in hits)


def hits_array(strings: Sequence[str]) -> np.ndarray:
    """[clips, windows] float array of hit strings: 1.0 / 0.0, NaN where not scored."""
    if not len(strings):
        raise ValueError("need at least one clip's hits")
    widths = {len(s) for s in strings}
    if len(widths) != 1:
        raise ValueError(f"every clip needs the same number of windows, got {sorted(widths)}")
    table = {HIT: 1.0, MISS: 0.0, UNSCORED: np.nan}
    try:
        return np.array([[table[c] for c in s] for s in strings], dtype=np.float64)
    except KeyError as bad:
        raise ValueError(f"hit strings hold {HIT!r}, {MISS!r} or {UNSCORED!r}, got {bad.args[0]!r}") from None


def at_least(ratio, fraction: float):
    """Whether ``ratio`` (a share over a reference share) meets ``fraction``, exact ties included (``TIE``)."""
    return ratio >= fraction - TIE


def _shares(picked: np.ndarray) -> np.ndarray:
    """[draws, windows] share of hits among the scored clips of resampled hits [draws, clips, windows] (NaN where no
    clip is scored)."""
    scored = ~np.isnan(picked)
    counts = scored.sum(axis=1)
    total = np.where(scored, picked, 0.0).sum(axis=1)
    return np.where(counts > 0, total / np.maximum(counts, 1), np.nan)


def _window_and_reference_shares(values: np.ndarray, reference: np.ndarray, rows: np.ndarray):
    """For clip rows [draws, clips]: each window's share of ``values`` [draws, windows] and the reference's share
    over all its scored entries [draws] (its windows pooled)."""
    pooled = reference[rows].reshape(len(rows), -1, 1)
    return _shares(values[rows]), _shares(pooled)[:, 0]


def _judge(values: np.ndarray, reference: np.ndarray, fraction: float):
    """Per set: (pass, worst window's ratio) of "every window's share >= fraction x the reference's share"; values
    [sets, windows], reference [sets]. Unscored windows are skipped; a set with no scored window, or whose reference
    share is 0 (or unscored: no ratio to judge), is not judged (NaN), as the benchmark's own criteria leave it None."""
    with np.errstate(invalid="ignore", divide="ignore"):
        worst = np.min(np.where(np.isnan(values), np.inf, values), axis=1)
        judged = np.isfinite(worst) & (reference > 0)
        ratio = np.where(judged, worst / np.where(judged, reference, 1.0), np.nan)
    return np.where(judged, at_least(ratio, fraction).astype(np.float64), np.nan), ratio


def resampled_criterion(
    values: np.ndarray,
    reference: np.ndarray,
    fraction: float,
    draws: int = 2000,
    seed: int = 0,
    level: float = 0.9,
) -> dict:
    """Judge "every window's share of hits in ``values`` [clips, windows] >= ``fraction`` x the share of hits in
    ``reference`` [clips, R] (all its scored entries)" on the clips as they are and on ``draws`` paired resamples of
    them (the same clip rows from both: row i of each is the same prompt and seed).

    Returns ``observed`` (the verdict on the clips as they are; None where the reference's share is 0),
    ``pass_share`` (the share of the judged resamples that pass),
    ``worst_ratio`` (the worst window's share over the reference's), its ``level`` interval over the resamples
    (``worst_ratio_interval``), and ``draws``, ``seed``, ``level``, ``fraction``."""
    values = np.asarray(values, dtype=np.float64)
    reference = np.asarray(reference, dtype=np.float64)
    if values.ndim != 2 or reference.ndim != 2 or len(values) != len(reference) or not len(values):
        raise ValueError(
            f"need values [clips, windows] and reference [clips, R] with the same clips, got {values.shape} and "
            f"{reference.shape}"
        )
    if draws < 1 or not 0 < level < 1:
        raise ValueError(f"need draws >= 1 and 0 < level < 1, got draws={draws}, level={level}")
    observed, ratio = _judge(*_window_and_reference_shares(values, reference, np.arange(len(values))[None]), fraction)
    rows = np.random.default_rng(seed).integers(0, len(values), size=(draws, len(values)))
    passed, ratios = np.empty(draws), np.empty(draws)
    for start in range(0, draws, DRAWS_PER_BLOCK):  # [block, clips, windows] at a time: bounded memory
        block = rows[start : start + DRAWS_PER_BLOCK]
        judged_block = _judge(*_window_and_reference_shares(values, reference, block), fraction)
        passed[start : start + len(block)], ratios[start : start + len(block)] = judged_block
    judged = ~np.isnan(passed)
    tail = (1 - level) / 2
    interval = [float(q) for q in np.quantile(ratios[judged], [tail, 1 - tail])] if judged.any() else None
    return dict(
        fraction=float(fraction),
        observed=None if np.isnan(observed[0]) else bool(observed[0]),
        worst_ratio=None if np.isnan(ratio[0]) else float(ratio[0]),
        pass_share=float(passed[judged].mean()) if judged.any() else None,
        worst_ratio_interval=interval,
        level=float(level),
        draws=int(draws),
        seed=int(seed),
    )


def paired_difference(
    first: np.ndarray, second: np.ndarray, draws: int = 2000, seed: int = 0, level: float = 0.9
) -> dict:
    """How much more often ``first`` hits than ``second``, two students' hits [clips, windows] on the same clips
    (row i of each: the same prompt and seed), with how much of that survives drawing the prompts again.

    Each share pools the scored entries of its windows. The clips are resampled with replacement, paired (the same
    rows from both), so the interval carries the correlation between the two students' clips and between one clip's
    windows, which a share's textbook error would not.

    Returns ``first`` and ``second`` (the shares), ``difference`` (first - second), its ``level`` interval over the
    resamples (``interval``), ``ahead_share`` / ``behind_share`` (the share of resamples where the difference is > 0 /
    < 0; ties are neither), ``scored`` (entries both scored) and ``draws``, ``seed``, ``level``. An entry scored in
    one table but not the other counts in neither, so both shares are over the same entries; with no such entry every
    number is None."""
    first = np.asarray(first, dtype=np.float64)
    second = np.asarray(second, dtype=np.float64)
    if first.ndim != 2 or first.shape != second.shape or not len(first):
        raise ValueError(f"need two hit tables [clips, windows] of one shape, got {first.shape} and {second.shape}")
    if draws < 1 or not 0 < level < 1:
        raise ValueError(f"need draws >= 1 and 0 < level < 1, got draws={draws}, level={level}")
    both = ~np.isnan(first) & ~np.isnan(second)
    a, b = np.where(both, first, 0.0), np.where(both, second, 0.0)
    per_clip = np.stack([a.sum(axis=1), b.sum(axis=1), both.sum(axis=1)], axis=1)  # [clips, 3]: hits, hits, scored
    out = dict(draws=int(draws), seed=int(seed), level=float(level), scored=int(both.sum()))
    if not both.any():
        return dict(out, first=None, second=None, difference=None, interval=None, ahead_share=None, behind_share=None)
    rows = np.random.default_rng(seed).integers(0, len(first), size=(draws, len(first)))
    totals = np.empty((draws, 3))
    for start in range(0, draws, DRAWS_PER_BLOCK):  # [block, clips, 3] at a time: bounded memory
        totals[start : start + DRAWS_PER_BLOCK] = per_clip[rows[start : start + DRAWS_PER_BLOCK]].sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        drawn = (totals[:, 0] - totals[:, 1]) / totals[:, 2]
    drawn = drawn[np.isfinite(drawn)]  # a draw of only unscored rows has no difference
    tail = (1 - level) / 2
    share_a, share_b = a.sum() / both.sum(), b.sum() / both.sum()
    return dict(
        out,
        first=float(share_a),
        second=float(share_b),
        difference=float(share_a - share_b),
        interval=[float(q) for q in np.quantile(drawn, [tail, 1 - tail])] if len(drawn) else None,
        ahead_share=float((drawn > 0).mean()) if len(drawn) else None,
        behind_share=float((drawn < 0).mean()) if len(drawn) else None,
    )


__all__ = ["at_least", "hit_string", "hits_array", "paired_difference", "resampled_criterion"]
