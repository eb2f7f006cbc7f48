"""benchmarks/long_streaming_quality.py --tiny: the whole measurement chain on CPU (teacher -> causal ODE init ->
Self-Forcing and long-rollout DMD from the same init -> both streamed and scored per window), and a repeated call
reusing every finished stage (how a GPU session splits it into calls under its time limit). The stages train in
this process (--launcher in-process: the same trainer command without torchrun, a minute less on CI)."""

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from opensora.datasets.moving_shapes import parse_caption

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py


def _benchmark():
    spec = importlib.util.spec_from_file_location(
        "long_streaming_quality", ROOT / "benchmarks/long_streaming_quality.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_chain_trains_every_stage_and_scores_both_students_per_window(tmp_path, capsys, monkeypatch):
    bench = _benchmark()
    out = tmp_path / "run"
    # the streaming options' variants, scored the same way
    flags = ["--kv-recache", "both", "--prompt-switch", "--rope-anchor", "both", "--sink-frames-variant", "0"]
    flags += ["--switch-sink-frames", "0"]
    report = bench.main(["--tiny", "--out", str(out), "--device", "cpu", "--launcher", "in-process", *flags])
    assert json.loads((out / "report.json").read_text()) == json.loads(json.dumps(report))
    assert report["motion"] == "wrap" and report["clip"] == [8, 16, 16] and report["prompts"] == 4
    printed = capsys.readouterr().out  # each part of the evaluation in the log as it ends, switches last
    ends = [line.split(" in ")[0].strip() for line in printed.splitlines() if line.startswith("   evaluated ")]
    assert ends == ["evaluated self_forcing", "evaluated long_rollout", "evaluated self_forcing switch",
                    "evaluated long_rollout switch"]  # fmt: skip
    stages = {name: bench.last_checkpoint(out / name) for name in bench.STAGES}
    assert all(stages.values())
    for name in ("self_forcing", "long_rollout"):
        student = report[name]
        assert student["ckpt"] == str(stages[name]) and student["frames_per_s"] > 0
        assert student["training"]["steps"] == 2 and "critic_loss" in student["training"]["last_losses"]
        long = student["long"]
        assert long["frames"] == 24 and [w["start_frame"] for w in long["windows"]] == [0, 8, 16]
        assert long["window"] == 8 and student["window_frames"] == 6 and student["sink_frames"] == 2
        assert set(student["criteria"]) >= {"flicker_le_1.1", "stats_every_window_ge_95pct_of_teacher"}
        # the seams by window, at the clip length, and the teacher's frame steps at the same edges
        assert len(long["flicker"]["by_window"]) == 3 and student["flicker"]["edge_over_inside"] is not None
        assert student["flicker_teacher_same_edges"]["edge_over_inside"] is not None
        # each share-of-clips line judged again over resampled prompts: on the clips as they are, the same verdict
        resampled = student["criteria_resampled"]
        assert set(resampled) == set(student["criteria"]) - {"flicker_le_1.1"}  # every share line, switches too
        for name, line in resampled.items():
            assert line["observed"] == student["criteria"][name], name
            assert line["draws"] == 2000 and (line["pass_share"] is None or 0 <= line["pass_share"] <= 1)
        assert len(long["clip_hits"]["stats"]) == 4 and len(student["clip_hits"]["shape"]) == 4
        anchored = student["long_rope_window"]  # the same seeds with the text and sinks at the window's start
        assert anchored["frames"] == 24 and [w["start_frame"] for w in anchored["windows"]] == [0, 8, 16]
        assert anchored["windows"][0] == long["windows"][0]  # the first window streams before the cache rolls
        assert len(long["background_by_frame"]) == 24 and len(anchored["background_by_frame"]) == 24
        sinkless = student["long_sinks"]  # the same seeds without sink frames
        assert sinkless["sink_frames"] == 0 and [w["start_frame"] for w in sinkless["windows"]] == [0, 8, 16]
        assert sinkless["windows"][0] == long["windows"][0]  # sinks only matter once the window rolls
        neither = student["long_sinks_rope_window"]  # no sinks and the text at the window's start
        assert neither["sink_frames"] == 0 and neither["windows"][0] == long["windows"][0]
        for w in long["windows"]:  # every scored direction is read as one of the four relations
            assert sum(w["direction_reads"].values()) == w["direction_n"]
        recache = student["long_kv_recache"]
        assert recache["frames"] == 24 and [w["start_frame"] for w in recache["windows"]] == [0, 8, 16]
        switch = student["switch"]
        assert switch["switch_frame"] == 8 and switch["frames"] == 24
        old, new = switch["examples"][0]
        assert all(a != b for a, b in zip(parse_caption(old), parse_caption(new)))
        for variant in ("recache", "keep_old_kv"):
            assert set(switch[variant]["after"]) == {"color_acc", "shape_acc", "direction_acc", "stats_in_range"}
            assert set(switch[variant]["after_reads_old"]) == {"color_share", "shape_share", "direction_share"}
        assert switch["recache"]["sink_frames"] == 2 and switch["recache_sinks_0"]["sink_frames"] == 0
        # the window before the switch streams before the cache rolls: no sink has mattered yet
        assert switch["recache_sinks_0"]["before"] == switch["recache"]["before"]
        assert "switch_new_prompt_ge_90pct_within_one_window" in student["criteria"]
        # --rope-anchor both: the absolute runs are judged, the switch is streamed anchored too (a pinned re-cache)
        assert student["rope_anchor"] == switch["rope_anchor"] == "absolute"
        anchored_switch = student["switch_rope_window"]
        assert anchored_switch["rope_anchor"] == "window" and anchored_switch["switch_frame"] == 8
        assert "switch_rope_window_ge_90pct" in student["criteria"]
        assert student["eval_seconds"] > 0 and isinstance(long["misses_by_caption"], dict)
    assert report["teacher"]["eval_seconds"] > 0
    import av

    for name in ("self_forcing", "long_rollout"):  # the first long clips come back as video with their captions
        clips = out / name / "long_clips"
        rows = (clips / "samples.csv").read_text().splitlines()
        assert len(rows) == 5 and rows[0] == "path,text" and len(list(clips.glob("*.mp4"))) == 4
        with av.open(str(clips / rows[1].split(",")[0])) as container:
            assert sum(1 for _ in container.decode(video=0)) == report[name]["long"]["frames"]
    # the long-rollout student trained with the rolling cache and sinks of its config
    config = (out / "configs/long_rollout.py").read_text()
    assert "LongRollout" not in config and "long_rollout_gpu.py" in config and "motion='wrap'" in config
    # a second call reuses every stage instead of training again
    capsys.readouterr()
    assert bench.main(["--tiny", "--out", str(out), "--device", "cpu", "--stop-after", "long_rollout"]) == {}
    printed = capsys.readouterr().out
    assert all(f"== {name}: reusing" in printed for name in bench.STAGES)
    assert all(bench.last_checkpoint(out / name) == path for name, path in stages.items())
    # --score: the teacher and the named student only, from the reused stages
    scored = bench.main(["--tiny", "--out", str(out), "--device", "cpu", "--score", "long_rollout"])
    assert "self_forcing" not in scored and scored["long_rollout"]["ckpt"] == str(stages["long_rollout"])
    assert scored["teacher"]["ckpt"] == str(stages["teacher"])
    assert "pending" not in scored  # a complete report names nothing it lacks
    # a call cut between two switches (the students' own evaluations come first) leaves report.partial.json with both
    # students and the first one's switch, naming the part it lacks; the complete report.json of the call before
    # stays as it was; the report CLI prints the partial one as such
    from benchmarks.long_streaming_report import main as reprint
    from benchmarks.long_streaming_report import student_differences

    add_switch = bench.add_switch

    def cut(args, name, *rest):
        if name == "long_rollout":
            raise KeyboardInterrupt(name)  # as a call's time limit would stop it
        return add_switch(args, name, *rest)

    monkeypatch.setattr(bench, "add_switch", cut)
    capsys.readouterr()
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--tiny", "--out", str(out), "--device", "cpu", "--prompt-switch", "--score", "self_forcing",
                    "long_rollout"])  # fmt: skip
    printed = capsys.readouterr().out
    assert "evaluated self_forcing in" in printed and "evaluated self_forcing switch in" in printed  # each as it ends
    assert json.loads((out / "report.json").read_text()) == json.loads(json.dumps(scored))
    partial = json.loads((out / "report.partial.json").read_text())
    assert partial["pending"] == ["long_rollout switch"]
    assert bench.student_names(partial) == ["self_forcing", "long_rollout"] and "differences" not in partial
    switched = partial["self_forcing"]  # its switch judged with it, plain and over resamples
    assert "switch_new_prompt_ge_90pct_within_one_window" in switched["criteria"]
    assert "switch_new_prompt_ge_90pct_within_one_window" in switched["criteria_resampled"]
    assert "switch" not in partial["long_rollout"]
    assert not any("switch" in key for key in partial["long_rollout"]["criteria"])
    assert partial["long_rollout"]["criteria"] == scored["long_rollout"]["criteria"]  # the same seeds, the same verdict
    reprinted = reprint([str(out / "report.partial.json")])  # drawn as the run draws its criteria
    assert reprinted["differences"] == student_differences(partial, 2000, partial["seeds"][0])
    assert set(reprinted["differences"]) == {"long_rollout - self_forcing"}
    printed = capsys.readouterr().out
    assert "partial report: the evaluation stopped before long_rollout switch" in printed
    monkeypatch.undo()
    # --switch-only: the prompt switch alone from the trained students (nothing trains, no teacher sampling), with
    # the kept window re-rendered under the new prompt from 0.5 and from 1.0
    stamps = {name: path.stat().st_mtime_ns for name, path in stages.items()}
    capsys.readouterr()
    flags = ["--switch-only", "--switch-renoise", "0.5", "1.0", "--score", "long_rollout"]
    only = bench.main(["--tiny", "--out", str(out), "--device", "cpu", *flags])
    printed = capsys.readouterr().out
    assert "==" not in printed and "renoise_0.5" in printed and "boundary change" in printed
    assert json.loads((out / "report_switch.json").read_text()) == json.loads(json.dumps(only))
    assert not (out / "report_switch.partial.json").exists()  # removed once the complete report is written
    assert "teacher" not in only and bench.student_names(only) == ["long_rollout"]
    assert {name: path.stat().st_mtime_ns for name, path in stages.items()} == stamps
    assert all(bench.last_checkpoint(out / name) == path for name, path in stages.items())
    switch = only["long_rollout"]["switch"]
    assert switch["switch_frame"] == 8 and {"recache", "keep_old_kv", "renoise_0.5", "renoise_1.0"} <= set(switch)
    for run in ("renoise_0.5", "renoise_1.0"):
        r = switch[run]
        assert r["switch_renoise"] == float(run.split("_")[1]) and r["sink_frames"] == switch["recache"]["sink_frames"]
        assert r["before"] == switch["recache"]["before"]  # the frames handed out before the switch do not change
        for window in ("after", "after_second", "before"):
            assert all(0.0 <= v <= 1.0 for v in r[window].values() if v is not None)
        assert all(0.0 <= v <= 1.0 for v in r["after_reads_old"].values())
        assert r["new_prompt_ge_90pct"] in (True, False, None) and r["boundary_change"]["ratio"] > 0
    with pytest.raises(SystemExit):  # the re-render varies the switch: without it, a parser error
        bench.parse_args(["--tiny", "--switch-renoise", "0.5"])


def test_long_tuning_after_self_forcing_is_compared_with_as_much_more_self_forcing(tmp_path, capsys):
    """--long-init self_forcing: the long-rollout student and the control (Self-Forcing trained on from its own
    student, for the same budget) both start from the Self-Forcing checkpoint, and all three students are scored."""
    bench = _benchmark()
    out = tmp_path / "run"
    report = bench.main(["--tiny", "--out", str(out), "--device", "cpu", "--launcher", "in-process", "--long-init",
                         "self_forcing"])  # fmt: skip
    printed = capsys.readouterr().out
    assert report["long_init"] == "self_forcing"
    assert bench.student_names(report) == ["self_forcing", "long_rollout", bench.CONTROL]
    start = str(bench.last_checkpoint(out / "self_forcing"))
    for name in ("long_rollout", bench.CONTROL):
        assert report[name]["ckpt"] == str(bench.last_checkpoint(out / name))
        assert report[name]["training"]["steps"] == 2 and report[name]["long"]["frames"] == 24
        init = (out / "configs" / f"{name}.py").read_text()
        assert ("LongRollout" not in init) and (
            "long_rollout_gpu.py" if name == "long_rollout" else "self_forcing_gpu.py"
        ) in init
        command = next(line for line in printed.splitlines() if line.startswith(f"== {name}: "))
        assert f"--models.student.init_from.path {start} " in command
    # LongRollout against each other student on the same clips: the shares are the windows' own accuracies
    assert set(report["differences"]) == {"long_rollout - self_forcing", f"long_rollout - {bench.CONTROL}"}
    for other in ("self_forcing", bench.CONTROL):
        lines = report["differences"][f"long_rollout - {other}"]
        assert len(lines) == 8 and lines["color_first_window"]["draws"] == 2000
        for name, student in (("first", "long_rollout"), ("second", other)):
            windows = report[student]["long"]["windows"]
            assert lines["color_first_window"][name] == pytest.approx(windows[0]["color_acc"])
            later = sum(w["color_acc"] for w in windows[1:]) / len(windows[1:])
            assert lines["color_after_first_window"][name] == pytest.approx(later)
        assert f"long_rollout - {other}, the same clips over 2000 paired resamples" in printed
    # and a saved report printed again: the same differences, and a file that is no report is refused with exit 2
    from benchmarks.long_streaming_report import main as reprint

    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps({k: v for k, v in report.items() if k != "differences"}))
    seed = report["differences"]["long_rollout - self_forcing"]["color_first_window"]["seed"]  # the run's --seed
    again = reprint([str(saved), "--seed", str(seed)])
    assert json.loads(json.dumps(again["differences"])) == json.loads(json.dumps(report["differences"]))
    assert "long_rollout - self_forcing, the same clips" in capsys.readouterr().out
    kept = json.loads(json.dumps(report))  # a report that holds differences keeps them unless --draws / --seed
    kept["differences"]["long_rollout - self_forcing"]["color_first_window"]["seed"] = -1
    saved.write_text(json.dumps(kept))
    assert reprint([str(saved)])["differences"] == kept["differences"]
    assert (
        reprint([str(saved), "--draws", "50"])["differences"]["long_rollout - self_forcing"]["color_first_window"][
            "draws"
        ]
        == 50
    )
    older = json.loads(json.dumps(report))  # a report from before a key the tables print: one line, exit 2
    older["self_forcing"]["long"].pop("background_by_frame")
    saved.write_text(json.dumps(older))
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        reprint([str(saved)])
    assert refused.value.code == 2 and "lacks 'background_by_frame'" in capsys.readouterr().err
    saved.write_text("{}")
    with pytest.raises(SystemExit) as refused:
        reprint([str(saved)])
    assert refused.value.code == 2 and "not a long_streaming_quality report" in capsys.readouterr().err
    # benchmarks.streaming_drift on these runs: per-frame background over 2x the clip, accuracy over the first clip
    from benchmarks.streaming_drift import main as drift

    runs = [str(out / "ode"), str(out / "self_forcing")]
    config = str(out / "configs" / "self_forcing.py")
    result = drift(
        ["--config", config, "--runs", *runs, "--prompts", "3", "--frames", "16", "--out", str(tmp_path / "d.json")]
    )
    assert json.loads((tmp_path / "d.json").read_text()) == json.loads(json.dumps(result))
    for run in runs:
        row = result["runs"][run]
        assert len(row["background_by_frame"]) == 16 and row["window_frames"] == report["self_forcing"]["window_frames"]
        assert set(row["clip_scores"]) == {"color_acc", "shape_acc", "direction_acc", "stats_in_range"}
    # and their prompt switch, plain and re-rendered: the window before the switch is the same in every run
    switched = drift(
        ["--config", config, "--runs", runs[1], "--prompts", "3", "--prompt-switch", "--switch-renoise", "1"]
    )
    switch = switched["runs"][runs[1]]["switch"]
    assert {"recache", "keep_old_kv", "renoise_1.0"} <= set(switch)
    assert (
        switch["renoise_1.0"]["switch_renoise"] == 1.0
        and switch["renoise_1.0"]["before"] == switch["recache"]["before"]
    )
    assert all(0 <= switch[k]["after"]["color_acc"] <= 1 for k in ("recache", "renoise_1.0"))


@pytest.mark.parametrize("motion", ["bounce", "wrap"])
def test_teacher_row_scores_ground_truth_clips_of_the_benchmark_as_one(motion):
    """The teacher's (and students') training-length row, done to the generator's own 64x64x16 clips with the
    benchmark's prompts and seeds: all 1.0. A bounce clip that turns at a wall inside the clip is judged by the bounce
    rule, not by its caption's direction (which ground truth misses in about 1 clip of 4)."""
    from opensora.datasets import moving_shapes as ms

    prompts = ms.all_captions()[::6]
    videos = [
        ms.render_from_attributes(*ms.parse_caption(p), 64, 64, 16, 424242 + i, motion=motion, reference_frames=16)
        for i, p in enumerate(prompts)
    ]
    scores = _benchmark().accuracy(videos, prompts, motion)
    hits = scores.pop("clip_hits")  # one hit string per clip, for the resampled criteria
    assert scores == dict(color_acc=1.0, shape_acc=1.0, direction_acc=1.0, all_acc=1.0, confusions={})
    # no miss; a bounce clip without a majority direction is not scored for direction ("."), as in the accuracy
    assert all("0" not in "".join(h) and "1" in "".join(h) for h in hits.values())
    assert set(hits) == {"color", "shape", "direction"}
    assert len(hits["color"]) == len(prompts)
    if motion == "bounce":  # a clip that turns back is wrong when it is read against its caption alone
        from opensora.eval.moving_shapes import score_rows

        plain = score_rows([(str(i), p, v, None) for i, (p, v) in enumerate(zip(prompts, videos))])
        assert plain.direction_acc < 1.0


def test_wrong_reads_name_the_caption_value_and_what_the_clip_shows():
    """``confusions``: a clip of one caption scored against another reads as "caption value->shown value" for each
    attribute that differs, counted over clips; the printed line lists them most frequent first."""
    from opensora.datasets import moving_shapes as ms

    bench = _benchmark()
    shown = ["a red circle moving left", "a red circle moving left", "a blue circle moving up"]
    videos = [
        ms.render_from_attributes(*ms.parse_caption(p), 64, 64, 16, 7 + i, motion="wrap", reference_frames=16)
        for i, p in enumerate(shown)
    ]
    captions = ["a green circle moving left", "a green circle moving right", "a blue circle moving up"]
    scores = bench.accuracy(videos, captions, "wrap")
    assert scores["confusions"] == {"color": {"green->red": 2}, "direction": {"right->left": 1}}
    assert scores["color_acc"] == pytest.approx(1 / 3) and scores["direction_acc"] == pytest.approx(2 / 3)
    from benchmarks.long_streaming_report import confusions_text

    assert confusions_text(scores) == "colour green->red 2; direction right->left 1"


def _record_trainings(bench, tmp_path, monkeypatch) -> list:
    """Stage trainings recorded instead of run: each trainer command as ``(stage, command)``, in order, with the
    stage's final checkpoint made as the trainer would."""
    calls = []

    def record(command, **_):
        stage = Path(command[command.index("--outputs") + 1]).name
        calls.append((stage, command))
        (tmp_path / stage / "checkpoints" / "step-0000001").mkdir(parents=True)

    monkeypatch.setattr(bench.subprocess, "run", record)
    monkeypatch.setattr(bench, "stage_config", lambda args, stage: tmp_path / f"{stage}.py")
    return calls


def _record_evaluation(bench, monkeypatch) -> dict:
    """The checkpoints handed to the evaluation, recorded instead of streamed and scored."""
    evaluated = {}
    monkeypatch.setattr(bench, "evaluate", lambda args, checkpoints, save=None: evaluated.update(checkpoints) or {})
    monkeypatch.setattr(bench, "print_report", lambda report, students: None)
    return evaluated


def test_student_steps_give_long_rollout_and_the_control_equal_steps(tmp_path, monkeypatch):
    """``--student-steps N``: LongRollout and the control train N steps each, their minutes only a cap; the other
    stages keep their minutes (the trainer commands, recorded instead of run)."""
    bench = _benchmark()
    calls = _record_trainings(bench, tmp_path, monkeypatch)
    flags = ["--out", str(tmp_path), "--long-init", "self_forcing", "--student-steps", "120", "--student-minutes", "8"]
    assert bench.main([*flags, "--stop-after", "long_rollout"]) == {}
    commands = dict(calls)

    def budget(stage):
        command = commands[stage]
        return command[command.index("--max-steps") + 1], command[command.index("--max-minutes") + 1]

    assert budget("long_rollout") == budget(bench.CONTROL) == ("120", "8.0")
    assert budget("self_forcing") == ("1000000", "8.0") and budget("ode")[0] == "1000000"


def test_stage_steps_stop_each_named_stage_by_steps_with_its_minutes_as_a_cap(tmp_path, monkeypatch):
    """``--stage-steps STAGE=N``: each named stage trains N steps, its minutes only a cap; unnamed stages keep
    their minutes; ``--student-steps`` still sets LongRollout's and the control's."""
    bench = _benchmark()
    calls = _record_trainings(bench, tmp_path, monkeypatch)
    flags = ["--out", str(tmp_path), "--long-init", "self_forcing", "--teacher-minutes", "6", "--ode-minutes", "2"]
    flags += ["--stage-steps", "teacher=4200", "ode=880", "self_forcing=400", "--student-steps", "80"]
    assert bench.main([*flags, "--stop-after", "long_rollout"]) == {}
    commands = dict(calls)

    def budget(stage):
        command = commands[stage]
        return command[command.index("--max-steps") + 1], command[command.index("--max-minutes") + 1]

    assert budget("teacher") == ("4200", "6.0") and budget("ode") == ("880", "2.0")
    assert budget("self_forcing") == ("400", "2.5")
    assert budget("long_rollout") == budget(bench.CONTROL) == ("80", "2.5")


@pytest.mark.parametrize(
    "bad, message",
    [
        (["--stage-steps", "critic=10"], "--stage-steps critic=10: STAGE=N with N >= 1"),
        (["--stage-steps", "teacher=0"], "--stage-steps teacher=0: STAGE=N with N >= 1"),
        (["--stage-steps", "ode"], "--stage-steps ode: STAGE=N with N >= 1"),
        (["--stage-steps", "self_forcing_more=9", "--student-steps", "8"], "--student-steps both set its steps"),
    ],
)
def test_bad_stage_steps_are_refused_with_exit_code_2(tmp_path, capsys, bad, message):
    with pytest.raises(SystemExit) as stopped:
        _benchmark().parse_args(["--out", str(tmp_path), *bad])
    assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_only_stage_trains_one_stage_from_trained_inputs_so_two_can_run_at_once(tmp_path, monkeypatch, capsys):
    """``--only-stage``: long_rollout and its control each train alone from the same trained stages (two GPUs at
    once); a missing input stops with exit code 2 instead of training it; the evaluation then reuses both."""
    bench = _benchmark()
    calls = _record_trainings(bench, tmp_path, monkeypatch)
    trained = lambda: [stage for stage, _ in calls]  # noqa: E731
    flags = ["--out", str(tmp_path), "--long-init", "self_forcing"]
    with pytest.raises(SystemExit) as stopped:
        bench.main([*flags, "--only-stage", "long_rollout"])
    assert stopped.value.code == 2 and "stage teacher has no checkpoint" in capsys.readouterr().out
    assert trained() == []
    assert bench.main([*flags, "--only-stage", "teacher"]) == {} and trained() == ["teacher"]
    assert bench.main([*flags, "--stop-after", "self_forcing"]) == {} and trained()[1:] == ["ode", "self_forcing"]
    assert bench.main([*flags, "--only-stage", bench.CONTROL]) == {} and trained()[3:] == [bench.CONTROL]
    assert bench.main([*flags, "--only-stage", "long_rollout"]) == {} and trained()[4:] == ["long_rollout"]
    evaluated = _record_evaluation(bench, monkeypatch)
    bench.main(flags)
    assert len(trained()) == 5 and bench.student_names(evaluated) == ["self_forcing", "long_rollout", bench.CONTROL]
    for refused in (
        ["--only-stage", bench.CONTROL],  # the control belongs to --long-init self_forcing
        ["--only-stage", "long_rollout", "--students", "self_forcing"],  # a stage this run never reaches
        ["--only-stage", "teacher", "--teacher-ckpt", str(tmp_path)],
        ["--switch-sink-frames", "0"],  # a variant of the prompt switch, which this run does not score
    ):
        with pytest.raises(SystemExit):
            bench.parse_args(refused)


def test_self_forcing_only_trains_no_long_rollout_student_and_scores_self_forcing(tmp_path, monkeypatch):
    """``--students self_forcing``: teacher -> causal init -> Self-Forcing, then the evaluation of that student alone
    (questions about inference need no long-rollout training)."""
    bench = _benchmark()
    calls = _record_trainings(bench, tmp_path, monkeypatch)
    evaluated = _record_evaluation(bench, monkeypatch)
    bench.main(["--out", str(tmp_path), "--students", "self_forcing"])
    assert [stage for stage, _ in calls] == ["teacher", "ode", "self_forcing"]
    assert bench.student_names(evaluated) == ["self_forcing"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--students", "self_forcing", "--stop-after", "long_rollout"])


def test_real_guidance_sets_the_dmd_stages_real_score_scale_only(tmp_path):
    """``--real-guidance 2``: Self-Forcing, LongRollout and the control train with that CFG scale on DMD's real score;
    the teacher and the causal init are untouched; the configs build with it. ``--long-context-steps full`` and
    ``--long-critic-windows 4 --long-update-every 2`` reach the long-rollout stage's method."""
    bench = _benchmark()
    args = bench.parse_args(["--out", str(tmp_path), "--real-guidance", "2"])
    from opensora.config import load_config

    for stage in bench.DMD_STAGES:
        assert load_config(str(bench.stage_config(args, stage))).method.real_guidance_scale == 2.0
    for stage in ("teacher", "ode"):
        assert "real_guidance_scale" not in bench.stage_config(args, stage).read_text()
    plain = bench.parse_args(["--out", str(tmp_path / "plain")])
    assert load_config(str(bench.stage_config(plain, "self_forcing"))).method.real_guidance_scale == 4.0
    assert load_config(str(bench.stage_config(plain, "long_rollout"))).method.get("context_steps", "exit") == "exit"
    full = bench.parse_args(["--out", str(tmp_path / "full"), "--long-context-steps", "full"])
    assert load_config(str(bench.stage_config(full, "long_rollout"))).method.context_steps == "full"
    assert "critic_windows" not in bench.stage_config(plain, "long_rollout").read_text()
    flags = ["--long-critic-windows", "4", "--switch-prob", "0", "--long-update-every", "2"]
    windows = bench.parse_args(["--out", str(tmp_path / "w"), *flags, "--long-first-window-share", "0.25"])
    method = load_config(str(bench.stage_config(windows, "long_rollout"))).method
    assert method.critic_windows == 4 and method.student_update_every == 2 and method.first_window_share == 0.25
    assert "critic_windows" not in bench.stage_config(windows, "self_forcing").read_text()
    for refused in (["--long-critic-windows", "2"], ["--long-critic-windows", "2", "--switch-prob", "0",
                    "--long-context-steps", "full"], ["--long-critic-windows", "0"], ["--long-update-every", "0"],
                    ["--long-first-window-share", "1.5"]):  # fmt: skip
        with pytest.raises(SystemExit):  # before any stage trains, not when the long-rollout stage builds
            bench.parse_args(["--out", str(tmp_path / "r"), *refused])


def test_long_rollout_can_train_without_sinks_at_the_window_anchor(tmp_path):
    """``--long-sink-frames 0 --long-rope-anchor window``: the long-rollout stage's config trains that regime, prompt
    switches included (the re-cache pins the anchor); the config builds the method."""
    bench = _benchmark()
    args = bench.parse_args(["--out", str(tmp_path), "--long-sink-frames", "0", "--long-rope-anchor", "window"])
    text = bench.stage_config(args, "long_rollout").read_text()
    assert "kv_sink_frames=0" in text and "kv_rope_anchor='window'" in text and "switch_prob" not in text
    # the streamed regime follows: the sampler's keys in the stage config, and every student streamed that way too
    assert "sink_frames = 0" in text and "rope_anchor = 'window'" in text
    assert (args.sink_frames_variant, args.rope_anchor) == (0, "window")  # every student streamed that way
    from opensora.config import load_config

    cfg = load_config(str(tmp_path / "configs" / "long_rollout.py"))
    assert (cfg.method.kv_sink_frames, cfg.method.kv_rope_anchor, cfg.method.switch_prob) == (0, "window", 0.25)
    assert (cfg.sink_frames, cfg.rope_anchor) == (0, "window")
    with pytest.raises(SystemExit):
        bench.parse_args(["--long-sink-frames", "0", "--sink-frames-variant", "1"])


def test_validation_every_gives_the_students_a_per_window_curve(tmp_path):
    """``--validation-every 40``: the DMD students (not the teacher or the causal init) validate every 40 steps at
    8x the 16-frame clip under the run's motion rule; the report's training summary keeps each validation's
    worst-window scores. ``--long-validation-every`` sets LongRollout's own interval."""
    bench = _benchmark()
    args = bench.parse_args(["--out", str(tmp_path), "--validation-every", "40", "--motion", "bounce"])
    from opensora.config import load_config

    for stage in bench.DMD_STAGES:
        cfg = load_config(str(bench.stage_config(args, stage)))
        validation = cfg.validation
        assert (validation.every, validation.long_frames, validation.motion) == (40, 128, "bounce")
        assert validation.score == "moving_shapes" and len(validation.prompts) == 12  # the base config's captions
        # the curve streams as the evaluation does: its sink frames, and (no window in the config but LongRollout's)
        # the clip's window minus a chunk, validation_windows' default
        assert cfg.sink_frames == args.sink_frames == 2
        assert cfg.get("window_frames") == (14 if stage == "long_rollout" else None)
    for stage in ("teacher", "ode"):
        assert "validation" not in bench.stage_config(args, stage).read_text()
    # --long-validation-every: LongRollout, a few hundred iterations, validates oftener, with a checkpoint at each
    # validation where the best is kept; the control keeps Self-Forcing's interval (validations cost it minutes)
    flags = ["--validation-every", "150", "--long-validation-every", "30", "--student-checkpoint", "best"]
    longer = bench.parse_args(["--out", str(tmp_path / "l"), *flags])
    for stage, every in (("self_forcing", 150), ("long_rollout", 30), (bench.CONTROL, 150)):
        assert load_config(str(bench.stage_config(longer, stage))).validation.every == every
        assert bench.checkpoint_every(longer, stage) == every
    with pytest.raises(SystemExit):  # nothing for it to go beside
        bench.parse_args(["--out", str(tmp_path / "r"), "--long-validation-every", "30"])
    run = tmp_path / "self_forcing"
    run.mkdir()
    rows = [
        {"step": 1, "loss": 1.0, "step_time": 0.5},
        {"step": 40, "val/stats_window_min": 0.25, "val/color_window_min": 0.9, "val/stats_vs_first_min": 0.8},
        {"step": 40, "loss": 0.5, "step_time": 0.7},
        {"step": 80, "val/stats_window_min": 0.5, "val/color_window_min": 1.0},
    ]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    summary = bench.training_summary(run)
    assert summary["steps"] == 2 and summary["validation_window_min"] == [
        {"step": 40, "stats_window_min": 0.25, "color_window_min": 0.9},
        {"step": 80, "stats_window_min": 0.5, "color_window_min": 1.0},
    ]


def test_student_checkpoint_best_scores_and_builds_on_each_students_best_validation_step(tmp_path, monkeypatch, capsys):
    """``--student-checkpoint best``: the DMD stages save a checkpoint at every validation and keep their best by
    ``--best-metric`` (here the recorded Self-Forcing run's best.json names step 50 of 100); LongRollout and the
    control start from it and the evaluation scores it; the teacher and the causal init still save once."""
    from opensora.best_checkpoint import note_value
    from opensora.config import load_config

    bench = _benchmark()
    flags = ["--out", str(tmp_path), "--validation-every", "50", "--validation-prompts", "24"]
    flags += ["--student-checkpoint", "best", "--long-init", "self_forcing"]
    args = bench.parse_args(flags)
    cfg = load_config(str(bench.stage_config(args, "self_forcing")))
    assert cfg.validation.best_metric == "val/all_window_min" and cfg.validation.batch_size == 24
    from opensora.training.validation import validation_settings

    cfg.ckpt_every = bench.checkpoint_every(args, "self_forcing")  # what the stage's --ckpt-every sets
    assert validation_settings(cfg)["best_metric"] == "val/all_window_min"  # the trainer accepts the stage config
    assert len(set(cfg.validation.prompts)) == 24
    from collections import Counter

    from opensora.datasets.moving_shapes import parse_caption

    for count in (6, 12, 24, 36, 64):  # as even as the count allows, every caption once
        prompts = bench.validation_prompts(count)
        assert len(set(prompts)) == count
        for i, values in enumerate((6, 3, 4)):
            uses = Counter(parse_caption(p)[i] for p in prompts)
            assert len(uses) == min(values, count) and max(uses.values()) - min(uses.values()) <= 1
    assert (
        "best_metric"
        not in load_config(str(bench.stage_config(bench.parse_args(flags[:6]), "self_forcing"))).validation
    )

    calls = _record_trainings(bench, tmp_path, monkeypatch)
    real_record = bench.subprocess.run

    def record_with_best(command, **kwargs):
        real_record(command, **kwargs)
        run = Path(command[command.index("--outputs") + 1])
        if run.name == "self_forcing":  # validated at 50 (0.8) and 100 (0.4): the best is step 50
            for step in (50, 100):
                (run / "checkpoints" / f"step-{step:07d}").mkdir(parents=True)
                (run / "checkpoints" / f"step-{step:07d}" / "meta.json").write_text(json.dumps(dict(step=step)))
            note_value(run, "val/all_window_min", 50, 0.8)
            note_value(run, "val/all_window_min", 100, 0.4)

    monkeypatch.setattr(bench.subprocess, "run", record_with_best)
    evaluated = _record_evaluation(bench, monkeypatch)
    bench.main(flags)
    commands = dict(calls)
    every = {stage: command[command.index("--ckpt-every") + 1] for stage, command in commands.items()}
    assert every == dict(teacher="0", ode="0", self_forcing="50", long_rollout="50", **{bench.CONTROL: "50"})
    best = tmp_path / "self_forcing" / "checkpoints" / "step-0000050"
    for stage in ("long_rollout", bench.CONTROL):
        command = commands[stage]
        assert command[command.index("--models.student.init_from.path") + 1] == str(best)
    assert evaluated["self_forcing"] == best
    # no best.json (LongRollout's recorded run kept none): its last checkpoint
    assert evaluated["long_rollout"] == tmp_path / "long_rollout" / "checkpoints" / "step-0000001"
    assert bench.selection_record(tmp_path / "self_forcing", best)["step"] == 50
    assert bench.selection_record(tmp_path / "self_forcing", best)["last_step"] == 100
    # a stage killed between its validation checkpoints (no finished marker) trains on from them on the next call;
    # a finished one is reused
    (tmp_path / "self_forcing" / bench.FINISHED).unlink()
    calls.clear()
    monkeypatch.setattr(bench.subprocess, "run", lambda command, **_: calls.append(("self_forcing", command)))
    bench.main([*flags, "--stop-after", "self_forcing"])
    assert [stage for stage, _ in calls] == ["self_forcing"] and "--resume" in calls[0][1]
    assert (tmp_path / "self_forcing" / bench.FINISHED).is_file()
    # a best.json that names a checkpoint that is not there (a run killed before its final save): the last one
    note_value(tmp_path / "long_rollout", "val/all_window_min", 7, 0.9)
    last = tmp_path / "long_rollout" / "checkpoints" / "step-0000001"
    assert bench.chosen_checkpoint(args, "long_rollout", last) == last
    # a stage reused from a run that chose by another metric: its choice stands, and the run says so
    other = bench.parse_args([*flags, "--best-metric", "val/stats_window_min"])
    capsys.readouterr()
    assert bench.chosen_checkpoint(other, "self_forcing", tmp_path / "self_forcing" / "checkpoints") == best
    said = capsys.readouterr().out
    assert "chosen by val/all_window_min as it trained, not by --best-metric val/stats_window_min" in said
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", str(tmp_path), "--student-checkpoint", "best"])  # nothing to choose by


def test_more_prompts_than_captions_repeat_the_captions_with_new_seeds(tmp_path):
    """``--num-prompts 200``: every caption 2-3 times, each clip at its own seed, so a window's share moves 0.005 a
    clip instead of 0.014."""
    from opensora.datasets.moving_shapes import all_captions

    bench = _benchmark()
    args = bench.parse_args(["--out", str(tmp_path), "--num-prompts", "200", "--seed", "5"])
    prompts, seeds, _, clip, header = bench.evaluation_inputs(args)
    captions = all_captions()
    assert len(prompts) == 200 and prompts[:72] == captions and prompts[72:144] == captions
    assert seeds == list(range(5, 205)) and header["prompts"] == 200
    assert clip[0] == 16


def test_teacher_gate_trains_a_teacher_below_it_on_and_a_repeated_call_trains_nothing_more(tmp_path, capsys):
    """``--teacher-gate 0.99 --teacher-gate-rounds 1``: the tiny teacher (2 steps) scores far below 0.99 on the gate's
    own seeds, so it trains one round more from its checkpoint (``--resume auto``: steps 3-4), is checked again and,
    the rounds spent, is used as it is; the checks are kept in teacher/gate.json. The same call again finds both
    checks and trains nothing."""
    bench = _benchmark()
    out = tmp_path / "run"
    argv = ["--tiny", "--out", str(out), "--device", "cpu", "--launcher", "in-process", "--stop-after", "teacher"]
    argv += ["--teacher-gate", "0.99", "--teacher-gate-rounds", "1", "--seed", "7"]
    assert bench.main(argv) == {}
    gate = json.loads((out / "teacher" / "gate.json").read_text())
    assert gate["gate"] == 0.99 and gate["seeds"] == [7 + bench.GATE_SEED_OFFSET, 7 + bench.GATE_SEED_OFFSET + 3]
    assert [check["step"] for check in gate["checks"]] == [2, 4]
    assert bench.last_checkpoint(out / "teacher").name == "step-0000004"
    assert all(min(check[k] for k in bench.GATE_KEYS) < 0.99 for check in gate["checks"])
    best = max(gate["checks"], key=lambda c: (min(c[k] for k in bench.GATE_KEYS), c["step"]))
    assert gate["chosen"] == best["step"]  # below the gate after its rounds: the best check, recorded
    printed = capsys.readouterr().out
    assert "teacher gate at step 2" in printed and "teacher gate at step 4" in printed and "(below 0.99)" in printed
    assert bench.main(argv) == {}  # again: both checks on record, the rounds spent
    assert json.loads((out / "teacher" / "gate.json").read_text())["checks"] == gate["checks"]
    assert bench.last_checkpoint(out / "teacher").name == "step-0000004" and "reusing" in capsys.readouterr().out
    for refused in (["--teacher-gate", "0"], ["--teacher-gate", "0.9", "--teacher-ckpt", str(tmp_path)]):
        with pytest.raises(SystemExit):
            bench.parse_args(refused)


def test_a_teacher_below_the_gate_is_its_best_check_not_its_last(tmp_path, capsys):
    """Chain F's gate: 1.000 / 0.972 / 0.875 at step 4006, then 0.847 after a round more. The gate chooses the best
    check whose checkpoint is still there (a passed last check: the last) and records it; the students and a later
    call's reuse build on the recorded choice. No gate, no recorded choice (a run from before) or a last checkpoint
    the gate never judged leave the last checkpoint."""
    bench = _benchmark()
    run = tmp_path / "teacher"
    ckpts = {step: run / "checkpoints" / f"step-{step:07d}" for step in (2, 4, 6)}
    for step, path in ckpts.items():
        path.mkdir(parents=True)
        (path / "meta.json").write_text(json.dumps(dict(step=step)))  # where a checkpoint records its step
    assert bench.gated_teacher(run, ckpts[4]) == ckpts[4]  # no gate.json
    check = lambda step, direction: dict(step=step, color_acc=1.0, shape_acc=0.972, direction_acc=direction)  # noqa: E731
    checks = [check(2, 0.875), check(4, 0.847)]
    (run / "gate.json").write_text(json.dumps(dict(gate=0.95, checks=checks)))
    assert bench.gated_teacher(run, ckpts[4]) == ckpts[4]  # no choice recorded: a run from before the gate chose
    assert bench.best_gate_check(checks, 0.95, run)["step"] == 2
    assert "using step 2, the best check (0.875 at worst), not the last" in capsys.readouterr().out
    assert bench.best_gate_check(checks, 0.84, run)["step"] == 4  # the last passed a lower gate
    (run / "gate.json").write_text(json.dumps(dict(gate=0.95, checks=checks, chosen=2)))
    assert bench.gated_teacher(run, ckpts[4]) == ckpts[2]
    args = bench.parse_args(["--tiny", "--out", str(tmp_path)])
    assert bench.chosen_checkpoint(args, "teacher", ckpts[4]) == ckpts[2]  # what a later call's reuse builds on
    assert bench.gated_teacher(run, ckpts[6]) == ckpts[6]  # trained on past the gate's checks: not its call
    shutil.rmtree(ckpts[2])  # pruned (keep_last)
    assert bench.gated_teacher(run, ckpts[4]) == ckpts[4] and "is gone" in capsys.readouterr().out
    assert bench.best_gate_check(checks, 0.95, run)["step"] == 4  # the best still on disk, and it says why
    assert "was pruned" in capsys.readouterr().out


def test_criteria_give_each_re_rendered_switch_its_own_verdict_beside_the_re_cache():
    """``--switch-renoise T``: the re-rendered switch (the one users pick for a prompt change) is judged by its own
    line, not only the re-cache's (which never met it on the GPU)."""
    long = dict(color_vs_first_min=1.0, shape_vs_first_min=0.96, direction_vs_first_min=0.9, stats_window_min=0.4)
    long["flicker"] = dict(edge_over_inside=1.05)
    switch = dict(recache=dict(new_prompt_ge_90pct=False), keep_old_kv=dict(new_prompt_ge_90pct=False))
    switch["renoise_1.0"] = dict(new_prompt_ge_90pct=True)
    student = dict(long=long, over_teacher=dict(color_acc=1.0, shape_acc=0.97), switch=switch)
    from benchmarks.long_streaming_report import criteria

    out = criteria(student, dict(stats_in_range=0.42))
    assert out["switch_new_prompt_ge_90pct_within_one_window"] is False
    assert out["switch_renoise_1.0_new_prompt_ge_90pct_within_one_window"] is True
    assert out["direction_every_window_ge_95pct_of_first"] is False and out["shape_acc_ge_98pct_of_teacher"] is False
    assert out["stats_every_window_ge_95pct_of_teacher"] is True and out["flicker_le_1.1"] is True


def test_flicker_line_shows_the_windows_the_clip_length_and_the_teacher_and_reads_older_reports():
    from benchmarks.long_streaming_report import flicker_text

    old = dict(long=dict(flicker=dict(edge_over_inside=1.13)))  # a report from before the windows
    assert flicker_text(old) == "1.130"
    new = dict(long=dict(flicker=dict(edge_over_inside=1.13, by_window=[1.41, 1.1, None])))
    new.update(flicker=dict(edge_over_inside=1.38), flicker_teacher_same_edges=dict(edge_over_inside=0.99))
    assert flicker_text(new) == (
        "1.130 (by window 1.41, 1.10, -; at the clip length 1.38; the teacher at the same edges 0.99)"
    )


def test_adam_beta1_sets_the_dmd_students_and_critics_momentum_only(tmp_path):
    """``--adam-beta1 0`` (Self-Forcing's public recipe): the student's and the critic's Adam beta1 in every DMD stage,
    beta2 and the learning rates kept from the config; the teacher and the causal init untouched; with ``--tiny`` the
    tiny networks and the betas land in one ``models`` dict (a second assignment would drop the first)."""
    bench = _benchmark()
    from opensora.config import load_config

    args = bench.parse_args(["--out", str(tmp_path), "--adam-beta1", "0"])
    plain = load_config(str(bench.stage_config(bench.parse_args(["--out", str(tmp_path / "p")]), "self_forcing")))
    for stage in bench.DMD_STAGES:
        models = load_config(str(bench.stage_config(args, stage))).models
        for role in ("student", "critic"):
            assert tuple(models[role].optimizer.betas) == (0.0, 0.999)
            assert models[role].optimizer.lr == plain.models[role].optimizer.lr
    assert tuple(plain.models.student.optimizer.betas) == (0.9, 0.999)
    for stage in ("teacher", "ode"):
        assert "betas" not in bench.stage_config(args, stage).read_text()
    tiny = bench.parse_args(["--tiny", "--out", str(tmp_path / "t"), "--adam-beta1", "0.5"])
    cfg = load_config(str(bench.stage_config(tiny, "self_forcing")))
    assert cfg.models.student.model.hidden_size == 32 and cfg.models.critic.precision == "fp32"
    assert tuple(cfg.models.critic.optimizer.betas) == (0.5, 0.999) and cfg.models.teacher.model.hidden_size == 32
    with pytest.raises(SystemExit):
        bench.parse_args(["--adam-beta1", "1.0"])


def test_a_relative_out_means_the_same_directory_to_the_trainer_it_launches(tmp_path, monkeypatch):
    """Run from outside the repository with ``--out run`` (relative) and the torchrun launcher: the stage trains into
    ``./run/teacher`` of the caller's directory, where the benchmark then finds it (the trainer used to run in the
    repository root and wrote elsewhere)."""
    bench = _benchmark()
    monkeypatch.chdir(tmp_path)
    assert bench.main(["--tiny", "--out", "run", "--device", "cpu", "--stop-after", "teacher"]) == {}
    assert bench.last_checkpoint(tmp_path / "run" / "teacher") is not None
    assert not (bench.ROOT / "run").exists()


def test_tiny_stages_keep_the_motion_rule_and_the_tiny_clip_in_one_dataset_line(tmp_path):
    """``--tiny --motion bounce``: every stage's config trains bounce clips at the tiny size (two ``dataset = ...``
    lines in one config file would leave only the second)."""
    from opensora.config import load_config

    bench = _benchmark()
    args = bench.parse_args(["--tiny", "--out", str(tmp_path), "--motion", "bounce"])
    for stage in bench.STAGES:
        dataset = load_config(str(bench.stage_config(args, stage))).dataset
        assert (dataset.motion, dataset.height, dataset.num_frames, dataset.num) == ("bounce", 16, 8, 72), stage


def test_resampled_window_lines_start_from_the_first_window_with_scored_clips():
    """A first window with nothing scored (every clip's direction unscored there) is skipped, as ``summarise_windows``
    skips it: the reference is the first scored window."""
    long = dict(clip_hits=dict(color=["111"] * 4, shape=["111"] * 4, stats=["111"] * 4, direction=[".11", ".10"] * 2))
    student = dict(long=long, clip_hits=dict(color=["1"] * 4, shape=["1"] * 4, direction=["1"] * 4))
    teacher = dict(stats_hits=["1"] * 4, clip_hits=dict(color=["1"] * 4, shape=["1"] * 4, direction=["1"] * 4))
    from benchmarks.long_streaming_report import resampled_criteria

    lines = resampled_criteria(student, teacher, draws=50, seed=0)
    direction = lines["direction_every_window_ge_95pct_of_first"]
    assert direction["observed"] is False and direction["worst_ratio"] == pytest.approx(0.5)  # 2 of 4 against 4 of 4
    assert lines["color_every_window_ge_95pct_of_first"]["observed"] is True


def test_misses_by_caption_name_the_caption_whose_shape_stops_past_the_first_window():
    """Ground-truth wrap clips of 64 frames, the 'left' ones frozen from frame 16 on (a shape that stops at the edge):
    the scorer's misses past the first window all land on 'left', and a clip that misses only its first window
    counts nothing."""
    import numpy as np

    from benchmarks.long_streaming_report import misses_by_caption
    from opensora.datasets.moving_shapes import parse_caption, render_video, sample_motion
    from opensora.eval.moving_shapes_windows import score_windows

    prompts = ["a red circle moving left", "a blue square moving right", "a green circle moving up",
               "a cyan square moving left", "a yellow triangle moving down"]  # fmt: skip
    videos = []
    for i, prompt in enumerate(prompts):
        color, shape, direction = parse_caption(prompt)
        motion = sample_motion(np.random.default_rng(i), color, shape, direction, 64, 64, motion="wrap")
        video = render_video(motion, 64, 64, 64)
        if direction == "left":
            video[16:] = video[16]
        videos.append(video)
    report = score_windows(videos, prompts, 16, motion="wrap")
    misses = misses_by_caption(report["clip_hits"], prompts)
    assert misses == {"direction": {"left": 6}}  # 2 clips x 3 windows past the first, read as static
    assert misses_by_caption(dict(direction=["0111", "1111"]), prompts[:2]) == {}


def test_switch_line_is_judged_again_over_resampled_prompts_against_its_absolute_goal():
    """The switch criterion (the new caption's colour, shape and direction each >= 90% in the window after it) gets a
    pass share like the share lines: 90 of 100 direction hits sits exactly at the goal, so it passes on the clips as
    they are and in P(Bin(100, 0.9) >= 90) = 0.583 of the resamples; a run without per-clip hits gets no line."""
    from benchmarks.long_streaming_report import resampled_criteria

    hits = dict(color=["1"] * 100, shape=["1"] * 100, direction=["1"] * 90 + ["0"] * 10)
    recache = dict(new_prompt_ge_90pct=True, after_clip_hits=hits)
    long = dict(clip_hits=dict(color=["11"] * 100, shape=["11"] * 100, stats=["11"] * 100, direction=["11"] * 100))
    sure = dict(color=["1"] * 100, shape=["1"] * 100, direction=["1"] * 100)
    student = dict(
        long=long, clip_hits=sure, switch={"recache": recache, "renoise_1.0": dict(new_prompt_ge_90pct=None)}
    )
    teacher = dict(stats_hits=["1"] * 100, clip_hits=sure)
    lines = resampled_criteria(student, teacher, draws=2000, seed=3)
    line = lines["switch_new_prompt_ge_90pct_within_one_window"]
    assert line["observed"] is True and line["worst_ratio"] == pytest.approx(0.9)
    assert line["pass_share"] == pytest.approx(0.583, abs=0.03)
    assert "switch_renoise_1.0_new_prompt_ge_90pct_within_one_window" not in lines  # no hits: not judged again
    student["switch"]["recache"]["after_clip_hits"]["direction"] = ["1"] * 89 + ["0"] * 11
    assert (
        resampled_criteria(student, teacher, draws=200, seed=3)["switch_new_prompt_ge_90pct_within_one_window"][
            "observed"
        ]
        is False
    )


def test_a_difference_without_an_interval_prints_dashes_and_criterion_only_refuses_an_unjudged_switch_run(capsys):
    """A difference whose resamples all drew unscored clips has no interval: the line says so instead of failing;
    and --switch-criterion-only with --switch-sink-frames (a run no criterion judges) is refused at the command line."""
    from benchmarks.long_streaming_report import print_differences

    line = dict(draws=1, first=1.0, second=0.0, difference=1.0, interval=None, ahead_share=None, behind_share=None)
    print_differences({"long_rollout - self_forcing": {"direction_first_window": line}})
    assert "1.000 - 0.000 = +1.000 [-]; ahead in -, behind in -" in capsys.readouterr().out
    bench = _benchmark()
    with pytest.raises(SystemExit) as refused:
        bench.parse_args(["--prompt-switch", "--switch-criterion-only", "--switch-sink-frames", "0"])
    assert refused.value.code == 2 and "no criterion judges" in capsys.readouterr().err


def test_differences_split_the_first_window_from_the_later_ones_and_skip_reports_without_per_clip_hits():
    """LongRollout hits direction in every window of 4 clips; Self-Forcing misses the first window of 2 and a later
    window of 1 (3 scored later windows each): +0.5 in the first window, +1/12 after it."""
    from benchmarks.long_streaming_report import student_differences

    def student(direction):
        return dict(long=dict(clip_hits=dict(color=["1111"] * 4, shape=["1111"] * 4, stats=["1111"] * 4,
                                             direction=direction)))  # fmt: skip

    report = dict(long_rollout=student(["1111"] * 4), self_forcing=student(["0111", "0111", "1101", "1111"]))
    lines = student_differences(report, draws=300, seed=1)["long_rollout - self_forcing"]
    assert lines["direction_first_window"]["difference"] == pytest.approx(0.5)
    assert lines["direction_after_first_window"]["difference"] == pytest.approx(1 / 12)
    assert lines["color_first_window"]["difference"] == 0.0 and lines["stats_after_first_window"]["scored"] == 12
    assert student_differences(dict(self_forcing=report["self_forcing"]), draws=10, seed=0) == {}  # no LongRollout
    report["self_forcing"]["long"].pop("clip_hits")  # a report from before per-clip hits were kept
    assert student_differences(report, draws=10, seed=0) == {}


def test_shapes_read_in_worker_processes_are_the_ones_read_in_one():
    """The evaluation reads its clips in the score workers (the clip-length accuracy, the prompt switch's "reads
    the old caption"): the same readings and rows as one process, and a malformed clip is an error, not a crash."""
    import numpy as np

    from opensora.datasets.moving_shapes import parse_caption, render_video, sample_motion
    from opensora.eval.moving_shapes import read_shape, read_shapes, score_rows

    windows = []
    for i, prompt in enumerate(["a red circle moving left", "a blue square moving up", "a green triangle moving down"]):
        motion = sample_motion(np.random.default_rng(i), *parse_caption(prompt), 64, 64, motion="wrap")
        windows.append(render_video(motion, 64, 64, 16))
    alone = [read_shape(w, True) for w in windows]
    assert read_shapes(windows, True, workers=2) == alone == read_shapes(windows, True)
    assert [(r.color, r.direction) for r in alone] == [("red", "left"), ("blue", "up"), ("green", "down")]
    broken = read_shapes([windows[0], np.zeros((4, 8, 8)), windows[1]], True, workers=2)
    assert broken[0] == alone[0] and broken[2] == alone[1] and broken[1].error.startswith("ValueError")
    captions = ["a red circle moving left", "a blue square moving up", "a green triangle moving down"]
    items = [(f"s{i}", t, w, None) for i, (t, w) in enumerate(zip(captions, windows))]
    items.append(("gone.mp4", captions[0], None, "FileNotFoundError: gone.mp4"))
    one, pooled = score_rows(items, wrap=True), score_rows(items, wrap=True, workers=2)
    assert one == pooled and one.failed == ["gone.mp4"] and one.color_acc == 0.75 and one.rows[3]["error"]
    # inside kept_process_pool every scoring reuses one pool of workers (a pool costs ~2 s to start), with the same
    # readings; the block's end shuts it down, and outside it each call starts its own again
    from opensora.eval import moving_shapes

    with moving_shapes.kept_process_pool(2):
        pool = moving_shapes._KEPT_POOLS[2]
        assert read_shapes(windows, True, workers=2) == alone
        workers = set(pool._processes)
        assert score_rows(items, wrap=True, workers=2) == one and read_shapes(windows, True, workers=2) == alone
        assert set(pool._processes) == workers and len(workers) == 2  # the same two processes each time
        with moving_shapes.kept_process_pool(2):  # a block inside another of its size uses the outer pool
            assert moving_shapes._KEPT_POOLS[2] is pool
        import os
        from concurrent.futures.process import BrokenProcessPool

        with pytest.raises(BrokenProcessPool):  # a worker dies (as killed): that call fails, the next gets a new pool
            moving_shapes.map_in_processes(os._exit, [3, 3], workers=2)
        assert moving_shapes._KEPT_POOLS[2] is not pool and read_shapes(windows, True, workers=2) == alone
        pool = moving_shapes._KEPT_POOLS[2]
    assert 2 not in moving_shapes._KEPT_POOLS and not pool._processes  # shut down with its block
    assert read_shapes(windows, True, workers=2) == alone


def test_kept_pool_workers_exit_when_their_parent_is_killed(tmp_path):
    """kill -9 of a process inside ``kept_process_pool`` (as a time limit does) must not leave its idle workers
    waiting forever under init, holding its stdout: each exits once its parent is gone."""
    import os
    import subprocess
    import sys
    import time

    script = tmp_path / "killed_parent.py"
    script.write_text(
        "import os, signal\n"
        "from opensora.eval import moving_shapes\n"
        "if __name__ == '__main__':\n"
        "    with moving_shapes.kept_process_pool(2):\n"
        "        moving_shapes.map_in_processes(abs, [-1, -2, -3, -4], workers=2)\n"
        "        print(*moving_shapes._KEPT_POOLS[2]._processes, flush=True)\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # the workers share the pipe of stdout: without their watch, this call would wait until the timeout
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == -9, run.stderr[-2000:]
    workers = [int(pid) for pid in run.stdout.split()]
    assert len(workers) == 2

    def alive(pid):  # a zombie (exited, not yet reaped by whoever adopted it) is gone
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(pid) for pid in workers)
