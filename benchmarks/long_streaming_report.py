"""What ``long_streaming_quality`` prints and judges: the pass/fail criteria of a student's report, the same criteria
over paired resamples of the prompts (``opensora.eval.resampled_criteria``), and the printed tables (teacher, gate
checks, students, windows, prompt switches, LongRollout against the other students). Pure functions of the report
dicts; no model, no GPU.

    python -m benchmarks.long_streaming_report REPORT.json   # print a saved report again, with the differences
"""

import argparse
import json
import sys
from typing import Optional

GATE_KEYS = ("color_acc", "shape_acc", "direction_acc")  # what --teacher-gate checks, in this order
CONTROL = "self_forcing_more"  # Self-Forcing trained on for LongRollout's minutes (long_streaming_quality's control)
STUDENTS = ("self_forcing", "long_rollout", CONTROL)  # the streamed students a report may hold, in printed order
SHORT = dict(color="colour")  # the printed name of an attribute where it differs from its key


def confusions_text(scores: dict) -> str:
    """ "colour blue->cyan 3, red->None 1; direction left->None 2" (most frequent first), or "" when none is wrong."""
    return counts_text(scores.get("confusions", {}))


def counts_text(by_attribute: dict) -> str:
    """``{attribute: {value: count}}`` as "colour blue 3, red 1; direction left 2" (in the dicts' order)."""
    return "; ".join(
        f"{SHORT.get(a, a)} " + ", ".join(f"{k} {n}" for k, n in c.items()) for a, c in by_attribute.items()
    )


def flicker_text(student: dict) -> str:
    """The long run's chunk-edge flicker (the criterion's number), by window where measured, at the clip length,
    and the teacher's frame steps at the same edges (reports from before these keep the one number)."""
    flicker = student["long"]["flicker"]
    text = "-" if flicker["edge_over_inside"] is None else f"{flicker['edge_over_inside']:.3f}"

    def ratio(value):
        return "-" if value is None else f"{value:.2f}"

    parts = []
    if flicker.get("by_window"):
        parts.append("by window " + ", ".join(ratio(r) for r in flicker["by_window"]))
    if "flicker" in student:
        parts.append(f"at the clip length {ratio(student['flicker']['edge_over_inside'])}")
    if "flicker_teacher_same_edges" in student:
        teacher = student["flicker_teacher_same_edges"]["edge_over_inside"]
        parts.append(f"the teacher at the same edges {ratio(teacher)}")
    return text + (f" ({'; '.join(parts)})" if parts else "")


def criteria(student: dict, teacher: dict) -> dict:
    """The measurement's pass/fail lines for one student (None where a number is missing)."""
    from opensora.eval.resampled_criteria import at_least  # ties by one rule here and in the resampled lines

    long = student["long"]
    out = {}
    for attribute in ("color", "shape", "direction"):
        value = long[f"{attribute}_vs_first_min"]
        out[f"{attribute}_every_window_ge_95pct_of_first"] = None if value is None else at_least(value, 0.95)
    share = teacher["stats_in_range"]
    worst = long["stats_window_min"]
    out["stats_every_window_ge_95pct_of_teacher"] = (
        None if worst is None or not share else at_least(worst / share, 0.95)
    )
    flicker = long["flicker"]["edge_over_inside"]
    out["flicker_le_1.1"] = None if flicker is None else flicker <= 1.1
    for key, ratio in student["over_teacher"].items():
        out[f"{key}_ge_98pct_of_teacher"] = None if ratio is None else at_least(ratio, 0.98)
    for name, run in switch_criteria_runs(student):  # --switch-renoise: the kept window re-rendered, each a verdict
        out[name] = run["new_prompt_ge_90pct"]
    return out


def resampled_criteria(student: dict, teacher: dict, draws: int, seed: int) -> dict:
    """``criteria``' share-of-clips lines judged again on ``draws`` paired resamples of the prompts
    (``resampled_criterion``): per line the verdict, the share of resamples that pass and the worst window's ratio
    with its 90% interval. A pass share near 1 (or 0) says the verdict belongs to the models, near 0.5 to the draw."""
    import numpy as np

    from opensora.eval.resampled_criteria import hits_array, resampled_criterion

    def judged(values, reference, fraction):
        return resampled_criterion(values, reference, fraction, draws=draws, seed=seed)

    long = {name: hits_array(hits) for name, hits in student["long"]["clip_hits"].items()}
    out = {}
    for attribute in ("color", "shape", "direction"):  # every window against the student's own first scored one
        table = long[attribute]
        scored = np.flatnonzero(~np.isnan(table).all(axis=0))
        k = int(scored[0]) if len(scored) else 0
        out[f"{attribute}_every_window_ge_95pct_of_first"] = judged(table, table[:, k : k + 1], 0.95)
    out["stats_every_window_ge_95pct_of_teacher"] = judged(long["stats"], hits_array(teacher["stats_hits"]), 0.95)
    for attribute in ("color", "shape", "direction"):  # the clip length against the teacher's clips
        out[f"{attribute}_acc_ge_98pct_of_teacher"] = judged(
            hits_array(student["clip_hits"][attribute]), hits_array(teacher["clip_hits"][attribute]), 0.98
        )
    for name, run in switch_criteria_runs(student):  # the new caption's colour, shape and direction each >= 90%
        hits = run.get("after_clip_hits")
        if hits:  # three columns against a sure reference: every column's share >= 0.9
            table = np.hstack([hits_array(hits[a]) for a in ("color", "shape", "direction")])
            out[name] = judged(table, np.ones((len(table), 1)), 0.9)
    return out


ATTRIBUTES = ("color", "shape", "direction", "stats")  # what each long window scores per clip


def student_differences(report: dict, draws: int, seed: int) -> dict:
    """LongRollout minus each other student scored on the same clips (Self-Forcing, its start; the control, trained
    on as long), per attribute, in the first window (the clip length) and in the windows after it, each a share of
    clips with its interval over paired resamples of the prompts (``paired_difference``). What the issue's "compare
    with the plain student on the same seeds" asks as a number with its noise, not as two shares side by side.
    {} where LongRollout or per-clip hits (reports from before they were kept) are missing."""
    from opensora.eval.resampled_criteria import hits_array, paired_difference

    def hits(name):
        return {a: hits_array(h) for a, h in report[name]["long"].get("clip_hits", {}).items()}

    if "long_rollout" not in report or not hits("long_rollout"):
        return {}
    first, out = hits("long_rollout"), {}
    for other in (name for name in STUDENTS if name != "long_rollout"):
        if other not in report or not hits(other):
            continue
        second, lines = hits(other), {}
        for attribute in ATTRIBUTES:
            a, b = first[attribute], second[attribute]
            for part, columns in (("first_window", slice(0, 1)), ("after_first_window", slice(1, None))):
                lines[f"{attribute}_{part}"] = paired_difference(a[:, columns], b[:, columns], draws, seed)
        out[f"long_rollout - {other}"] = lines
    return out


def print_differences(differences: Optional[dict]) -> None:
    """Per pair of students and line: both shares, the difference with its interval, how often the first is ahead."""
    for pair, lines in (differences or {}).items():
        draws = next(iter(lines.values()))["draws"]
        print(f"{pair}, the same clips over {draws} paired resamples (shares; difference [90%]; ahead in):")
        for name, d in lines.items():
            if d["difference"] is None:
                print(f"    {name:<30} -")
                continue
            spread = "[-]" if d["interval"] is None else "[{:+.3f}, {:+.3f}]".format(*d["interval"])
            ahead = "-" if d["ahead_share"] is None else f"{d['ahead_share']:.2f}"
            behind = "-" if d["behind_share"] is None else f"{d['behind_share']:.2f}"
            print(
                f"    {name:<30} {d['first']:.3f} - {d['second']:.3f} = {d['difference']:+.3f} {spread}; "
                f"ahead in {ahead}, behind in {behind}"
            )


def student_names(checkpoints_or_report) -> list:
    """The streamed students present: Self-Forcing, long-rollout and (with --long-init self_forcing) the control."""
    return [n for n in STUDENTS if n in checkpoints_or_report]


def switch_criteria_runs(student: dict) -> list:
    """(criterion name, switch run) of each prompt-switch line ``criteria`` judges: the re-cache, every re-render
    (``--switch-renoise``) and the re-cache under the window anchor."""
    runs = []
    if "switch" in student:
        runs.append(("switch_new_prompt_ge_90pct_within_one_window", student["switch"]["recache"]))
        for key, run in student["switch"].items():
            if key.startswith("renoise_"):
                runs.append((f"switch_{key}_new_prompt_ge_90pct_within_one_window", run))
    if "switch_rope_window" in student:
        runs.append(("switch_rope_window_ge_90pct", student["switch_rope_window"]["recache"]))
    return runs


def misses_by_caption(clip_hits: dict, prompts) -> dict:
    """Misses in the windows past the first, by the caption's own value of each attribute, most first:
    ``{"direction": {"left": 707, "up": 79, ...}, ...}`` (an attribute without a miss is left out). It says whether a
    drift is one caption's (a direction that stops wrapping) or spread over all of them. ``clip_hits``: the per-clip
    hit strings of ``score_windows``; ``prompts``: its captions (a switched prompt's schedule is not counted)."""
    from opensora.datasets.moving_shapes import parse_caption

    out = {}
    for index, attribute in enumerate(("color", "shape", "direction")):
        counts: dict = {}
        for prompt, hits in zip(prompts, clip_hits.get(attribute, [])):
            value = parse_caption(prompt)[index] if isinstance(prompt, str) else None
            missed = hits[1:].count("0")
            if value is not None and missed:
                counts[value] = counts.get(value, 0) + missed
        if counts:
            out[attribute] = dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))
    return out


def print_windows(windows) -> None:
    for w in windows:
        direction = "  -  " if w["direction_acc"] is None else f"{w['direction_acc']:.3f}"
        reads = "/".join(str(n) for n in w.get("direction_reads", {}).values())  # match/reverse/sideways/static
        print(
            f"    from {w['start_frame']:>4}: colour {w['color_acc']:.3f} shape {w['shape_acc']:.3f} "
            f"direction {direction} ({reads}) stats {w['stats_in_range']:.3f} ({outside_text(w)}) "
            f"background {w['background']:.1f}"
        )


def outside_text(scores: dict) -> str:
    """Which frame statistics leave their caption's range, as clips below/above: "mean 3/40 std 0/12 bg 0/0"."""
    short = dict(shape_mean="mean", std="std", background="bg")
    return " ".join(f"{short[k]} {lo}/{hi}" for k, (lo, hi) in scores.get("stats_outside", {}).items())


def print_background(levels, clip_frames: int) -> None:
    """The background level per frame over the first two clip lengths (where the window first rolls)."""
    shown = " ".join(f"{v:.1f}" for v in levels[: 2 * clip_frames])
    print(f"    background by frame, 0-{min(len(levels), 2 * clip_frames) - 1}: {shown}")


def print_report(report: dict, students) -> None:
    """The report's tables: the teacher (with its gate checks), then each of ``students`` (names in ``report``)."""
    print(
        f"\nMovingShapes ({report['motion']}) on {report['device']}: {report['prompts']} prompts, clip {report['clip']}"
    )
    if report.get("pending"):  # written while the evaluation ran, which stopped before these parts
        print(f"partial report: the evaluation stopped before {', '.join(report['pending'])}")
    t = report["teacher"]
    print(
        f"teacher          colour {t['color_acc']:.3f} shape {t['shape_acc']:.3f} direction {t['direction_acc']:.3f}"
        f" stats in range {t['stats_in_range']:.3f} ({outside_text(t)})"
    )
    if confusions_text(t):
        print(f"  wrong reads: {confusions_text(t)}")
    for check in t.get("gate", {}).get("checks", []):
        chosen = " (the students' teacher)" if check["step"] == t["gate"].get("chosen") else ""
        print(f"  gate {t['gate']['gate']} at step {check['step']}: " + " ".join(f"{check[k]:.3f}" for k in GATE_KEYS)
              + chosen)  # fmt: skip
    for name in students:
        s = report[name]
        print(
            f"{name:<16} colour {s['color_acc']:.3f} shape {s['shape_acc']:.3f} direction {s['direction_acc']:.3f}"
            f"  {s['frames_per_s']:.1f} frames/s; trained {s['training']['steps']} steps"
        )
        if confusions_text(s):
            print(f"  wrong reads at the clip length: {confusions_text(s)}")
        curve = s["training"].get("validation_window_min") or []
        if curve:  # --validation-every: each attribute's worst window as the student trained
            keys = [f"{a}_window_min" for a in ("color", "shape", "direction", "stats")]
            points = ", ".join(
                f"{v['step']}: " + "/".join(f"{v.get(k, float('nan')):.2f}" for k in keys) for v in curve
            )
            print(f"  validation, worst window's colour/shape/direction/stats by step: {points}")
        chosen = s.get("selection")
        if chosen:
            history = ", ".join(f"{e['step']}: {e['value']:.2f}" for e in chosen["history"])
            print(f"  scored step {chosen['step']} of {chosen['last_step']}, best by {chosen['metric']} ({history})")
        print(f"  {s['long']['frames']} frames, windows of {s['long']['window']}, RoPE anchor {s.get('rope_anchor')}:")
        print_windows(s["long"]["windows"])
        misses = s["long"].get("misses_by_caption")
        if misses:
            print(f"    misses past the first window, by the caption's value: {counts_text(misses)}")
        print_background(s["long"]["background_by_frame"], report["clip"][0])
        print(f"  flicker {flicker_text(s)}; criteria: {s['criteria']}")
        print_resampled(s.get("criteria_resampled"))
        if "eval_seconds" in s:
            print(f"  evaluated in {s['eval_seconds']:.0f} s (sampling, scoring, switches; the teacher's: "
                  f"{t.get('eval_seconds', float('nan')):.0f} s)")  # fmt: skip
        for key, anchor in (("long_sinks", s.get("rope_anchor", "absolute")), ("long_sinks_rope_window", "window")):
            if key in s:
                r = s[key]
                print(f"  --sink-frames {r['sink_frames']} (RoPE anchor {anchor}), same seeds, windows:")
                print_windows(r["windows"])
                print_background(r["background_by_frame"], report["clip"][0])
        if "long_kv_recache" in s:
            r = s["long_kv_recache"]
            print(
                f"  --kv-recache shift: worst window colour {r['color_window_min']:.3f} shape {r['shape_window_min']:.3f}"
                f" direction {r['direction_window_min']} stats {r['stats_window_min']:.3f};"
                f" flicker {r['flicker']['edge_over_inside']}; {r['frames_per_s']:.1f} frames/s"
                f" (plain {s['long_frames_per_s']:.1f})"
            )
        if "long_rope_window" in s:
            r = s["long_rope_window"]
            print("  --rope-anchor window, same seeds, windows:")
            print_windows(r["windows"])
            print_background(r["background_by_frame"], report["clip"][0])
            print(
                f"  --rope-anchor window: worst window colour {r['color_window_min']:.3f} shape "
                f"{r['shape_window_min']:.3f} direction {r['direction_window_min']} stats {r['stats_window_min']:.3f};"
                f" flicker {r['flicker']['edge_over_inside']}; {r['frames_per_s']:.1f} frames/s"
                f" (absolute {s['long_frames_per_s']:.1f})"
            )
        print_switch_lines(s)
    print_differences(report.get("differences"))


def print_resampled(lines: Optional[dict]) -> None:
    """Per criterion: its verdict, how often it repeats over resampled prompts, the worst ratio and its interval."""
    if not lines:
        return
    first = next(iter(lines.values()))
    print(f"  the criteria over {first['draws']} paired resamples of the prompts (pass share; worst ratio, interval):")
    for name, r in lines.items():
        interval = r["worst_ratio_interval"]
        spread = f"[{interval[0]:.3f}, {interval[1]:.3f}]" if interval else "-"
        ratio = "-" if r["worst_ratio"] is None else f"{r['worst_ratio']:.3f}"
        share = "-" if r["pass_share"] is None else f"{r['pass_share']:.2f}"
        print(f"    {name:<44} {str(r['observed']):<5} passes in {share}; {ratio} {spread}")


def print_switch_lines(s: dict) -> None:
    """The prompt-switch lines of one student's report (every run: re-cache, old keys/values, sinks, re-render)."""
    for key in ("switch", "switch_rope_window"):
        if key not in s:
            continue
        w = s[key]
        print(f"  prompt switch, RoPE anchor {w['rope_anchor']}:")
        for name in [n for n, run in w.items() if isinstance(run, dict) and "after" in run]:
            after, second = w[name]["after"], w[name]["after_second"]
            old, jump = w[name]["after_reads_old"], w[name].get("boundary_change", {}).get("ratio")
            direction = "-" if after["direction_acc"] is None else f"{after['direction_acc']:.3f}"
            print(
                f"  switch at frame {w['switch_frame']} ({name}, {w[name]['sink_frames']} sinks): next window "
                f"colour {after['color_acc']:.3f} shape {after['shape_acc']:.3f} direction "
                f"{direction}; >= 90%: {w[name]['new_prompt_ge_90pct']}; reads the old caption's "
                f"colour {old['color_share']:.3f} shape {old['shape_share']:.3f} direction "
                f"{old['direction_share']:.3f}; second window colour {second['color_acc']:.3f}; boundary change "
                + ("-" if jump is None else f"{jump:.2f}")
                + "x the in-window change"
            )


def print_switches(report: dict, students) -> None:
    """``--switch-only``'s report: the switch lines of each of ``students``."""
    print(f"\nMovingShapes ({report['motion']}) prompt switch on {report['device']}: {report['prompts']} prompts")
    for name in students:
        print(name)
        print_switch_lines(report[name])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description="Print a saved long_streaming_quality report.json again, with "
                                     "LongRollout's paired differences from the other students (computed if absent).")  # fmt: skip
    parser.add_argument("report", help="a report.json that long_streaming_quality wrote")
    parser.add_argument("--draws", type=int, default=None, help="paired resamples of the prompts (default: the "
                        "run's, else 2000; given, the differences are computed again even where the report holds "
                        "them)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=None, help="the resamples' seed (default: the run's, as it drew "
                        "its criteria; given: as --draws)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        report = json.loads(open(args.report).read())
        students = student_names(report)
        report["teacher"], report["motion"]
    except (OSError, ValueError, KeyError, TypeError) as bad:
        print(f"{args.report}: not a long_streaming_quality report.json ({bad}); pass the report.json of a run",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    if args.draws is not None and args.draws < 1:
        parser.error(f"--draws {args.draws}: at least 1")
    if "differences" not in report or args.draws is not None or args.seed is not None:  # as the run draws them
        draws = args.draws if args.draws is not None else report.get("resample_draws", 2000)
        seed = args.seed if args.seed is not None else report.get("resample_seed", report.get("seeds", [0])[0])
        report["differences"] = student_differences(report, draws, seed)
    try:
        print_report(report, students)
    except KeyError as missing:  # a report written before a key the tables print now
        print(f"{args.report}: this report lacks {missing}, which the tables print now (a report from an older "
              f"version); its differences: {'none (no per-clip hits)' if not report['differences'] else 'above'}",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
