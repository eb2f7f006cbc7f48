#!/usr/bin/env python
"""Tune `make demo` for a 2-core CPU: run demo variants side by side, each on its own 2 cores, at equal steps.

Each variant is the demo's own four commands (tools/run_demo.py's builders: make_demo_dataset -> train.py with
configs/diffusion/train/demo_fast.py -> inference.py with configs/diffusion/inference/demo_fast.py on the 72 held
captions, seeds 1000+i -> eval_moving_shapes.py), changed only through command-line options: dataset options (clip
size, frames, number of clips), `--key value` config overrides given to BOTH the training and the sampling command
(so the sampler builds the same model, autoencoder and timestep shift), training-only overrides (lr, lr decay, EMA)
and one or more sampling settings. Variant 0 is demo_fast unchanged, the calibration.

Variants are compared at equal *steps*, not equal time: `make demo` trains demo_fast's `max_steps` (3200 since it
moved to DDP, ~9.2 min at 0.173 s/step on the 2-core CI machine; an earlier sweep ran with 2400 steps of
LowLevelZero at 0.24 s/step), and a lent host's cores may be faster or slower. So the sweep runs in two phases:

1. probe: every variant builds its clips and trains `--probe-steps` throwaway steps, all at once on their cores,
   which measures each variant's s/step under the real load;
2. plan and train: every variant with demo_fast's model trains the same `base` steps; one that changes the step
   cost (`scale_steps`, a wider model) trains `base * s0 / s_v` steps (s0: variant 0's s/step), what the demo's
   training time buys it. `base` is `--steps` (default: demo_fast's max_steps) or fewer, so that every variant's
   training, sampling and scoring end before the deadline; the plan (and whether `base` had to shrink) is in
   summary.json. Then each variant trains (`--max-minutes` only as a safety cap), samples and scores. Variant 0's
   further sampling settings run at the same time as its first, on the driver's cores (`--first-core` cores before
   the variants', idle while the driver waits), so they cost no deadline time.

    python -m benchmarks.demo_sweep --results DIR [--work DIR] [--variants 0,1,2] [--steps 2400]
        [--deadline-minutes 9.5] [--cores-per-variant 2] [--first-core 2] [--no-pin] [--smoke]

Files under --results (few and small): DIR/vK_NAME.json per variant (stage timings, planned / done steps, s/step,
the lr at the end, a loss-curve summary, and per sampling setting the scores with the shape and direction confusion
counts, truth -> read) and DIR/summary.json (all of them, the machine, the plan). Everything else (clips,
checkpoints, samples, per-video reports, logs) goes under --work (default DIR/work); a failed stage's log tail is
in the JSON. Each variant runs in its own process group pinned to its cores (sched_setaffinity, like `taskset -c`),
with 2 torch threads and no CUDA; whatever is still running at the deadline is killed and reported as such.
`--smoke`: 3 probe steps, 6 training steps, 2 sampling steps, 72 clips (checks that every variant's options are
valid, in a few minutes).
"""

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.common import ROOT
from tools.run_demo import dataset_command, eval_command, sample_command, train_command

TRAIN_CONFIG = "configs/diffusion/train/demo_fast.py"
SAMPLE_CONFIG = "configs/diffusion/inference/demo_fast.py"
DEMO_SAMPLING = dict(num_steps=30, guidance_scale=4.0, batch_size=24)  # configs/diffusion/inference/demo_fast.py
STRONG_SAMPLING = dict(num_steps=40, guidance_scale=6.0, batch_size=24)
HELD_CAPTIONS = 72
DRIVER_MARGIN_S = 15.0  # children stop this long before the hard deadline, so the driver can collect
# planning estimates (2-core CPU): a process start-up, a scoring run, and slack on the measured s/step
SAMPLE_STARTUP_S, EVAL_S, STEP_SLACK, PLAN_SAFETY_S = 12.0, 6.0, 1.08, 10.0


@dataclass
class Variant:
    name: str
    why: str
    size: int = 24  # square clips of this side (demo_fast's bucket)
    num_frames: int = 4
    num_videos: int = 288
    batch_size: int = 16  # training batch (the bucket's)
    overrides: list = field(default_factory=list)  # --key value for training AND sampling (model/vae/method)
    train_only: list = field(default_factory=list)  # --key value for training only (lr, lr decay, EMA)
    samplings: list = field(default_factory=lambda: [dict(DEMO_SAMPLING)])  # the first: every variant's yardstick
    scale_steps: bool = False  # the step cost differs from demo_fast's: train base * s0 / s_v steps

    def bucket_override(self) -> list:
        bucket = {f"{self.size}x{self.size}": {self.num_frames: (1.0, self.batch_size)}}
        return ["--bucket_config", repr(bucket)]


LINEAR_DECAY_40 = ["--lr_decay", "{'type': 'linear', 'fraction': 0.4, 'min_factor': 0.0}"]
SHIFT_2 = ["--method.shift", "{'base_tokens': 64, 'base_shift': 2.0}"]

VARIANTS = [
    Variant(
        "demo_fast",
        "make demo unchanged (24x24x4 clips, batch 16, PatchVAE 3, shift 3, lr 2e-3 constant after 50 warmup "
        "steps, EMA 0.99): the calibration (its s/step sets the pace) and the baseline; its second sampling setting "
        "(40 steps, CFG 6: more guidance towards the caption's shape, finer steps near t = 0 where corners form) "
        "asks whether sampling alone sharpens the corners",
        samplings=[dict(DEMO_SAMPLING), dict(STRONG_SAMPLING)],
    ),
    Variant(
        "lr_decay_linear40",
        "lr falls linearly from 2e-3 to 0 over the last 40% of the steps: at a constant 2e-3 the weights keep "
        "jittering, and the fine detail (a square's corners, only a few pixels) is what that noise blurs first; "
        "annealing is the usual cheapest gain at a fixed step count",
        train_only=LINEAR_DECAY_40,
    ),
    Variant(
        "ema_0.999",
        "EMA 0.999 instead of 0.99 for the sampled weights; with the EMA warmup (1+n)/(10+n) it averages ~0.996 at "
        "step 2400, i.e. ~250 steps instead of ~100: averaging out more of the lr 2e-3 weight noise, with no "
        "change to training itself",
        train_only=["--ema_decay", "0.999"],
    ),
    Variant(
        "lr_3e-3",
        "lr 3e-3: 1e-3 -> 2e-3 moved shape from 0.375-0.472 (2000-2500 steps) to 0.500-0.639 (1800-2400); "
        "does the curve keep rising with the lr, or does the noise of a larger step soften the corners",
        train_only=["--lr", "3e-3"],
    ),
    Variant(
        "hidden192",
        "hidden 192 (6 heads of 32) instead of 128: more capacity for the sharp shape boundary, at fewer steps "
        "(base * s0 / s_v, what the demo's training time buys)",
        overrides=["--model.hidden_size", "192", "--model.num_heads", "6"],
        scale_steps=True,
    ),
    Variant(
        "shift2",
        "timestep shift 2 instead of 3 (training and sampling): shift 3 spends most steps at the noisy t that set "
        "colour and motion, both already at ~1.0; more of the low-noise t where edges and corners are drawn",
        overrides=SHIFT_2,
    ),
    Variant(
        "lr_decay_shift2",
        "lr_decay_linear40 and shift2 together, both aimed at the low-noise detail: the candidate new default if "
        "each helps alone",
        overrides=SHIFT_2,
        train_only=LINEAR_DECAY_40,
    ),
]


# ----------------------------------------------------------------------------------------------- one variant
def start_stage(cmd, log_path: Path, cores=None) -> tuple:
    """Start one command (cwd = repo root, on ``cores`` if given), its output to ``log_path``."""
    cmd = [str(c) for c in cmd]
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None,
        )  # fmt: skip
    return proc, time.monotonic(), log_path


def finish_stage(handle: tuple, timeout_s: float) -> dict:
    """Wait for a started command (killed past ``timeout_s`` from now); returns wall seconds and the outcome."""
    proc, started, log_path = handle
    try:
        rc = proc.wait(timeout=max(timeout_s, 1.0))
        outcome = "ok" if rc == 0 else f"exit {rc}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        outcome = "timed out"
    result = dict(seconds=round(time.monotonic() - started, 2), outcome=outcome)
    if outcome != "ok":
        result["log_tail"] = log_path.read_text(errors="replace")[-2000:]
    return result


def run_stage(cmd, log_path: Path, timeout_s: float) -> dict:
    return finish_stage(start_stage(cmd, log_path), timeout_s)


def metrics_rows(metrics_path: Path) -> list:
    rows = []
    if metrics_path.exists():
        for line in metrics_path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "loss" in row and "step" in row:
                rows.append(row)
    return rows


def median_step_seconds(rows: list):
    """Median step time without the first fifth of the steps (warm-up: allocations, workers starting, and in the
    probe the other variants still starting up beside it)."""
    times = [r["step_time"] for r in rows if r.get("step_time")]
    times = times[len(times) // 5 :]
    return round(statistics.median(times), 4) if times else None


def loss_summary(rows: list) -> dict:
    """Steps done, step time, the lr at the end and the loss curve (mean loss over 10 equal step windows)."""
    if not rows:
        return dict(steps=0)
    losses = [r["loss"] for r in rows]
    windows = min(10, len(losses))
    bounds = [round(i * len(losses) / windows) for i in range(windows + 1)]
    curve = [round(statistics.fmean(losses[a:b]), 4) for a, b in zip(bounds, bounds[1:]) if b > a]
    tail = losses[-max(1, len(losses) // 10) :]
    return dict(
        steps=rows[-1]["step"],
        median_step_s=median_step_seconds(rows),
        lr_end=rows[-1].get("lr"),
        loss_first10=round(statistics.fmean(losses[:10]), 4),
        loss_last10pct=round(statistics.fmean(tail), 4),
        loss_curve_10_windows=curve,
    )


def confusion(report: dict, attribute: str) -> dict:
    """truth -> {read: count} for one attribute, from the evaluator's per-video rows."""
    table = defaultdict(Counter)
    for row in report.get("rows", []):
        truth = row["truth"].get(attribute)
        if truth is not None:
            table[truth][row["pred"].get(attribute)] += 1
    return {truth: dict(reads) for truth, reads in sorted(table.items())}


def sampling_seconds(setting: dict, step_s: float) -> float:
    """Planned wall time of one sampling setting on the held captions: a sampling pass of one clip costs about a
    third of a training step's share per clip (forward only), 2 passes per step with CFG; plus start-up."""
    passes = HELD_CAPTIONS * setting["num_steps"] * (2 if setting["guidance_scale"] != 1.0 else 1)
    return SAMPLE_STARTUP_S + passes / 16 * step_s / 3


class VariantRun:
    """One variant's record (results/vK_NAME.json) and its stages; phase 1 (probe) and 2 (train, sample, score) are
    separate processes that share the record."""

    def __init__(self, index: int, args):
        self.index, self.variant, self.args = index, VARIANTS[index], args
        label = f"v{index}_{self.variant.name}"
        self.json_path = args.results / f"{label}.json"
        self.work = args.work / label
        self.work.mkdir(parents=True, exist_ok=True)
        self.py = sys.executable
        if self.json_path.exists():
            self.record = json.loads(self.json_path.read_text())
        else:
            self.record = dict(index=index, **asdict(self.variant), smoke=args.smoke, stages={}, samplings_done=[])
        self.record["affinity"] = sorted(os.sched_getaffinity(0))

    def save(self) -> None:
        self.json_path.write_text(json.dumps(self.record, indent=1) + "\n")

    def left(self) -> float:
        return self.args.deadline_at - time.time()

    def stage(self, name: str, cmd, timeout_s: float = None) -> dict:
        result = run_stage(cmd, self.work / f"{name}.log", self.left() if timeout_s is None else timeout_s)
        self.record["stages"][name] = result
        self.save()
        return result

    def train(self, name: str, steps: int, extra=()) -> dict:
        v = self.variant
        overrides = ["--overwrite", "--ckpt-every", "0", "--max-steps", steps, *extra]
        overrides += v.bucket_override() + v.overrides + v.train_only
        out = self.work / name
        result = self.stage(name, train_command(self.py, TRAIN_CONFIG, out, self.work / "data", overrides))
        result.update(loss_summary(metrics_rows(out / "metrics.jsonl")))
        self.save()
        return result

    def probe(self) -> None:
        """Phase 1: the clips, then a few throwaway steps that time this variant's step under the sweep's load."""
        v = self.variant
        num_videos = HELD_CAPTIONS if self.args.smoke else v.num_videos
        data_cmd = dataset_command(self.py, self.work / "data", num_videos, v.size, v.num_frames)
        if self.stage("dataset", data_cmd)["outcome"] != "ok":
            return
        result = self.train("probe", self.args.probe_steps, ["--save-at-end", "False"])
        if result["outcome"] == "ok" and result.get("median_step_s"):
            # what a training run costs besides its steps (imports, building, the loader's first batches)
            result["startup_s"] = round(max(0.0, result["seconds"] - result["steps"] * result["median_step_s"]), 1)
            self.save()

    def main(self, steps: int, cap_minutes: float) -> None:
        """Phase 2: train the planned steps (the time cap only guards the deadline), then sample and score."""
        self.record.update(planned_steps=steps, train_cap_minutes=round(cap_minutes, 2))
        extra = [] if self.args.smoke else ["--max-minutes", round(cap_minutes, 3)]
        if self.train("train", steps, extra)["outcome"] != "ok":
            return
        settings = [dict(x, num_steps=2) if self.args.smoke else dict(x) for x in self.variant.samplings]
        names = [f"sample{k}_s{x['num_steps']}_cfg{x['guidance_scale']:g}" for k, x in enumerate(settings)]
        # further settings at the same time as the first, on the spare cores (variant 0: the driver's)
        beside = bool(self.args.spare_cores)  # "all": beside the first, unpinned
        spare = None if self.args.spare_cores in (None, "all") else [int(c) for c in self.args.spare_cores.split(",")]
        extras = [(n, x, self.start_sample(n, x, spare)) for n, x in zip(names[1:], settings[1:])] if beside else []
        first = self.start_sample(names[0], settings[0], None)
        done = [(names[0], settings[0], finish_stage(first, self.left() - EVAL_S))]
        done += [(n, x, finish_stage(handle, self.left() - EVAL_S)) for n, x, handle in extras]
        if not beside:  # one after another while time is left
            for n, x in zip(names[1:], settings[1:]):
                estimate = done[0][2]["seconds"] * sampling_seconds(x, 1.0) / sampling_seconds(settings[0], 1.0)
                if estimate * 1.1 > self.left() - EVAL_S:
                    self.record["samplings_done"].append(dict(name=n, **x, skipped=f"needs ~{estimate:.0f} s"))
                    continue
                done.append((n, x, finish_stage(self.start_sample(n, x, None), self.left() - EVAL_S)))
        for name, setting, result in done:
            entry = dict(name=name, **setting, sample=result)
            self.record["samplings_done"].append(entry)
            self.save()
            if result["outcome"] != "ok":
                continue
            scores = self.work / f"{name}_eval.json"
            entry["eval"] = run_stage(eval_command(self.py, self.work / name, scores), self.work / f"{name}_eval.log",
                                      self.left())  # fmt: skip
            if entry["eval"]["outcome"] == "ok":
                report = json.loads(scores.read_text())
                entry["scores"] = {a: round(report[f"{a}_acc"], 4) for a in ("color", "shape", "direction", "all")}
                entry["shape_confusion"] = confusion(report, "shape")  # squares read as circles: square -> circle
                entry["direction_confusion"] = confusion(report, "direction")
                entry["color_wrong"] = sum(1 for row in report["rows"] if row["correct"].get("color") is False)
            self.save()
        self.record["seconds_total"] = round(time.time() - self.args.started_at, 1)
        self.save()

    def start_sample(self, name: str, setting: dict, cores):
        v = self.variant
        sample_args = [
            "--resolution", f"{v.size}x{v.size}", "--num-frames", v.num_frames,
            "--guidance-scale", setting["guidance_scale"], "--batch-size", setting["batch_size"], "--no-progress",
            *v.bucket_override(), *v.overrides,
        ]  # fmt: skip
        cmd = sample_command(
            self.py, SAMPLE_CONFIG, self.work / "train", self.work / "data", self.work / name, setting["num_steps"],
            sample_args,
        )  # fmt: skip
        return start_stage(cmd, self.work / f"{name}.log", cores)


# ----------------------------------------------------------------------------------------------- the sweep
def machine_info() -> dict:
    info = dict(nproc=os.cpu_count(), python=sys.version.split()[0])
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if "model name" in ln), None)
    except OSError:
        pass
    siblings = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        if path.exists():
            siblings[cpu] = path.read_text().strip()
    info["thread_siblings"] = siblings  # two variants on the two threads of one core would slow each other
    return info


def core_sets(count: int, args) -> list:
    if not args.pin:
        return [None] * count
    available = sorted(os.sched_getaffinity(0))
    need = args.first_core + count * args.cores_per_variant
    if need > len(available):
        raise SystemExit(
            f"{count} variants x {args.cores_per_variant} cores from core #{args.first_core} need {need} cores; "
            f"this process may use {len(available)} ({available}). Use fewer --variants, --first-core 0 or --no-pin."
        )
    start = args.first_core
    return [
        available[start + i * args.cores_per_variant : start + (i + 1) * args.cores_per_variant] for i in range(count)
    ]


def child_env(threads: int) -> dict:
    env = dict(os.environ)
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def launch(index: int, cores, args, phase_args: list) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "benchmarks.demo_sweep", "--run-one", str(index)]
    cmd += ["--results", args.results, "--work", args.work]
    cmd += ["--deadline-at", str(args.deadline_at), "--started-at", str(args.started_at)]
    cmd += ["--probe-steps", str(args.probe_steps), *phase_args] + (["--smoke"] if args.smoke else [])

    def pin():
        if cores is not None:
            os.sched_setaffinity(0, cores)

    label = f"v{index}_{VARIANTS[index].name}"
    log = open(args.work / f"{label}.driver.log", "a")
    return subprocess.Popen(
        [str(c) for c in cmd], cwd=ROOT, env=child_env(args.cores_per_variant), stdout=log, stderr=subprocess.STDOUT,
        preexec_fn=pin, start_new_session=True,
    )  # fmt: skip


def run_phase(indices: list, cores: list, args, phase_args_of, stop_at: float) -> dict:
    """All ``indices`` at once, each on its cores; returns index -> exit code (or why it has none)."""
    running = {launch(i, cores[k], args, phase_args_of(i)): i for k, i in enumerate(indices)}
    finished = {}
    while running:
        for proc, index in list(running.items()):
            if proc.poll() is not None:
                finished[index] = proc.returncode
                del running[proc]
        if running and time.time() > stop_at:
            for proc, index in running.items():
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                finished[index] = "killed at the deadline"
            running.clear()
        time.sleep(0.5)
    return finished


def read_record(index: int, args) -> dict:
    path = args.results / f"v{index}_{VARIANTS[index].name}.json"
    return json.loads(path.read_text()) if path.exists() else dict(index=index, name=VARIANTS[index].name, stages={})


def plan_steps(indices: list, args) -> dict:
    """Steps per variant: equal for equal step cost, scaled by s0 / s_v for a dearer step, all fitting the deadline.

    Each variant must fit: its training start-up + steps x s/step (with slack) + its samplings and scoring."""
    probes = {i: read_record(i, args)["stages"].get("probe", {}) for i in indices}
    step_s = {
        i: p.get("median_step_s") for i, p in probes.items() if p.get("outcome") == "ok" and p.get("median_step_s")
    }
    plan = dict(target_steps=args.steps, probe_step_s=step_s)
    if step_s:
        s0 = step_s.get(0) or statistics.median(step_s.values())
        plan["probe_step_ratio_to_v0"] = {i: round(s / s0, 3) for i, s in step_s.items()}
    if not step_s:
        return dict(plan, base_steps=0, steps={}, note="no probe succeeded")
    remaining = args.deadline_at - time.time()
    ratios, limits, reserves = {}, {}, {}
    for i, s in step_s.items():
        ratios[i] = round(s / s0, 3) if VARIANTS[i].scale_steps else 1.0  # else equal steps, whatever the noise
        settings = VARIANTS[i].samplings
        if args.spare_cores_of.get(i):  # the further settings run beside the first
            samplings = max(sampling_seconds(x, s) for x in settings) + EVAL_S * len(settings)
        else:
            samplings = sum(sampling_seconds(x, s) + EVAL_S for x in settings)
        reserves[i] = probes[i].get("startup_s", 20.0) + samplings + PLAN_SAFETY_S
        # base / ratio steps at s * slack seconds each must fit what is left after the reserve
        limits[i] = int((remaining - reserves[i]) * ratios[i] / (s * STEP_SLACK))
    base = max(1, min(args.steps, *limits.values()))
    if args.smoke:
        base = args.steps
    steps = {i: max(1, round(base / ratios[i])) for i in step_s}
    # the cap guards the deadline only: stop training where the samplings would no longer fit
    caps = {i: max(0.2, (remaining - reserves[i] + PLAN_SAFETY_S) / 60) for i in step_s}
    return dict(
        plan,
        s0=s0,
        seconds_left_at_plan=round(remaining, 1),
        step_cost_ratio=ratios,
        reserve_s={i: round(r, 1) for i, r in reserves.items()},
        base_steps=base,
        base_fraction_of_target=round(base / args.steps, 3),
        steps=steps,
        train_cap_minutes={i: round(c, 2) for i, c in caps.items()},
    )


def print_table(records: list) -> None:
    print(f"\n{'variant':24s} {'steps':>11s} {'s/step':>7s} {'lr_end':>8s} {'loss':>7s}  {'sampling':16s} {'min':>4s}"
          "  col / shp / dir   square->circle")  # fmt: skip
    for r in records:
        train = r.get("stages", {}).get("train", {})
        steps = f"{train.get('steps', 0)}/{r.get('planned_steps', '-')}"
        lr_end = train.get("lr_end")
        head = f"v{r['index']} {r['name']:21s} {steps:>11s} {train.get('median_step_s') or 0:>7.3f} "
        head += (
            f"{lr_end if lr_end is not None else float('nan'):>8.1e} {train.get('loss_last10pct', float('nan')):>7.4f}"
        )
        for s in r.get("samplings_done") or [{}]:
            scores = s.get("scores")
            text = f"{scores['color']:.3f} / {scores['shape']:.3f} / {scores['direction']:.3f}" if scores else ""
            text = text or s.get("skipped") or (s.get("sample") or {}).get("outcome") or r.get("outcome", "")
            if scores:
                text += f"   {s.get('shape_confusion', {}).get('square', {}).get('circle', 0)}/24"
            seconds = (s.get("sample") or {}).get("seconds", 0) / 60
            print(f"{head}  {s.get('name', '-'):16s} {seconds:>4.1f}  {text}")
            head = " " * len(head)


def sweep(args) -> None:
    indices = list(range(len(VARIANTS))) if args.variants is None else [int(v) for v in args.variants.split(",")]
    args.results.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    for index in indices:  # a fresh record per variant (phase 2 reads phase 1's)
        (args.results / f"v{index}_{VARIANTS[index].name}.json").unlink(missing_ok=True)
    args.started_at = time.time()
    hard_stop = args.started_at + 60 * args.deadline_minutes
    args.deadline_at = hard_stop - DRIVER_MARGIN_S  # children stop here
    cores = core_sets(len(indices), args)
    # variant 0's further sampling settings go to the driver's cores (unpinned runs: beside the first, anywhere)
    driver_cores = sorted(os.sched_getaffinity(0))[: args.first_core] if args.pin else []
    spare = ",".join(map(str, driver_cores)) if args.pin else "all"
    args.spare_cores_of = {0: spare} if 0 in indices and len(VARIANTS[0].samplings) > 1 and spare else {}
    summary = dict(
        command=" ".join(shlex.quote(a) for a in sys.argv),
        machine=machine_info(),
        deadline_minutes=args.deadline_minutes,
        smoke=args.smoke,
        variant_cores={i: c for i, c in zip(indices, cores)},
    )
    print(f"{len(indices)} variants at once, cores {cores}; results in {args.results}", flush=True)

    probe_stop = args.started_at + 60 * args.probe_minutes
    finished = run_phase(indices, cores, args, lambda i: ["--phase", "probe"], min(probe_stop, hard_stop))
    summary["probe_seconds"] = round(time.time() - args.started_at, 1)
    plan = plan_steps(indices, args)
    summary["plan"] = plan
    print(f"probes took {summary['probe_seconds']:.0f} s; plan: {json.dumps(plan)}", flush=True)
    ready = [i for i in indices if i in plan["steps"]]
    for index in indices:
        if index not in plan["steps"]:
            finished[index] = f"probe: {finished.get(index)}"
    main_cores = [cores[indices.index(i)] for i in ready]

    def main_args(index):
        spare = ["--spare-cores", args.spare_cores_of[index]] if index in args.spare_cores_of else []
        return ["--phase", "main", "--train-steps", str(plan["steps"][index]),
                "--train-cap-minutes", str(plan["train_cap_minutes"][index]), *spare]  # fmt: skip

    finished.update(run_phase(ready, main_cores, args, main_args, hard_stop))
    records = []
    for index in indices:
        record = read_record(index, args)
        if finished.get(index) != 0:
            record["outcome"] = f"driver: {finished.get(index)}"
        records.append(record)
    summary["seconds"] = round(time.time() - args.started_at, 1)
    summary["variants"] = records
    (args.results / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print_table(records)
    if plan.get("steps"):
        print(f"\nbase {plan['base_steps']} steps = {plan['base_fraction_of_target']:.0%} of {plan['target_steps']}; "
              f"variant 0 {plan['s0']} s/step under the sweep's load (make demo on the 2-core CI machine: 0.173 with DDP)")  # fmt: skip
    print(f"\nsweep took {summary['seconds'] / 60:.1f} min; {args.results / 'summary.json'}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, required=True, help="per-variant JSON and summary.json (few files)")
    parser.add_argument(
        "--work", type=Path, default=None, help="clips, checkpoints, samples, logs (default RESULTS/work)"
    )
    parser.add_argument("--variants", default=None, help="comma-separated indices (default: all)")
    parser.add_argument("--steps", type=int, default=None, help="variant 0's steps (default: demo_fast's max_steps)")
    parser.add_argument("--probe-steps", type=int, default=50, help="throwaway steps that time each variant")
    parser.add_argument("--probe-minutes", type=float, default=2.0, help="the probe phase ends by then")
    parser.add_argument("--deadline-minutes", type=float, default=9.5, help="the whole sweep ends by then")
    parser.add_argument("--cores-per-variant", type=int, default=2)
    parser.add_argument("--first-core", type=int, default=2, help="leave the cores before it to the driver")
    parser.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin variants to cores")
    parser.add_argument("--smoke", action="store_true", help="3 probe, 6 training and 2 sampling steps, 72 clips")
    parser.add_argument("--run-one", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--phase", choices=("probe", "main"), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--train-steps", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--train-cap-minutes", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--spare-cores", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--deadline-at", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--started-at", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.results = args.results.resolve()
    args.work = (args.work or args.results / "work").resolve()
    if args.smoke:
        args.probe_steps, args.steps = 3, 6
    if args.run_one is None:
        if args.steps is None:
            from opensora.config import load_config

            args.steps = int(load_config(ROOT / TRAIN_CONFIG).max_steps)
        sweep(args)
    elif args.phase == "probe":
        VariantRun(args.run_one, args).probe()
    else:
        VariantRun(args.run_one, args).main(args.train_steps, args.train_cap_minutes)


if __name__ == "__main__":
    main()
