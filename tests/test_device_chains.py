"""The detached device chains (benchmarks/gpu_*.sh) run here on the CPU with --tiny stages: the plumbing a device call
depends on (stages in order, which students each evaluation scores and trains, the archive a call brings back) is
checked before the device time is spent."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = "--tiny --device cpu --launcher in-process --motion wrap --seed 5 --train-seed 1 --teacher-gate 0.95 "
TINY += "--teacher-gate-rounds 1 --validation-every 1 --student-checkpoint best --num-prompts 288"


SWITCH_CHAIN = "benchmarks/gpu_switch_rerender.sh"


def chain_env(**settings) -> dict:
    env = dict(os.environ, **settings)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # the chain calls `python`
    return env


def run_chain(script: str, out: Path, allow_failed: bool = False, **settings) -> str:
    """A detached device chain run in the foreground with --tiny stages; its progress.txt (every stage passed unless
    ``allow_failed``)."""
    run = subprocess.run(["bash", script, "chain", str(out)], cwd=REPO, env=chain_env(**settings), capture_output=True,
                         text=True)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    progress = (out / "progress.txt").read_text()
    assert (allow_failed or "FAILED" not in progress) and progress.rstrip().endswith("chain done"), progress
    return progress


def run_exit_lane_chain(out: Path, allow_failed: bool = False, **settings) -> list:
    """The one-GPU LongRollout chain (no switch sweep); its progress events in order."""
    settings = dict(dict(SWITCH="0", P30="0", LONG="1", EVAL_SWITCH="0", L_MINUTES="4", STEPS="1000", EXTRA=TINY),
                    **settings)  # fmt: skip
    progress = run_chain(SWITCH_CHAIN, out, allow_failed, **settings)
    return [line.split(": ", 1)[1].split(" (")[0] for line in progress.splitlines()]


def archived_names(script: str, out: Path, back: Path) -> list:
    """What a `wait` call brings back (chain.tgz) of a finished chain."""
    wait = subprocess.run(["bash", script, "wait", str(out), "1"], cwd=REPO, env=chain_env(OUT=str(back)),
                          capture_output=True, text=True)  # fmt: skip
    assert wait.returncode == 0 and "chain done" in wait.stdout, wait.stderr[-2000:]
    with tarfile.open(back / "chain.tgz") as archive:
        return archive.getnames()


def test_long_rollout_exit_lane_alone_scores_both_students_and_archives_their_clips(tmp_path):
    out = tmp_path / "chain"
    events = run_exit_lane_chain(
        out, SECOND="none", L_CRITIC_WINDOWS="3", L_UPDATE_EVERY="2", L_FIRST_WINDOW_SHARE="0.25"
    )
    stages = [e.split("start ")[1] for e in events if e.startswith("start ")]
    assert stages == ["lone NCCL check", "teacher", "ode", "self_forcing", "long_rollout_exit", "eval_exit"]
    long_config = (out / "ls/configs/long_rollout.py").read_text()  # the L_* settings reach it
    assert "critic_windows=3" in long_config and "student_update_every=2" in long_config
    assert "first_window_share=0.25" in long_config
    report = json.loads((out / "ls/report.json").read_text())
    # both students scored by name: the evaluation neither trains nor scores the control
    assert "self_forcing" in report and "long_rollout" in report and "self_forcing_more" not in report
    assert not (out / "ls/self_forcing_more").exists() and not (out / "lsf").exists()
    names = archived_names(SWITCH_CHAIN, out, tmp_path / "back")
    assert "ls/report.json" in names and "ls/teacher/gate.json" in names and "ls/self_forcing/best.json" in names
    for student in ("self_forcing", "long_rollout"):
        assert f"ls/{student}/long_clips/samples.csv" in names
        assert f"ls/{student}/metrics.jsonl" in names  # the training and validation curves, kept if the report is cut
        assert any(n.startswith(f"ls/{student}/long_clips/") and n.endswith(".mp4") for n in names)


def test_control_trains_beside_long_rollout_on_one_gpu_and_one_evaluation_scores_all_three(tmp_path):
    out = tmp_path / "chain"
    events = run_exit_lane_chain(out, SECOND="control", L_CRITIC_WINDOWS="2", L_UPDATE_EVERY="2",
                                 EVAL_SWITCH="criterion", EVAL_RENOISE="1.0")  # fmt: skip
    # both lanes start before either ends (one GPU, the same minutes), and the one evaluation comes after both
    starts = [events.index("start long_rollout_exit"), events.index("start control")]
    ends = [events.index("end long_rollout_exit"), events.index("end control")]
    assert max(starts) < min(ends) and events.index("start eval_exit") > max(ends), events
    assert not any("eval_control" in e for e in events)
    assert "critic_windows=2" in (out / "ls/configs/long_rollout.py").read_text()
    assert "critic_windows" not in (out / "lsc/configs/self_forcing_more.py").read_text()  # the control is plain
    report = json.loads((out / "ls/report.json").read_text())
    assert {"teacher", "self_forcing", "long_rollout", "self_forcing_more"} <= set(report)
    assert "pending" not in report and not (out / "ls/report.partial.json").exists()  # the evaluation ended
    assert not (out / "lsc/report.json").exists()  # no second evaluation
    assert set(report["differences"]) == {"long_rollout - self_forcing", "long_rollout - self_forcing_more"}
    for student in ("self_forcing", "long_rollout", "self_forcing_more"):  # EVAL_SWITCH=criterion: the judged runs
        switch = report[student]["switch"]
        assert "recache" in switch and "renoise_1.0" in switch and "keep_old_kv" not in switch
        assert not any(k.startswith("recache_sinks") for k in switch)
        assert "switch_renoise_1.0_new_prompt_ge_90pct_within_one_window" in report[student]["criteria"]
    evaluation = (out / "log/eval_exit.txt").read_text()  # the control's copied run is reused, never retrained
    assert "== self_forcing_more: reusing" in evaluation and "self_forcing_more trained in" not in evaluation
    names = archived_names(SWITCH_CHAIN, out, tmp_path / "back")
    for student in ("self_forcing", "long_rollout", "self_forcing_more"):
        assert any(n.startswith(f"ls/{student}/long_clips/") and n.endswith(".mp4") for n in names), student


def test_an_evaluation_leaves_out_the_students_whose_training_failed_instead_of_training_them(tmp_path):
    out = tmp_path / "chain"
    for lane, student in (("ls", "long_rollout"), ("lsc", "self_forcing_more")):  # a file where each run would write
        (out / lane).mkdir(parents=True)
        (out / lane / student).write_text("not a run directory: this student's training fails\n")
    events = run_exit_lane_chain(out, allow_failed=True, SECOND="control", L_CRITIC_WINDOWS="2", L_UPDATE_EVERY="2")
    assert "FAILED long_rollout_exit" in events and "FAILED control" in events
    assert "ls/long_rollout did not finish: left out of the evaluation" in events
    assert "lsc/self_forcing_more did not finish: left out of the evaluation" in events
    report = json.loads((out / "ls/report.json").read_text())  # Self-Forcing is still scored
    assert "self_forcing" in report and "long_rollout" not in report and "self_forcing_more" not in report
    assert "trained in" not in (out / "log/eval_exit.txt").read_text()  # the evaluation trained nothing
    assert (out / "ls/self_forcing_more").exists() is False and (out / "ls/long_rollout").is_file()


def test_an_unknown_second_lane_is_refused_before_the_chain_starts(tmp_path):
    out = tmp_path / "chain"
    refused = ((dict(SECOND="fuLL"), "SECOND=fuLL"), (dict(L_CRITIC_WINDOWS="4"), "L_CRITIC_WINDOWS=4"),
               (dict(EVAL_SWITCH="yes"), "EVAL_SWITCH=yes"))  # fmt: skip
    for settings, named in refused:
        env = chain_env(LONG="1", EXTRA=TINY, **settings)  # the second: the fully denoised lane cannot take windows
        run = subprocess.run(["bash", SWITCH_CHAIN, "start", str(out)], cwd=REPO, env=env,
                             capture_output=True, text=True)  # fmt: skip
        assert run.returncode == 2 and named in run.stderr and not out.exists()


def test_student_pair_trains_two_students_on_one_teacher_with_the_pair_flags_on_the_second_only(tmp_path):
    out, script = tmp_path / "pair", "benchmarks/gpu_student_pair.sh"
    progress = run_chain(script, out, EXTRA=TINY, PAIR="--adam-beta1 0", EVAL_SWITCH="1", EVAL_RENOISE="1.0",
                         PAIR_GPUS="0 0")  # fmt: skip
    # one teacher and one init, copied: the second lane trained neither
    assert "start teacher" in progress and progress.count("start ode") == 1
    assert (out / "a/teacher").is_dir() and (out / "b/teacher").is_dir()
    plain, pair = ((out / f"{lane}/configs/self_forcing.py").read_text() for lane in "ab")
    assert "betas=(0.0, 0.999)" in pair and "betas" not in plain  # --adam-beta1 0 on the second student only
    for lane in "ab":
        student = json.loads((out / f"{lane}/report.json").read_text())["self_forcing"]
        assert "switch_renoise_1.0_new_prompt_ge_90pct_within_one_window" in student["criteria"]
    names = archived_names(script, out, tmp_path / "back")
    assert {"a/report.json", "b/report.json", "a/self_forcing/best.json", "b/self_forcing/best.json"} <= set(names)
