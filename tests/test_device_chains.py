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


def chain_env(**settings) -> dict:
    env = dict(os.environ, **settings)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # the chain calls `python`
    return env


def test_long_rollout_exit_lane_alone_scores_both_students_and_archives_their_clips(tmp_path):
    out, back = tmp_path / "chain", tmp_path / "back"
    env = chain_env(SECOND="none", SWITCH="0", P30="0", LONG="1", EVAL_SWITCH="0", L_MINUTES="4", STEPS="1000",
                    L_CRITIC_WINDOWS="3", L_UPDATE_EVERY="2", EXTRA=TINY)  # fmt: skip
    script = "benchmarks/gpu_switch_rerender.sh"
    run = subprocess.run(["bash", script, "chain", str(out)], cwd=REPO, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    progress = (out / "progress.txt").read_text()
    assert "FAILED" not in progress and progress.rstrip().endswith("chain done"), progress
    stages = [line.split("start ")[1].split(" (")[0] for line in progress.splitlines() if ": start " in line]
    assert stages == ["lone NCCL check", "teacher", "ode", "self_forcing", "long_rollout_exit", "eval_exit"]
    long_config = (out / "ls/configs/long_rollout.py").read_text()  # L_CRITIC_WINDOWS and L_UPDATE_EVERY reach it
    assert "critic_windows=3" in long_config and "student_update_every=2" in long_config
    report = json.loads((out / "ls/report.json").read_text())
    # both students scored by name: the evaluation neither trains nor scores the control
    assert "self_forcing" in report and "long_rollout" in report and "self_forcing_more" not in report
    assert not (out / "ls/self_forcing_more").exists() and not (out / "lsf").exists()
    wait = subprocess.run(
        ["bash", script, "wait", str(out), "1"], cwd=REPO, env=chain_env(OUT=str(back)), capture_output=True, text=True
    )
    assert wait.returncode == 0 and "chain done" in wait.stdout, wait.stderr[-2000:]
    with tarfile.open(back / "chain.tgz") as archive:
        names = archive.getnames()
    assert "ls/report.json" in names and "ls/teacher/gate.json" in names and "ls/self_forcing/best.json" in names
    for student in ("self_forcing", "long_rollout"):
        assert f"ls/{student}/long_clips/samples.csv" in names
        assert any(n.startswith(f"ls/{student}/long_clips/") and n.endswith(".mp4") for n in names)


def test_an_unknown_second_lane_is_refused_before_the_chain_starts(tmp_path):
    out = tmp_path / "chain"
    for settings, named in ((dict(SECOND="fuLL"), "SECOND=fuLL"), (dict(L_CRITIC_WINDOWS="4"), "L_CRITIC_WINDOWS=4")):
        env = chain_env(LONG="1", EXTRA=TINY, **settings)  # the second: the fully denoised lane cannot take windows
        run = subprocess.run(["bash", "benchmarks/gpu_switch_rerender.sh", "start", str(out)], cwd=REPO, env=env,
                             capture_output=True, text=True)  # fmt: skip
        assert run.returncode == 2 and named in run.stderr and not out.exists()


def test_student_pair_trains_two_students_on_one_teacher_with_the_pair_flags_on_the_second_only(tmp_path):
    out, back = tmp_path / "pair", tmp_path / "back"
    env = chain_env(EXTRA=TINY, PAIR="--adam-beta1 0", EVAL_SWITCH="1", EVAL_RENOISE="1.0", PAIR_GPUS="0 0")
    script = "benchmarks/gpu_student_pair.sh"
    run = subprocess.run(["bash", script, "chain", str(out)], cwd=REPO, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    progress = (out / "progress.txt").read_text()
    assert "FAILED" not in progress and progress.rstrip().endswith("chain done"), progress
    # one teacher and one init, copied: the second lane trained neither
    assert "start teacher" in progress and progress.count("start ode") == 1
    assert (out / "a/teacher").is_dir() and (out / "b/teacher").is_dir()
    plain, pair = ((out / f"{lane}/configs/self_forcing.py").read_text() for lane in "ab")
    assert "betas=(0.0, 0.999)" in pair and "betas" not in plain  # --adam-beta1 0 on the second student only
    for lane in "ab":
        student = json.loads((out / f"{lane}/report.json").read_text())["self_forcing"]
        assert "switch_renoise_1.0_new_prompt_ge_90pct_within_one_window" in student["criteria"]
    wait = subprocess.run(
        ["bash", script, "wait", str(out), "1"], cwd=REPO, env=chain_env(OUT=str(back)), capture_output=True, text=True
    )
    assert wait.returncode == 0 and "chain done" in wait.stdout, wait.stderr[-2000:]
    with tarfile.open(back / "chain.tgz") as archive:
        names = archive.getnames()
    assert {"a/report.json", "b/report.json", "a/self_forcing/best.json", "b/self_forcing/best.json"} <= set(names)
