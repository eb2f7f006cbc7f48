#!/usr/bin/env python
"""Tune `make demo` for a 2-core CPU: run demo variants side by side, each on its own 2 cores, under one wall budget.

Each variant is the demo's own four commands (tools/run_demo.py's builders: make_demo_dataset -> train.py with
configs/diffusion/train/demo.py -> inference.py with configs/diffusion/inference/demo.py on the 72 held captions,
seeds 1000+i -> eval_moving_shapes.py), changed only through command-line options: dataset options (clip size,
frames, number of clips), `--key value` config overrides given to BOTH the training and the sampling command (so the
sampler builds the same model, autoencoder and timestep shift), and one or more sampling settings. Training stops on
a wall-clock budget (`--max-minutes`), so variants of different step cost are compared at equal time; every variant
gets the same budget. Variant 0 is demo.py (`make demo` before demo_fast.py), to calibrate one machine against
another (s/step).

    python benchmarks/demo_sweep.py --results DIR [--work DIR] [--variants 0,1,2] [--train-minutes 6]
        [--deadline-minutes 9] [--cores-per-variant 2] [--first-core 2] [--jobs N] [--no-pin] [--smoke]

Per variant, DIR/vK_NAME.json holds the stage timings, steps done, s/step, a loss-curve summary and the scores of each
sampling setting (DIR/vK_NAME/ keeps the evaluator's per-video reports and the logs); DIR/summary.json has them all
plus the machine. Bulky files (clips, checkpoints, samples) go under --work. Each variant runs in its own process
group pinned to its cores (sched_setaffinity, like `taskset -c`), with 2 torch threads and no CUDA; whatever is still
running at the deadline is killed and reported as such. `--smoke`: a few training and sampling steps (checks that
every variant's options are valid, in a minute or two).
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
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from run_demo import dataset_command, eval_command, sample_command, train_command  # noqa: E402

TRAIN_CONFIG = "configs/diffusion/train/demo.py"
SAMPLE_CONFIG = "configs/diffusion/inference/demo.py"
EVAL_RESERVE_S = 25.0  # kept back from the deadline for the last evaluation
DEFAULT_SAMPLING = dict(num_steps=30, guidance_scale=4.0, batch_size=8)  # configs/diffusion/inference/demo.py


@dataclass
class Variant:
    name: str
    why: str
    size: int = 32  # square clips of this side
    num_frames: int = 16
    num_videos: int = 288
    batch_size: int = 8  # training batch (the bucket's)
    overrides: list = field(default_factory=list)  # --key value for training AND sampling (model/vae/method)
    train_only: list = field(default_factory=list)  # --key value for training only (lr, ...)
    samplings: list = field(default_factory=lambda: [dict(DEFAULT_SAMPLING)])  # tried in order while time is left

    def bucket_override(self) -> list:
        bucket = {f"{self.size}x{self.size}": {self.num_frames: (1.0, self.batch_size)}}
        return ["--bucket_config", repr(bucket)]


T2V_ONLY = ["--method.condition_probs", "{'t2v': 1.0}"]
FAST_SAMPLING = [
    dict(num_steps=15, guidance_scale=4.0, batch_size=24),
    dict(num_steps=15, guidance_scale=7.0, batch_size=24),
    dict(num_steps=30, guidance_scale=4.0, batch_size=24),
]
PATCH3 = ["--vae.patch_size", "3", "--model.in_channels", "27", "--model.cond_channels", "28"]

VARIANTS = [
    Variant(
        "default",
        "demo.py, the old make demo (32x32x16, PatchVAE 4 -> 192-value tokens into a 128-wide model, 30% I2V/V2V "
        "training, 30 steps CFG 4): calibration between machines",
    ),
    Variant(
        "f8_t2v",
        "cheaper steps only: 8 frames (half the tokens), text-to-video only, 15 sampling steps; the 192 -> 128 "
        "token bottleneck stays",
        num_frames=8,
        overrides=T2V_ONLY,
        samplings=FAST_SAMPLING,
    ),
    Variant(
        "f8_t2v_h192",
        "f8_t2v with hidden 192 (6 heads): the model is no narrower than its 192-value input tokens, so it can see "
        "all of the noise it has to predict",
        num_frames=8,
        overrides=T2V_ONLY + ["--model.hidden_size", "192", "--model.num_heads", "6"],
        samplings=FAST_SAMPLING,
    ),
    Variant(
        "f8_t2v_24px_p3",
        "f8_t2v at 24x24 with PatchVAE 3: 108-value tokens into the 128-wide model (no bottleneck) at the same token "
        "count and step cost",
        size=24,
        num_frames=8,
        overrides=T2V_ONLY + PATCH3,
        samplings=FAST_SAMPLING,
    ),
    Variant(
        "f8_t2v_24px_p3_shift2",
        "f8_t2v_24px_p3 with timestep shift 2 (training and sampling): more weight on the noisy steps that decide "
        "layout and motion",
        size=24,
        num_frames=8,
        overrides=T2V_ONLY + PATCH3 + ["--method.shift", "{'base_tokens': 128, 'base_shift': 2.0}"],
        samplings=FAST_SAMPLING,
    ),
    Variant(
        "f8_t2v_24px_p3_lr2e-3",
        "f8_t2v_24px_p3 with lr 2e-3 (twice the default): does the short run want a faster optimiser",
        size=24,
        num_frames=8,
        overrides=T2V_ONLY + PATCH3,
        train_only=["--lr", "2e-3"],
        samplings=FAST_SAMPLING,
    ),
    Variant(
        "f8_t2v_24px_p3_b16",
        "f8_t2v_24px_p3 with batch 16: a step costs less than twice a batch-8 step on 2 cores (fixed per-step "
        "overhead), so more clips per second and less gradient noise, at fewer steps",
        size=24,
        num_frames=8,
        batch_size=16,
        overrides=T2V_ONLY + PATCH3,
        samplings=FAST_SAMPLING,
    ),
]


# ----------------------------------------------------------------------------------------------- one variant
def run_stage(cmd, log_path: Path, timeout_s: float) -> dict:
    """Run one command (cwd = repo root), its output to ``log_path``; returns wall seconds and the outcome."""
    cmd = [str(c) for c in cmd]
    started = time.monotonic()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(timeout_s, 1.0))
            outcome = "ok" if rc == 0 else f"exit {rc}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            outcome = "timed out"
    result = dict(seconds=round(time.monotonic() - started, 2), outcome=outcome, log=log_path.name)
    if outcome != "ok":
        result["log_tail"] = log_path.read_text(errors="replace")[-3000:]
    return result


def loss_summary(metrics_path: Path) -> dict:
    """Steps done, step time and the loss curve (mean loss over 10 equal step windows) from metrics.jsonl."""
    rows = []
    if metrics_path.exists():
        for line in metrics_path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "loss" in row and "step" in row:
                rows.append(row)
    if not rows:
        return dict(steps=0)
    losses = [r["loss"] for r in rows]
    step_times = [r["step_time"] for r in rows if r.get("step_time")]
    windows = 10 if len(losses) >= 10 else len(losses)
    bounds = [round(i * len(losses) / windows) for i in range(windows + 1)]
    curve = [round(statistics.fmean(losses[a:b]), 4) for a, b in zip(bounds, bounds[1:]) if b > a]
    tail = losses[-max(1, len(losses) // 10) :]
    return dict(
        steps=rows[-1]["step"],
        median_step_s=round(statistics.median(step_times), 4) if step_times else None,
        median_samples_per_s=round(statistics.median([r["samples_per_s"] for r in rows if r.get("samples_per_s")]), 2)
        if any(r.get("samples_per_s") for r in rows)
        else None,
        loss_first10=round(statistics.fmean(losses[:10]), 4),
        loss_last10pct=round(statistics.fmean(tail), 4),
        loss_curve_10_windows=curve,
    )


def sampling_cost(setting: dict) -> float:
    """Relative cost of a sampling setting: model passes (2 per step with CFG)."""
    return setting["num_steps"] * (2 if setting["guidance_scale"] != 1.0 else 1)


def run_variant(index: int, variant: Variant, args) -> dict:
    deadline = args.deadline_at
    out = args.results / f"v{index}_{variant.name}"
    work = args.work / f"v{index}_{variant.name}"
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    record = dict(
        index=index,
        **asdict(variant),
        train_minutes=args.train_minutes,
        smoke=args.smoke,
        affinity=sorted(os.sched_getaffinity(0)),
        stages={},
        samplings_done=[],
    )
    json_path = args.results / f"v{index}_{variant.name}.json"

    def save():
        json_path.write_text(json.dumps(record, indent=1) + "\n")

    def left():
        return deadline - time.time()

    py = sys.executable
    data, train = work / "data", work / "train"
    num_videos = 72 if args.smoke else variant.num_videos
    save()
    stage = run_stage(
        dataset_command(py, data, num_videos, variant.size, variant.num_frames), out / "dataset.log", left()
    )
    record["stages"]["dataset"] = stage
    save()
    if stage["outcome"] != "ok":
        return record

    budget = ["--max-steps", "3"] if args.smoke else ["--max-steps", "1000000", "--max-minutes", args.train_minutes]
    train_args = ["--overwrite", "--ckpt-every", "0", *budget]
    train_args += variant.bucket_override() + variant.overrides + variant.train_only
    stage = run_stage(train_command(py, TRAIN_CONFIG, train, data, train_args), out / "train.log", left())
    stage.update(loss_summary(train / "metrics.jsonl"))
    record["stages"]["train"] = stage
    save()
    if stage["outcome"] != "ok":
        return record

    first_cost = first_seconds = None
    for k, setting in enumerate(variant.samplings):
        setting = dict(setting, num_steps=2) if args.smoke else dict(setting)
        name = f"sample{k}_s{setting['num_steps']}_cfg{setting['guidance_scale']:g}"
        room = left() - EVAL_RESERVE_S
        if first_seconds is not None:
            estimate = first_seconds * sampling_cost(setting) / first_cost
            if estimate * 1.15 > room:
                record["samplings_done"].append(dict(name=name, **setting, skipped=f"needs ~{estimate:.0f} s"))
                continue
        samples = work / name
        sample_args = [
            "--resolution",
            f"{variant.size}x{variant.size}",
            "--num-frames",
            variant.num_frames,
            "--guidance-scale",
            setting["guidance_scale"],
            "--batch-size",
            setting["batch_size"],
            "--no-progress",
            *variant.bucket_override(),
            *variant.overrides,
        ]
        cmd = sample_command(py, SAMPLE_CONFIG, train, data, samples, setting["num_steps"], sample_args)
        entry = dict(name=name, **setting, sample=run_stage(cmd, out / f"{name}.log", room))
        record["samplings_done"].append(entry)
        save()
        if entry["sample"]["outcome"] != "ok":
            break
        if first_seconds is None:
            first_seconds, first_cost = entry["sample"]["seconds"], sampling_cost(setting)
        scores = out / f"{name}_eval.json"
        entry["eval"] = run_stage(eval_command(py, samples, scores), out / f"{name}_eval.log", left())
        if entry["eval"]["outcome"] == "ok":
            report = json.loads(scores.read_text())
            entry["scores"] = {a: round(report[f"{a}_acc"], 4) for a in ("color", "shape", "direction", "all")}
        save()
    record["seconds_total"] = round(time.time() - args.started_at, 1)
    save()
    return record


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
    info["thread_siblings"] = siblings
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True, cwd=ROOT
    )
    info["torch"] = probe.stdout.strip() or probe.stderr.strip()[-300:]
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


def child_env() -> dict:
    env = dict(os.environ)
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="2", MKL_NUM_THREADS="2", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def launch(index: int, cores, args) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--run-one", str(index), "--results", args.results, "--work", args.work]
    cmd += ["--train-minutes", str(args.train_minutes), "--deadline-at", str(args.deadline_at)]
    cmd += ["--started-at", str(time.time())] + (["--smoke"] if args.smoke else [])

    def pin():
        if cores is not None:
            os.sched_setaffinity(0, cores)

    log = open(args.results / f"v{index}_{VARIANTS[index].name}.driver.log", "w")
    return subprocess.Popen(
        [str(c) for c in cmd], cwd=ROOT, env=child_env(), stdout=log, stderr=subprocess.STDOUT,
        preexec_fn=pin, start_new_session=True,
    )  # fmt: skip


def print_table(records: list) -> None:
    print(f"\n{'variant':28s} {'steps':>6s} {'s/step':>7s} {'loss':>7s}  {'sampling':18s} {'min':>5s}  col / shp / dir")
    for r in records:
        train = r.get("stages", {}).get("train", {})
        head = f"v{r['index']} {r['name']:25s} {train.get('steps', 0):>6} {train.get('median_step_s') or 0:>7.3f} "
        head += f"{train.get('loss_last10pct', float('nan')):>7.4f}"
        samplings = r.get("samplings_done") or [{}]
        for s in samplings:
            scores = s.get("scores")
            text = f"{scores['color']:.3f} / {scores['shape']:.3f} / {scores['direction']:.3f}" if scores else ""
            text = text or s.get("skipped") or (s.get("sample") or {}).get("outcome") or r.get("outcome", "")
            seconds = (s.get("sample") or {}).get("seconds", 0) / 60
            print(f"{head}  {s.get('name', '-'):18s} {seconds:>5.1f}  {text}")
            head = " " * len(head)


def sweep(args) -> None:
    indices = list(range(len(VARIANTS))) if args.variants is None else [int(v) for v in args.variants.split(",")]
    args.results.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    args.started_at = time.time()
    args.deadline_at = args.started_at + 60 * args.deadline_minutes - 20  # children stop here; the driver waits 20 s
    jobs = args.jobs or len(indices)
    cores = core_sets(min(jobs, len(indices)), args)
    summary = dict(
        command=" ".join(shlex.quote(a) for a in sys.argv),
        machine=machine_info(),
        train_minutes=args.train_minutes,
        deadline_minutes=args.deadline_minutes,
        smoke=args.smoke,
    )
    print(f"{len(indices)} variants, {jobs} at a time, cores {cores}; results in {args.results}", flush=True)
    waiting, running, finished = list(indices), {}, {}  # running: process -> (variant index, core slot)
    hard_stop = args.started_at + 60 * args.deadline_minutes
    while waiting or running:
        busy = {slot for _, slot in running.values()}
        for slot in range(len(cores)):
            if waiting and slot not in busy:
                index = waiting.pop(0)
                running[launch(index, cores[slot], args)] = (index, slot)
        for proc, (index, _) in list(running.items()):
            if proc.poll() is not None:
                finished[index] = proc.returncode
                del running[proc]
        if time.time() > hard_stop:
            for proc, (index, _) in running.items():
                os.killpg(proc.pid, signal.SIGKILL)
                finished[index] = "killed at the deadline"
            running.clear()
            finished.update({index: "not started before the deadline" for index in waiting})
            waiting.clear()
        time.sleep(1.0)
    records = []
    for index in indices:
        path = args.results / f"v{index}_{VARIANTS[index].name}.json"
        record = json.loads(path.read_text()) if path.exists() else dict(index=index, name=VARIANTS[index].name)
        if finished.get(index) != 0:
            record["outcome"] = f"driver: {finished.get(index)}"
        records.append(record)
    summary["seconds"] = round(time.time() - args.started_at, 1)
    summary["variants"] = records
    (args.results / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print_table(records)
    print(f"\nsweep took {summary['seconds'] / 60:.1f} min; {args.results / 'summary.json'}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, required=True, help="JSON results, eval reports and logs")
    parser.add_argument("--work", type=Path, default=None, help="clips, checkpoints, samples (default RESULTS/work)")
    parser.add_argument("--variants", default=None, help="comma-separated indices (default: all)")
    parser.add_argument("--train-minutes", type=float, default=6.0, help="training wall budget of every variant")
    parser.add_argument("--deadline-minutes", type=float, default=9.0, help="the whole sweep ends by then")
    parser.add_argument("--cores-per-variant", type=int, default=2)
    parser.add_argument("--first-core", type=int, default=2, help="leave the cores before it to the system")
    parser.add_argument("--jobs", type=int, default=None, help="variants at a time (default: all at once)")
    parser.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin variants to cores")
    parser.add_argument("--smoke", action="store_true", help="3 training steps, 2 sampling steps, 72 clips")
    parser.add_argument("--run-one", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--deadline-at", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--started-at", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.results = args.results.resolve()
    args.work = (args.work or args.results / "work").resolve()
    if args.run_one is not None:
        run_variant(args.run_one, VARIANTS[args.run_one], args)
    else:
        sweep(args)


if __name__ == "__main__":
    main()
