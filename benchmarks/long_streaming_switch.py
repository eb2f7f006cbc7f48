"""The prompt switch of ``long_streaming_quality``: every prompt switches mid-stream to a caption that differs in
colour, shape and direction, streamed with the re-cache under the new prompt (LongLive), with the old prompt's
keys/values kept, with other sink counts and with the kept window re-rendered; each scored in the windows around the
switch (``evaluate_switch``), under one RoPE anchor or both (``switch_runs``). ``streaming_drift --prompt-switch``
uses the same function on any run directory."""

from contextlib import contextmanager

from benchmarks.common import timed
from opensora.eval.resampled_criteria import at_least  # ties by one rule here and in the resampled line


@contextmanager
def settings_of(generator, **settings):
    """The generator's attributes set to ``settings`` inside the block, and back to what they were after it."""
    before = {name: getattr(generator, name) for name in settings}
    for name, value in settings.items():
        setattr(generator, name, value)
    try:
        yield generator
    finally:
        for name, value in before.items():
            setattr(generator, name, value)


def switch_runs(args, generator, prompts, seeds, clip) -> dict:
    """``evaluate_switch`` under the anchor the long criteria judge, and with ``--rope-anchor both`` under the window
    anchor too (report keys ``switch``, ``switch_rope_window``)."""
    runs = [("switch", generator.rope_anchor)]
    runs += [("switch_rope_window", "window")] if args.rope_anchor == "both" else []
    result = {}
    for key, anchor in runs:
        with settings_of(generator, rope_anchor=anchor):  # a re-cache under the window anchor pins it (pin_anchor)
            switch = evaluate_switch(
                generator,
                prompts,
                seeds,
                clip,
                motion=args.motion,
                long_multiple=args.long_multiple,
                sink_frames=args.switch_sink_frames,
                renoise=args.switch_renoise,
                workers=args.score_workers,
                compare=not args.switch_criterion_only,
            )
            result[key] = dict(rope_anchor=anchor, **switch)
    return result


def switched_caption(caption: str, captions, index: int) -> str:
    """A caption that differs from ``caption`` in colour, shape and direction (a different one per ``index``)."""
    from opensora.datasets.moving_shapes import parse_caption

    old = parse_caption(caption)
    for k in range(len(captions)):
        other = captions[(index * 7 + len(captions) // 2 + k) % len(captions)]
        if all(a != b for a, b in zip(parse_caption(other), old)):
            return other
    raise ValueError(f"no caption differs from {caption!r} in every attribute")


def evaluate_switch(
    generator,
    prompts,
    seeds,
    clip,
    *,
    motion: str,
    long_multiple: int,
    sink_frames=None,
    renoise=(),
    workers=1,
    compare=True,
) -> dict:
    """Every prompt switches to ``switched_caption`` at the first chunk start at or after the clip length; the video
    runs two clip lengths past the switch. Scored: the window before the switch against the old captions, the first
    and the second window after it against the new ones (the first is the criterion: >= 90% in colour, shape and
    direction), with the re-cache under the new prompt (LongLive) and without it (the old prompt's keys/values kept);
    ``after_reads_old``: how many clips still show the old caption's colour, shape, direction in the first window.
    ``sink_frames``: the re-cached switch again with this many sinks; ``renoise``: re-render times, a run each.
    ``compare=False`` streams only the runs a criterion judges (the re-cache and each re-render), not the old
    keys/values kept (a comparison measured on earlier runs), when a call has no time for it."""
    from opensora.datasets.moving_shapes import all_captions, parse_caption
    from opensora.eval.moving_shapes import read_shapes
    from opensora.eval.moving_shapes_windows import score_windows

    frames, height, width = clip
    captions = all_captions()
    new = [switched_caption(p, captions, i) for i, p in enumerate(prompts)]
    starts = generator.chunk_pixel_starts(frames * long_multiple, height, width)
    at = min(f for f in starts if f >= frames)
    total = at + 2 * frames
    switches = [(starts[at], new)]
    out = dict(switch_frame=at, frames=total, window=frames, examples=[[prompts[0], new[0]]])

    def window(videos, start, captions_):
        """The window's shares and its per-clip colour / shape / direction hits."""
        scores = score_windows(
            list(videos[:, start : start + frames]), captions_, frames, motion=motion, workers=workers
        )
        w = scores["windows"][0]
        shares = {k: w[k] for k in ("color_acc", "shape_acc", "direction_acc", "stats_in_range")}
        return shares, {a: scores["clip_hits"][a] for a in ("color", "shape", "direction")}

    def reads_old(videos, start):
        """Share of clips whose window reads the OLD caption's colour / shape / direction: a low new-caption
        accuracy with these near 1 is a stream that keeps its context's content, not a wrongly scored window."""
        readings = read_shapes([v[start : start + frames] for v in videos], motion == "wrap", workers)
        olds = [parse_caption(p) for p in prompts]
        return {
            f"{a}_share": sum(getattr(r, a) == o[k] for r, o in zip(readings, olds)) / len(readings)
            for k, a in enumerate(("color", "shape", "direction"))
        }

    plain_sinks = generator.sink_frames
    runs = [("recache", True, plain_sinks, None)] + [("keep_old_kv", False, plain_sinks, None)] * bool(compare)
    if sink_frames is not None:  # does a sink frame, made under the old prompt, carry its colour on?
        runs.append((f"recache_sinks_{sink_frames}", True, sink_frames, None))
    for start in renoise or ():  # the kept window re-rendered under the new prompt from ``start``
        runs.append((f"renoise_{float(start)}", True, plain_sinks, float(start)))
    for name, recache, sinks, renoise_from in runs:
        with settings_of(generator, switch_recache=recache, sink_frames=sinks, switch_renoise=renoise_from):
            seconds, videos = timed(
                lambda: generator.generate(prompts, seeds, total, height, width, switches=switches).numpy()
            )
        after, after_hits = window(videos, at, new)
        accuracies = [after[k] for k in ("color_acc", "shape_acc", "direction_acc")]
        out[name] = dict(
            sink_frames=sinks,
            switch_renoise=renoise_from,
            seconds=seconds,
            # a jump at the switch: the mean frame change across it over the mean change between frames of the
            # windows around it (about 1 for a seamless switch)
            boundary_change=boundary_change(videos, at, frames),
            before=window(videos, at - frames, prompts)[0] if at >= frames else None,
            after=after,
            after_clip_hits=after_hits,  # what the criterion's resampled pass share is drawn from
            after_second=window(videos, at + frames, new)[0],
            after_reads_old=reads_old(videos, at),
            new_prompt_ge_90pct=None if None in accuracies else bool(at_least(min(accuracies), 0.9)),
        )
    return out


def boundary_change(videos, at: int, frames: int) -> dict:
    """mean |frame[at] - frame[at-1]| (the switch boundary), the mean |frame[k] - frame[k-1]| inside the window
    before and the window from ``at`` on (boundary excluded), and their ratio."""
    import numpy as np

    v = np.asarray(videos, dtype=np.float32)
    steps = np.abs(np.diff(v[:, max(at - frames, 0) : at + frames], axis=1)).mean(axis=(0, 2, 3, 4))
    edge = at - max(at - frames, 0) - 1  # the diff across the boundary
    boundary = float(steps[edge])
    inside = float(np.delete(steps, edge).mean()) if len(steps) > 1 else None
    return dict(boundary=boundary, inside=inside, ratio=boundary / inside if inside else None)
