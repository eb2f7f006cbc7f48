#!/usr/bin/env python
"""Long streaming without drift, measured in one call on MovingShapes: teacher -> causal ODE init -> Self-Forcing
and long-rollout DMD from the same init, then both students streamed on the same prompts and seeds, scored per
window at ``--long-multiple`` x the training length (default 8x: 128 frames) and at the training length against the
teacher.

  # one GPU: every stage (about 4 + 1.5 + 2.5 + 2.5 minutes of training, then sampling and scoring)
  python -m benchmarks.long_streaming_quality --out outputs/benchmarks/long_streaming --seed 424242
  # the same in calls under 10 minutes each: a stage whose final checkpoint exists is reused, so repeat the call
  python -m benchmarks.long_streaming_quality --out DIR --stop-after ode   # teacher + causal init
  python -m benchmarks.long_streaming_quality --out DIR                    # students + scoring
  # CPU smoke test of the whole chain with tiny networks and clips (tests/test_long_streaming_quality.py)
  python -m benchmarks.long_streaming_quality --tiny --out outputs/long_streaming_tiny
  # streaming options on the trained students: the long run again with the KV re-cache at every window shift, and
  # a prompt switch mid-stream (with and without the re-cache under the new prompt)
  python -m benchmarks.long_streaming_quality --out DIR --kv-recache both --prompt-switch
  # the prompt switch alone on the trained students (no training, no teacher sampling; report_switch.json), with the
  # kept window re-rendered under the new prompt from t = 0.5, 0.75 and 1 (StreamingGenerator(switch_renoise=t))
  python -m benchmarks.long_streaming_quality --out DIR --switch-only --switch-renoise 0.5 0.75 1.0
  # the long run with absolute RoPE positions and with the text + sinks anchored at the window's start, same seeds
  python -m benchmarks.long_streaming_quality --out DIR --rope-anchor both
  # the students' per-window scores while they train (validation every 40 steps at 8x the clip, 12 captions)
  python -m benchmarks.long_streaming_quality --out DIR --students self_forcing --student-minutes 8 --validation-every 40
  # long tuning after Self-Forcing (Self-Forcing++'s order) against Self-Forcing trained on for as long (the
  # control, self_forcing_more), and the long run again without sink frames
  python -m benchmarks.long_streaming_quality --out DIR --long-init self_forcing --sink-frames-variant 0
  # a teacher that must know colour, shape and direction (>= 0.95 on seeds apart from the evaluation's) before any
  # student learns from it (trained on a minute at a time, 3 rounds at most), and 288 scored clips (each caption 4x)
  python -m benchmarks.long_streaming_quality --out DIR --teacher-gate 0.95 --num-prompts 288

The teacher learns clips of the ``--motion`` rule (default ``wrap``: the shape crosses an edge and re-enters at the
opposite one, so every window of a long clip has the caption's direction; ``bounce`` reverses at the walls), so the
continuation past the training length is defined and the teacher knows it. Both students sample with the same
rolling cache (``--window-frames``, ``--sink-frames``). Written to ``--out``: ``report.json`` (every number, the
criteria below as pass/fail, and each again over paired resamples of the prompts), ``report.partial.json`` while
the evaluation runs (rewritten as each student's part ends, its ``pending`` naming the parts still to come: a cut
call keeps what was scored, and an earlier complete report.json stays as it was) and the stage run directories
(checkpoints, metrics.jsonl). The criteria and the printed tables live in ``benchmarks/long_streaming_report.py``.

Criteria (each student): every window keeps >= 95% of the first window's colour, shape and direction accuracy;
every window's share of clips with frame statistics in range >= 95% of the teacher's share at the training length;
chunk-edge flicker <= 1.1x the in-chunk frame change; at the training length >= 98% of the teacher's accuracy.
With ``--kv-recache shift|both`` the long run is (also) streamed with ``kv_recache="shift"`` and scored the same way
(``long_kv_recache``). With ``--prompt-switch`` every prompt switches at the first chunk start at or after the clip
length to a caption that differs in colour, shape and direction, and the window right after the switch is scored
against the new caption: its colour, shape and direction accuracy >= 90% (``switch``; LongLive's re-cache under the
new prompt, and for comparison the same switch keeping the old prompt's keys/values). ``--switch-renoise T ...``
adds one switch per T (``renoise_T``) whose kept window is re-rendered under the new prompt from time T before it is
re-cached; every switch run also reports ``boundary_change`` (the frame change across the switch over the change
between frames inside the windows around it: a re-render that jumps shows there).
By default (``--rope-anchor window``, what the sampling CLI streams with) the long run and the prompt switch
are streamed with ``rope_anchor="window"`` (the text and the sink frames at the window's start in RoPE time,
``KVCache``); ``--rope-anchor both`` judges the absolute run and adds the anchored one on the same seeds
(``long_rope_window``, ``switch_rope_window``); the training-length run never rolls the window, so it is the same
either way. The long-rollout student trains under ``--long-rope-anchor`` (default window, as its config).
``--sink-frames-variant N`` streams the long run again with N sink frames (``long_sinks``). Every long run also
reports ``background_by_frame`` (the mean background level of each frame), which shows where a drift starts.
With ``--long-init self_forcing`` the long-rollout student starts from the Self-Forcing student, and a control
(``self_forcing_more``) trains Self-Forcing on from the same student for the same minutes.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from benchmarks.common import timed
from benchmarks.long_streaming_report import (
    CONTROL,
    GATE_KEYS,
    STUDENTS,
    criteria,
    misses_by_caption,
    print_report,
    print_switches,
    resampled_criteria,
    student_differences,
    student_names,
    switch_criteria_runs,
)
from benchmarks.long_streaming_switch import settings_of, switch_runs
from opensora.eval.moving_shapes import kept_process_pool

ROOT = Path(__file__).resolve().parents[1]

STAGES = ("teacher", "ode", "self_forcing", "long_rollout")
# with --long-init self_forcing, the control (CONTROL): Self-Forcing trained on from its own student for the
# long-rollout student's minutes (a fresh critic from the teacher, as the long-rollout run gets), so the gain of the
# method is measured against as much more Self-Forcing, not against less training
TRAINED_STAGES = (*STAGES, CONTROL)
CONFIGS = dict(
    teacher="configs/diffusion/train/moving_shapes_gpu.py",
    ode="configs/distill/causal_ode_gpu.py",
    self_forcing="configs/distill/self_forcing_gpu.py",
    long_rollout="configs/distill/long_rollout_gpu.py",
    self_forcing_more="configs/distill/self_forcing_gpu.py",
)
# the streamed students, which are also the stages that train with DMD's guided real score
DMD_STAGES = STUDENTS
# --tiny: every stage on CPU in seconds (16x16 clips of 8 frames, a 2-block MMDiT, a few steps)
TINY_MODEL = "dict(hidden_size=32, num_heads=2, depth_double=1, depth_single=1, axes_dims=(4, 6, 6))"
TINY_DATASET = dict(num=72, height=16, width=16, num_frames=8)  # merged into the stage's one dataset line
TINY_DATA = (
    "bucket_config = dict(_delete_=True, **{'16x16': {8: (1.0, 2)}})\n"
    "num_workers = 0\nprecision = 'fp32'\ntensorboard = False\n"
)


# ---- stages -----------------------------------------------------------------------------------------------------
def stage_config(args, stage: str) -> Path:
    """The stage's config: the project's GPU config with the motion rule (and, with --tiny, tiny sizes) on top."""
    dataset = dict(motion=args.motion, **(TINY_DATASET if args.tiny else {}))  # one line: a second would replace it
    lines = [
        f"_base_ = [{str(ROOT / CONFIGS[stage])!r}]",
        f"dataset = dict({', '.join(f'{k}={v!r}' for k, v in dataset.items())})",
        f"seed = {int(args.train_seed)}",
    ]
    method = {}  # the stage's method overrides, one dict (a second assignment would replace the first)
    roles = {}  # per role, its overrides as "key=value" texts: one models = dict(...) line, for the same reason
    if stage in DMD_STAGES and args.adam_beta1 is not None:  # the student's and the critic's, as Self-Forcing's beta1 0
        from opensora.config import load_config

        base = load_config(str(ROOT / CONFIGS[stage])).models
        for role in ("student", "critic"):
            betas = (float(args.adam_beta1), float(base[role].optimizer.betas[1]))
            roles.setdefault(role, []).append(f"optimizer=dict(betas={betas!r})")
    if stage in DMD_STAGES and args.real_guidance is not None:
        method["real_guidance_scale"] = float(args.real_guidance)
    if stage == "long_rollout" and args.switch_prob is not None:
        method["switch_prob"] = float(args.switch_prob)
    if stage == "long_rollout" and args.long_context_steps is not None:
        method["context_steps"] = args.long_context_steps
    if stage == "long_rollout" and args.long_critic_windows is not None:
        method["critic_windows"] = int(args.long_critic_windows)
    if stage == "long_rollout" and args.long_update_every is not None:
        method["student_update_every"] = int(args.long_update_every)
    if stage == "long_rollout" and args.long_first_window_share is not None:
        method["first_window_share"] = float(args.long_first_window_share)
    if stage == "long_rollout" and args.long_sink_frames is not None:  # the sampler's key and the method's copy
        lines.append(f"sink_frames = {int(args.long_sink_frames)}")
        method["kv_sink_frames"] = int(args.long_sink_frames)
    if stage in DMD_STAGES and validation_every(args, stage):  # the per-window curve while the student trains
        from opensora.config import load_config

        frames = 8 if args.tiny else int(load_config(str(ROOT / CONFIGS[stage])).dataset.num_frames)
        long_frames = frames * int(args.long_multiple)
        validation = dict(every=validation_every(args, stage), motion=args.motion, long_frames=long_frames)
        if args.validation_prompts is not None:
            validation.update(prompts=validation_prompts(args.validation_prompts), batch_size=args.validation_prompts)
        if args.student_checkpoint == "best":
            validation["best_metric"] = args.best_metric
        lines.append(f"validation = dict({', '.join(f'{k}={v!r}' for k, v in validation.items())})")
        if stage != "long_rollout":  # the curve streams as the evaluation does (LongRollout's config has its own)
            lines.append(f"sink_frames = {int(args.sink_frames)}")
            if args.window_frames is not None:
                lines.append(f"window_frames = {int(args.window_frames)}")
    if stage == "long_rollout":  # the sampler's key and the method's copy
        lines.append(f"rope_anchor = {args.long_rope_anchor!r}")
        method["kv_rope_anchor"] = args.long_rope_anchor
    if args.tiny:
        lines.append(TINY_DATA)
        if stage == "teacher":
            lines.append(f"model = {TINY_MODEL}")
        else:
            for role in ("student", "teacher") if stage == "ode" else ("student", "teacher", "critic"):
                roles.setdefault(role, []).extend([f"model={TINY_MODEL}", "precision='fp32'"])
            if stage == "ode":
                method.update(teacher_num_steps=4, num_cached_pairs=8)
            if stage == "long_rollout":
                lines.append("window_frames = 6")
                method.update(kv_window_frames=6, rollout_multiple=3)
    if roles:
        entries = [f"{role}=dict({', '.join(parts)})" for role, parts in roles.items()]
        lines.append(f"models = dict({', '.join(entries)})")
    if method:
        lines.append(f"method = dict({', '.join(f'{k}={v!r}' for k, v in method.items())})")
    path = Path(args.out) / "configs" / f"{stage}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def validation_prompts(count: int) -> list:
    """``count`` different captions of the 72, chosen one at a time as the caption whose colour, shape and direction
    are the least used so far (each count scaled by how many values its attribute has): every colour, shape and
    direction as evenly as ``count`` allows (the captions' own order, colour first, would give 6 clips of one
    shape and one direction)."""
    from collections import Counter

    from opensora.datasets.moving_shapes import all_captions, parse_caption

    captions = all_captions()
    parts = [parse_caption(c) for c in captions]
    sizes = [len({p[i] for p in parts}) for i in range(3)]
    used, chosen = [Counter() for _ in range(3)], []

    def load(j):  # the most used of its attributes first, then the others
        return sorted((used[i][parts[j][i]] * sizes[i] for i in range(3)), reverse=True)

    for _ in range(count):
        pick = min((j for j in range(len(captions)) if j not in chosen), key=lambda j: (load(j), j))
        chosen.append(pick)
        for i in range(3):
            used[i][parts[pick][i]] += 1
    return [captions[j] for j in chosen]


def checkpoint_every(args, stage: str) -> int:
    """The stage's ``--ckpt-every``: at every validation where the best checkpoint is kept, else the final one only."""
    chooses = stage in DMD_STAGES and args.student_checkpoint == "best" and validation_every(args, stage)
    return validation_every(args, stage) if chooses else 0


def validation_every(args, stage: str) -> int:
    """The stage's validation interval: ``--long-validation-every`` for LongRollout (its iterations are 2.5x
    Self-Forcing's, so a few minutes make a hundred or two), else ``--validation-every`` (0: none). Validations take
    their time out of a stage's minutes, so the control keeps Self-Forcing's interval."""
    if stage == "long_rollout" and args.long_validation_every is not None:
        return int(args.long_validation_every)
    return int(args.validation_every or 0)


def chosen_checkpoint(args, stage: str, last):
    """The checkpoint of ``stage`` that is scored and built on: its best by the validations
    (``--student-checkpoint best``, ``RUN/best``) where the run kept one, else ``last``."""
    from opensora.best_checkpoint import best_checkpoint_of, read_best

    if stage == "teacher":
        return gated_teacher(Path(args.out) / "teacher", last)
    if stage not in DMD_STAGES or args.student_checkpoint != "best" or last is None:
        return last
    noted = read_best(Path(args.out) / stage) or {}
    if noted.get("metric") not in (None, args.best_metric):  # a stage reused from a run with another --best-metric
        print(f"   {stage}: its best checkpoint was chosen by {noted['metric']} as it trained, not by --best-metric "
              f"{args.best_metric} (train the stage again to choose by that)", flush=True)  # fmt: skip
    try:
        return best_checkpoint_of(Path(args.out) / stage)
    except FileNotFoundError as missing:  # no validation noted a score, or a run killed before its final save
        print(f"   {stage}: {missing}; using its last checkpoint", flush=True)
        return last


def gated_teacher(run_dir: Path, last):
    """The teacher the students build on: the checkpoint ``--teacher-gate`` chose when it stopped (``gate.json``'s
    ``chosen``, ``gate_teacher``), else ``last`` (no gate, a run from before the gate chose, or a teacher trained on
    past the gate's checks)."""
    from opensora.checkpoint_layout import checkpoint_dir
    from opensora.training.run_dir import checkpoint_step

    record = run_dir / "gate.json"
    if last is None or not record.is_file():
        return last
    gate = json.loads(record.read_text())
    if gate.get("chosen") is None or checkpoint_step(last) not in [c["step"] for c in gate["checks"]]:
        return last
    chosen = checkpoint_dir(run_dir, gate["chosen"])
    if not chosen.is_dir():
        print(f"   teacher gate: its chosen step {gate['chosen']} is gone; using {last.name}", flush=True)
        return last
    return chosen


def gate_passed(check: dict, threshold: float) -> bool:
    return all(check[k] >= threshold for k in GATE_KEYS)


def best_gate_check(checks: list, threshold: float, run_dir: Path) -> dict:
    """The check the students build on: the last where it passed; where the rounds ran out below the gate, the one
    with the highest worst attribute (the later of equal ones) whose checkpoint is still on disk. A round more can
    score lower than the one before (chain F: direction 0.875, then 0.847 on the 72 gate captions)."""
    from opensora.checkpoint_layout import checkpoint_dir

    if gate_passed(checks[-1], threshold):
        return checks[-1]
    worst = lambda c: min(c[k] for k in GATE_KEYS)  # noqa: E731
    rank = lambda c: (worst(c), c["step"])  # noqa: E731
    best = max(checks, key=rank)
    kept = [c for c in checks if checkpoint_dir(run_dir, c["step"]).is_dir()] or checks[-1:]
    chosen = max(kept, key=rank)
    if chosen is not best:
        print(f"   teacher gate: the best check (step {best['step']}) was pruned (keep_last)", flush=True)
    if chosen is not checks[-1]:
        print(f"   teacher gate: none passed; using step {chosen['step']}, the best check ({worst(chosen):.3f} at "
              "worst), not the last", flush=True)  # fmt: skip
    return chosen


def selection_record(run_dir: Path, ckpt) -> Optional[dict]:
    """Which step was scored, against the last one, and by which validation score (None without best.json)."""
    from opensora.best_checkpoint import read_best
    from opensora.training.run_dir import checkpoint_step

    record = read_best(run_dir)
    last = last_checkpoint(run_dir)
    if record is None or record["best"] is None or last is None:
        return None
    return dict(
        metric=record["metric"],
        step=checkpoint_step(ckpt),
        last_step=checkpoint_step(last),
        best=record["best"],
        history=record["history"],
    )


def training_summary(run_dir: Path) -> dict:
    """Steps, median step time and the last logged value of each loss of a stage's metrics.jsonl."""
    path = Path(run_dir) / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    rows = [row for row in records if "step_time" in row]
    times = sorted(row["step_time"] for row in rows)
    losses = {k: v for row in rows for k, v in row.items() if k.endswith("loss")}  # the last value of each
    # --validation-every: the worst window's scores at each validation step (val/*_window_min)
    curve = []
    for row in records:
        worst = {k[4:]: v for k, v in row.items() if k.startswith("val/") and k.endswith("_window_min")}
        if worst:
            curve.append(dict(step=row["step"], **worst))
    return dict(
        steps=len(rows),
        step_time_median=times[len(times) // 2] if times else None,
        last_losses=losses,
        validation_window_min=curve,
    )


def last_checkpoint(run_dir: Path):
    found = sorted((run_dir / "checkpoints").glob("step-*")) if (run_dir / "checkpoints").is_dir() else []
    return found[-1] if found else None


def train(args, stage: str, minutes: float, inits: dict, steps: Optional[int] = None, resume: bool = False) -> Path:
    """Run one stage with the project's trainer (torchrun, one process) unless its final checkpoint exists: for
    ``minutes``, or for ``steps`` steps when given (``minutes`` then caps it). ``resume``: train the finished stage
    on from its last checkpoint (``--resume auto``) for ``minutes`` more (``--tiny``: ``--tiny-steps`` more)."""
    from opensora.training.run_dir import checkpoint_step

    run_dir = Path(args.out) / stage
    done = last_checkpoint(run_dir)
    max_steps = args.tiny_steps if args.tiny else steps
    if done is not None and not resume and max_steps is not None and (checkpoint_step(done) or 0) >= max_steps:
        (run_dir / FINISHED).write_text(FINISHED_TEXT)  # killed after its last step was saved: it is final
    if done is not None and not resume and stage_finished(args, stage):
        print(f"== {stage}: reusing {done}")
        return done
    # checkpoints of a stage that did not finish (killed between its validation checkpoints): train on from them
    unfinished = done is not None and not resume
    if unfinished:
        print(f"== {stage}: {done} is not its final checkpoint (the stage did not finish): training on from it")
        budget = ["--resume", "auto", "--max-steps", str(max_steps or 1000000)]
        budget += [] if args.tiny else ["--max-minutes", str(minutes)]
    elif resume:
        budget = ["--resume", "auto", "--max-steps"]
        budget += (
            [str(checkpoint_step(done) + args.tiny_steps)] if args.tiny else ["1000000", "--max-minutes", str(minutes)]
        )
    elif args.tiny:
        budget = ["--max-steps", str(args.tiny_steps)]
    else:
        budget = ["--max-steps", str(steps or 1000000), "--max-minutes", str(minutes)]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "1",
        str(ROOT / "scripts/diffusion/train.py"),
        str(stage_config(args, stage)),
        "--outputs",
        str(run_dir),
        "--ckpt-every",
        str(checkpoint_every(args, stage)),
        *budget,
    ]
    for role, path in inits.items():  # (a resumed run still builds its frozen roles from them)
        command += [f"--models.{role}.init_from.path", str(path)]
    print(f"== {stage}: {' '.join(command[5:])}", flush=True)
    started = time.monotonic()
    if args.launcher == "in-process":  # one process, the trainer's own single-rank set-up (no imports per stage)
        from opensora.training.launch import main as train_main

        train_main(command[7:])
    else:
        env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")  # this checkout
        subprocess.run(command, check=True, env=env)  # in the caller's directory: a relative --out means the same
    print(f"   {stage} trained in {time.monotonic() - started:.0f} s", flush=True)
    (run_dir / FINISHED).write_text(FINISHED_TEXT)
    return last_checkpoint(run_dir)


FINISHED = "stage_finished"  # written when a stage's training returns: what a later call may reuse
FINISHED_TEXT = "the stage's training ended; its last checkpoint is final\n"


def stage_finished(args, stage: str) -> bool:
    """Whether a stage's checkpoints are final: its training returned (``FINISHED``), or it saves only at the end
    (``--ckpt-every 0``: any checkpoint is the final one; run directories from before the marker)."""
    return (Path(args.out) / stage / FINISHED).is_file() or checkpoint_every(args, stage) == 0


# ---- scoring ----------------------------------------------------------------------------------------------------
def accuracy(videos, prompts, motion, workers: int = 1) -> dict:
    """Colour, shape, direction and all-three accuracy of clips of the training length under the motion rule
    (``score_clips``: a bounce clip may turn at a wall inside the clip -- ground truth reads the caption's direction in
    about 3 clips of 4 at 64x64x16 -- so its direction is the bounce rule's over the clip)."""
    from opensora.eval.moving_shapes_windows import score_clips
    from opensora.eval.resampled_criteria import hit_string

    report = score_clips(videos, prompts, motion, workers=workers)
    scores = {f"{a}_acc": getattr(report, f"{a}_acc") for a in ("color", "shape", "direction", "all")}
    # per clip (one character: resampled_criteria's hit strings), so a verdict's stability can be measured
    hits = {a: [hit_string([row["correct"][a]]) for row in report.rows] for a in ("color", "shape", "direction")}
    return dict(scores, confusions=confusions(report.rows), clip_hits=hits)


def confusions(rows) -> dict:
    """The wrong readings of each attribute as ``{"caption value->read value": clips}`` (a read of None: no shape, or
    no motion found), so a score below the teacher's says which colours, shapes or directions it loses."""
    wrong = {}
    for row in rows:
        for attribute, hit in row["correct"].items():
            if hit is False:
                key = f"{row['truth'][attribute]}->{row['pred'][attribute]}"
                wrong.setdefault(attribute, {})
                wrong[attribute][key] = wrong[attribute].get(key, 0) + 1
    return {a: dict(sorted(c.items(), key=lambda kv: -kv[1])) for a, c in wrong.items()}


def student_generator(args, name, ckpt, clip):
    """The student's ``StreamingGenerator`` as every run streams it (its config's steps, rollout and context time;
    the benchmark's window, sinks and RoPE anchor)."""
    from benchmarks.streaming import clip_window
    from opensora.config import load_config
    from opensora.inference.sampler import VideoSampler
    from opensora.inference.streaming.generator import StreamingGenerator

    cfg = load_config(str(stage_config(args, name)))
    sampler = VideoSampler.from_config(cfg, ckpt, role="student", device=args.device, progress=False)
    frames, height, width = clip
    window = args.window_frames if args.window_frames is not None else clip_window(sampler, frames, height, width)
    return StreamingGenerator(
        sampler,
        step_list=list(cfg.step_list),
        rollout=cfg.get("rollout", "renoise"),
        window_frames=window,
        sink_frames=args.sink_frames,
        context_time=float(cfg.get("context_time") or 0.0),
        rope_anchor="window" if args.rope_anchor == "window" else "absolute",  # the anchor the criteria judge
    )


def evaluate_student(args, name, ckpt, prompts, seeds, clip, teacher, teacher_videos=None) -> dict:
    """Stream the student at the training length (accuracy, speed, flicker) and at the long length (windows,
    flicker by window). ``teacher_videos`` (its clips of the same prompts and seeds): the teacher's frame steps at
    the student's chunk edges, the flicker of a model that has no chunks."""
    from opensora.eval.moving_shapes_windows import background_by_frame, chunk_edge_flicker, score_windows
    from opensora.inference.io import save_samples

    generator = student_generator(args, name, ckpt, clip)
    sampler, window = generator.sampler, generator.window_frames
    frames, height, width = clip
    chunk = sampler.model.causal_chunk_frames

    def stream(num_frames):
        return generator.generate(prompts, seeds, num_frames, height, width).numpy()

    stream(frames)  # warm-up
    seconds, short = timed(lambda: stream(frames))
    long_frames = frames * args.long_multiple
    long_seconds, long = timed(lambda: stream(long_frames))
    vae = sampler.vae
    chunk_pixels = chunk * vae.temporal_compression
    first_pixels = vae.get_video_size((chunk, 4, 4))[0]
    result = dict(
        ckpt=str(ckpt),
        selection=selection_record(Path(args.out) / name, ckpt),
        training=training_summary(Path(args.out) / name),
        window_frames=window,
        sink_frames=args.sink_frames,
        rope_anchor=generator.rope_anchor,
        seconds=seconds,
        frames_per_s=len(prompts) * frames / seconds,
        long_seconds=long_seconds,
        long_frames_per_s=len(prompts) * long_frames / long_seconds,
        **accuracy(short, prompts, args.motion, args.score_workers),
        flicker=chunk_edge_flicker(short, chunk_pixels, first_pixels),
        long=dict(
            frames=long_frames,
            **score_windows(list(long), prompts, frames, motion=args.motion, workers=args.score_workers),
            flicker=chunk_edge_flicker(long, chunk_pixels, first_pixels, window=frames),
            background_by_frame=background_by_frame(long),
        ),
    )
    result["long"]["misses_by_caption"] = misses_by_caption(result["long"]["clip_hits"], prompts)
    if teacher_videos is not None:
        result["flicker_teacher_same_edges"] = chunk_edge_flicker(teacher_videos, chunk_pixels, first_pixels)
    if args.save_long_clips:  # what a drift looks like, small enough to come back with a chain's archive (mp4:
        # tools/eval_moving_shapes.py --window 16 scores them again, from crf-18 video)
        save_samples(Path(args.out) / name / "long_clips", prompts, long[: args.save_long_clips])

    def variant(**settings) -> dict:
        """The long run again (same seeds) with the generator's attributes set to ``settings``, scored the same way."""
        with settings_of(generator, **settings):
            variant_seconds, videos = timed(lambda: stream(long_frames))
        return dict(
            frames=long_frames,
            seconds=variant_seconds,
            frames_per_s=len(prompts) * long_frames / variant_seconds,
            **score_windows(list(videos), prompts, frames, motion=args.motion, workers=args.score_workers),
            flicker=chunk_edge_flicker(videos, chunk_pixels, first_pixels),
            background_by_frame=background_by_frame(videos),
            # how far the variant moved the plain run's pixels (0: it changed nothing on these seeds)
            mean_abs_diff_vs_long=float(abs(videos.astype("float32") - long.astype("float32")).mean()),
        )

    if args.rope_anchor == "both":  # the absolute run is judged; the anchored one beside it
        result["long_rope_window"] = variant(rope_anchor="window")
    if args.sink_frames_variant is not None:  # the sinks' share in what the long run does, same seeds
        sinks = args.sink_frames_variant
        result["long_sinks"] = dict(sink_frames=sinks, **variant(sink_frames=sinks))
        if args.rope_anchor == "both":  # neither a sink jump nor text at out-of-range RoPE distances
            result["long_sinks_rope_window"] = dict(
                sink_frames=sinks, **variant(sink_frames=sinks, rope_anchor="window")
            )
    if args.kv_recache in ("shift", "both"):
        recache = variant(kv_recache="shift")
        if args.kv_recache == "shift":
            result["long"] = recache  # the long criteria judge the re-cached run
        result["long_kv_recache"] = recache
    return judged(args, result, teacher)


def judged(args, student: dict, teacher: dict) -> dict:
    """``student`` with its ratios to the teacher and its criteria, plain and resampled (set again once its prompt
    switch is in: the switch adds criteria lines)."""
    student["over_teacher"] = {
        k: (student[k] / teacher[k] if teacher[k] else None) for k in ("color_acc", "shape_acc", "direction_acc")
    }
    student["criteria"] = criteria(student, teacher)
    student["criteria_resampled"] = resampled_criteria(student, teacher, args.resample_draws, args.seed)
    return student


def student_switch(args, name, ckpt, prompts, seeds, clip) -> dict:
    """The student's prompt switch (``switch_runs``: under the anchor the long criteria judge; with ``--rope-anchor
    both`` under the window anchor too), from a fresh generator warmed by one stream at the clip length, so the
    switch's seconds are a warm stream's."""
    generator = student_generator(args, name, ckpt, clip)
    frames, height, width = clip
    generator.generate(prompts, seeds, frames, height, width)
    return switch_runs(args, generator, prompts, seeds, clip)


def add_switch(args, name, ckpt, student: dict, prompts, seeds, clip, teacher: dict) -> dict:
    """The student's prompt switch added to its evaluation, and its criteria judged again with it."""
    student.update(student_switch(args, name, ckpt, prompts, seeds, clip))
    return judged(args, student, teacher)


def evaluation_inputs(args):
    """(prompts, seeds, the teacher's config, clip (frames, height, width), the report's header) of every
    evaluation: ``--num-prompts`` held captions, prompt i at seed ``--seed`` + i. Past the 72 captions the list
    starts again (with new seeds): a window's share of 72 clips moves 0.014 a clip, too coarse for a 95% criterion."""
    from opensora.datasets.moving_shapes import all_captions

    captions = all_captions()
    prompts = [captions[i % len(captions)] for i in range(args.num_prompts)]
    seeds = [args.seed + i for i in range(len(prompts))]
    cfg, clip = teacher_config_and_clip(args)
    header = dict(
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        motion=args.motion,
        prompts=len(prompts),
        seeds=[seeds[0], seeds[-1]],
        clip=list(clip),
        long_multiple=args.long_multiple,
        long_init=args.long_init,
        resample_draws=args.resample_draws,  # the differences of a partial report are drawn as a complete one's
        resample_seed=args.seed,
    )
    return prompts, seeds, cfg, clip, header


def teacher_config_and_clip(args):
    """The teacher stage's config and its clip (frames, height, width): what the students are judged against."""
    from opensora.config import load_config

    cfg = load_config(str(stage_config(args, "teacher")))
    return cfg, (int(cfg.dataset.num_frames), int(cfg.dataset.height), int(cfg.dataset.width))


def sample_teacher(args, cfg, ckpt, prompts, seeds, clip):
    """(seconds, uint8 clips [N, T, H, W, 3]): the teacher's EMA weights at ``ckpt``, ``--teacher-steps`` with CFG
    ``--teacher-guidance``; the seconds count the sampling, not the loading."""
    from opensora.inference.sampler import VideoSampler

    teacher = VideoSampler.from_config(cfg, ckpt, role="model", device=args.device, progress=False)
    return timed(
        lambda: teacher.generate(
            prompts, seeds, *clip, num_steps=args.teacher_steps, guidance_scale=args.teacher_guidance, batch_size=16
        ).numpy()
    )


def evaluate(args, checkpoints: dict, save=lambda report: None) -> dict:
    """The teacher and each student on the same prompts and seeds. ``save(report)`` after the teacher and after each
    part, with ``report["pending"]`` naming the parts still to come: a call cut mid-evaluation keeps what was done."""
    from opensora.eval.moving_shapes_windows import score_windows

    started = time.monotonic()
    prompts, seeds, cfg, clip, header = evaluation_inputs(args)
    seconds, videos = sample_teacher(args, cfg, checkpoints["teacher"], prompts, seeds, clip)
    teacher_scores = dict(
        ckpt=str(checkpoints["teacher"]), seconds=seconds, **accuracy(videos, prompts, args.motion, args.score_workers)
    )
    teacher_window = score_windows(list(videos), prompts, clip[0], motion=args.motion, workers=args.score_workers)
    teacher_scores["stats_in_range"] = teacher_window["stats_window_min"]
    teacher_scores["stats_outside"] = teacher_window["windows"][0]["stats_outside"]
    teacher_scores["stats_hits"] = teacher_window["clip_hits"]["stats"]
    gate = Path(args.out) / "teacher" / "gate.json"
    if gate.is_file():  # --teacher-gate: the checks that decided how long the teacher trained
        teacher_scores["gate"] = json.loads(gate.read_text())
    names = [name for name in student_names(checkpoints) if not args.score or name in args.score]
    # every student's own evaluation first, then the switches: a call cut short loses the switch lines, not a student
    parts = [(name, "student") for name in names] + [(name, "switch") for name in names if args.prompt_switch]
    report = dict(header, teacher=teacher_scores, pending=[pending_text(part) for part in parts])
    teacher_scores["eval_seconds"] = time.monotonic() - started
    save(report)
    for index, (name, part) in enumerate(parts):
        started = time.monotonic()
        if part == "student":
            report[name] = evaluate_student(args, name, checkpoints[name], prompts, seeds, clip, teacher_scores, videos)
            report[name]["eval_seconds"] = 0.0
        else:
            add_switch(args, name, checkpoints[name], report[name], prompts, seeds, clip, teacher_scores)
        seconds = time.monotonic() - started
        report[name]["eval_seconds"] += seconds  # sampling, scoring, switches: a call's plan
        report["pending"] = [pending_text(p) for p in parts[index + 1 :]]
        save(report)
        print(f"   evaluated {pending_text((name, part))} in {seconds:.0f} s: "
              f"{evaluated_line(report[name], part)}", flush=True)  # fmt: skip
    del report["pending"]  # a complete report has none (a partial one names what it lacks)
    try:  # pure arithmetic on the scores above: a failure here must not lose the sampled evaluation
        differences = student_differences(report, args.resample_draws, args.seed)
    except Exception as failed:
        print(f"   the students' differences failed ({type(failed).__name__}: {failed}); report written without")
        differences = None
    if differences:
        report["differences"] = differences
    return report


def pending_text(part) -> str:
    """A part of the evaluation as the report's ``pending`` names it: "long_rollout", "long_rollout switch"."""
    name, kind = part
    return name if kind == "student" else f"{name} {kind}"


def evaluated_line(student: dict, part: str) -> str:
    """One line for the log as each part ends (the report may never be written when a call is cut)."""
    if part == "switch":
        runs = switch_criteria_runs(student)
        return ", ".join(f"{name} {run['new_prompt_ge_90pct']}" for name, run in runs) or "no judged switch run"
    long = student["long"]

    def number(value, digits=3):
        return "-" if value is None else f"{value:.{digits}f}"

    worst = "/".join(number(long[f"{a}_window_min"]) for a in ("color", "shape", "direction", "stats"))
    clip_length = "/".join(number(student[f"{a}_acc"]) for a in ("color", "shape", "direction"))
    flicker = number(long["flicker"]["edge_over_inside"], 2)
    return f"clip length {clip_length}, worst window {worst} (colour/shape/direction/stats), flicker {flicker}"


def write_report(path: Path, report: dict, partial: bool = False) -> None:
    """``report`` as JSON at ``path``, replaced whole (a reader never sees half a report). ``partial``: at
    ``NAME.partial.json`` beside it instead (the evaluation is still running), which the complete report removes."""
    from opensora.latent_cache.store import write_atomic

    path = Path(path)
    partial_path = path.with_suffix(".partial.json")
    write_atomic(
        partial_path if partial else path, lambda tmp: Path(tmp).write_text(json.dumps(report, indent=1) + "\n")
    )
    if not partial:
        partial_path.unlink(missing_ok=True)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/long_streaming")
    parser.add_argument("--motion", choices=("wrap", "bounce"), default="wrap")
    parser.add_argument("--teacher-ckpt", default=None, help="a trained teacher (of --motion clips): skip its stage")
    parser.add_argument("--teacher-minutes", type=float, default=4.0)
    parser.add_argument(
        "--teacher-gate",
        type=float,
        default=None,
        help="train the teacher on until its colour, shape and direction at the clip length reach this (e.g. 0.95)",
    )
    parser.add_argument("--teacher-gate-minutes", type=float, default=1.0, help="minutes per extra teacher round")
    parser.add_argument("--teacher-gate-rounds", type=int, default=3, help="extra teacher rounds at most")
    parser.add_argument("--ode-minutes", type=float, default=1.5)
    parser.add_argument("--student-minutes", type=float, default=2.5, help="each of the two students")
    parser.add_argument(
        "--student-steps",
        type=int,
        default=None,
        help="LongRollout and the control train this many steps each instead of --student-minutes (which then caps "
        "them): equal steps rather than equal minutes (LongRollout's step is ~3.8x Self-Forcing's)",
    )
    parser.add_argument(
        "--stage-steps",
        nargs="+",
        default=[],
        metavar="STAGE=N",
        help="train these stages N steps each, their minutes only a cap (e.g. teacher=4200 ode=880 self_forcing=400): "
        "a chain stopped by steps repeats its budgets where one stopped by the clock does not (the teacher gate's "
        f"extra rounds still run by minutes); stages: {', '.join(TRAINED_STAGES)}",
    )
    parser.add_argument(
        "--long-init",
        choices=("ode", "self_forcing"),
        default="ode",
        help="the long-rollout student starts from the causal init (as Self-Forcing) or from the Self-Forcing student "
        "(long tuning after it, Self-Forcing++'s order), which also trains and scores the control self_forcing_more: "
        "Self-Forcing trained on from its student for as long",
    )
    parser.add_argument(
        "--students",
        choices=("all", "self_forcing"),
        default="all",
        help="self_forcing: train and score the Self-Forcing student only (a question about inference, such as the "
        "sinks' share, needs no long-rollout student)",
    )
    parser.add_argument("--stop-after", choices=STAGES, default=None, help="end after this stage (calls under 10 min)")
    parser.add_argument(
        "--only-stage",
        choices=TRAINED_STAGES,
        default=None,
        help="train this stage alone and end; the stages it starts from must be trained already (two stages that "
        "need the same inputs, e.g. long_rollout and self_forcing_more, can then train at once on two GPUs)",
    )
    parser.add_argument("--long-multiple", type=int, default=8)
    parser.add_argument(
        "--switch-prob", type=float, default=None, help="the long-rollout student's prompt-switch share (config: 0.25)"
    )
    parser.add_argument(
        "--long-context-steps",
        choices=("exit", "full"),
        default=None,
        help="the long-rollout student's chunks before its judged window: stop at the exit step (config default, "
        "Self-Forcing's rule) or run every step (the sampler's context)",
    )
    parser.add_argument(
        "--long-critic-windows",
        type=int,
        default=None,
        help="windows of each long rollout the long-rollout student's critic learns from (config default 1; more "
        "need --switch-prob 0)",
    )
    parser.add_argument(
        "--long-validation-every",
        type=int,
        default=None,
        help="LongRollout's validation interval (default --validation-every; its runs are a few hundred iterations)",
    )
    parser.add_argument(
        "--long-update-every",
        type=int,
        default=None,
        help="the long-rollout student updates every N-th iteration, the critic every one (config default 5); with "
        "--long-critic-windows K the critic sees K * N windows per student update",
    )
    parser.add_argument(
        "--long-first-window-share",
        type=float,
        default=None,
        help="the share of the long-rollout student's windows drawn as the clip's first (config default 0: uniform "
        "over the rollout, the first once in (multiple - 1) * chunks + 1)",
    )
    parser.add_argument(
        "--adam-beta1",
        type=float,
        default=None,
        help="Adam beta1 of the student and the critic in Self-Forcing, LongRollout and the control (configs: 0.9; "
        "Self-Forcing's public recipe uses 0: no momentum in the two-player update)",
    )
    parser.add_argument(
        "--real-guidance",
        type=float,
        default=None,
        help="CFG scale of DMD's real score in Self-Forcing, LongRollout and the control (configs: 4.0, the teacher's "
        "sampling scale); a lower one tests whether the students' too bright / too big shapes (stats above the "
        "range) come from the guided target",
    )
    parser.add_argument(
        "--long-sink-frames",
        type=int,
        default=None,
        help="the long-rollout student trains with this many sink frames (config: one chunk); every student is then "
        "also streamed with them (--sink-frames-variant); 0 with --long-rope-anchor window is the long_sinks_rope_window "
        "variant's regime",
    )
    parser.add_argument(
        "--long-rope-anchor",
        choices=("absolute", "window"),
        default="window",
        help="where the long-rollout student's training rollouts put the text and the sinks once the window rolls "
        "(window: every student is then also streamed anchored, --rope-anchor both)",
    )
    parser.add_argument("--window-frames", type=int, default=None, help="cache window (latent frames); clip - chunk")
    parser.add_argument("--sink-frames", type=int, default=2)
    parser.add_argument(
        "--sink-frames-variant",
        type=int,
        default=None,
        help="stream the long run again with this many sink frames (e.g. 0), same seeds, scored the same way "
        "(report key long_sinks)",
    )
    parser.add_argument(
        "--kv-recache",
        choices=("off", "shift", "both"),
        default="off",
        help="stream the long run with the KV re-cache at every window shift: shift (instead of the plain run) or "
        "both (the plain run and a re-cached one, report key long_kv_recache)",
    )
    parser.add_argument(
        "--rope-anchor",
        choices=("absolute", "window", "both"),
        default="window",
        help="where the long run puts the text and sink frames once the window rolls: window (default, the sampling "
        "CLI's: at the window's start in RoPE time; the criteria judge it), absolute, or both (the "
        "criteria judge the absolute run, the anchored one on the same seeds is key long_rope_window)",
    )
    parser.add_argument(
        "--prompt-switch", action="store_true", help="score a prompt switch mid-stream (report key switch)"
    )
    parser.add_argument(
        "--switch-criterion-only",
        action="store_true",
        help="with --prompt-switch, stream only the switch runs a criterion judges (the re-cache and each "
        "--switch-renoise), not the old keys/values kept: about half the switch's time",
    )
    parser.add_argument(
        "--switch-sink-frames",
        type=int,
        default=None,
        help="with --prompt-switch, the re-cached switch again with this many sink frames (e.g. 0; report key "
        "switch.recache_sinks_N): whether the sinks, made under the old prompt, keep its colour in view",
    )
    parser.add_argument(
        "--switch-renoise",
        type=float,
        nargs="+",
        default=None,
        metavar="T",
        help="with --prompt-switch, the re-cached switch again per T with the kept window re-rendered under the new "
        "prompt from time T (StreamingGenerator(switch_renoise=T); report key switch.renoise_T)",
    )
    parser.add_argument(
        "--switch-only",
        action="store_true",
        help="score the prompt switch alone (implies --prompt-switch): no teacher sampling, no short or long runs; "
        "reuses the trained students in --out (trains nothing) and writes report_switch.json",
    )
    parser.add_argument(
        "--score",
        nargs="+",
        choices=DMD_STAGES,
        default=None,
        help="score only these students (default: every trained one; the teacher is always scored)",
    )
    parser.add_argument(
        "--validation-every",
        type=int,
        default=0,
        help="the DMD students validate every N steps at --long-multiple x the clip (the config's 12 captions): "
        "each window's colour / shape / direction / frame-statistics scores over training, in report.json's "
        "training.validation_window_min",
    )
    parser.add_argument(
        "--validation-prompts",
        type=int,
        default=None,
        help="validate on N of the 72 captions (spread over them; one batch) instead of the config's 12: a finer "
        "curve for --student-checkpoint best to choose by (at most 64)",
    )
    parser.add_argument(
        "--student-checkpoint",
        choices=("last", "best"),
        default="last",
        help="which checkpoint of each DMD student is scored (and, with --long-init self_forcing, started from): its "
        "last, or its best by --best-metric at the validations (needs --validation-every; a checkpoint is saved at "
        "each validation step, the best one is kept)",
    )
    parser.add_argument(
        "--best-metric",
        default="val/all_window_min",
        help="the validation score --student-checkpoint best chooses by (default: the lowest of the worst window's "
        "colour, shape, direction and frame-statistics scores)",
    )
    parser.add_argument(
        "--num-prompts", type=int, default=72, help="clips per evaluation; past the 72 captions they repeat, new seeds"
    )
    parser.add_argument(
        "--score-workers",
        type=int,
        default=min(8, os.cpu_count() or 1),
        help="processes that score the windows (~40 ms a window: 288 clips x 8 windows take ~90 s in one)",
    )
    parser.add_argument(
        "--save-long-clips",
        type=int,
        default=24,
        help="each student's first N long clips as mp4 in OUT/STUDENT/long_clips (0: none); 24 hold every direction",
    )
    parser.add_argument("--seed", type=int, default=424242, help="first sampling seed (prompt i uses seed + i)")
    parser.add_argument(
        "--resample-draws",
        type=int,
        default=2000,
        help="paired resamples of the prompts each criterion is judged again on (how stable a verdict is)",
    )
    parser.add_argument("--train-seed", type=int, default=0)
    parser.add_argument("--teacher-steps", type=int, default=30)
    parser.add_argument("--teacher-guidance", type=float, default=4.0)
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--launcher",
        choices=("torchrun", "in-process"),
        default="torchrun",
        help="how each stage trains: torchrun with one process (as on a GPU), or in this process (quicker smoke tests)",
    )
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny networks and clips, a few steps")
    parser.add_argument("--tiny-steps", type=int, default=2)
    args = parser.parse_args(argv)
    # every student is also streamed in the long-rollout student's training regime (same seeds), so that student is
    # scored where it trained and the others beside it
    if args.long_sink_frames is not None and args.long_sink_frames != args.sink_frames:
        if args.sink_frames_variant not in (None, args.long_sink_frames):
            parser.error("--sink-frames-variant must equal --long-sink-frames (the long-rollout student's regime)")
        args.sink_frames_variant = args.long_sink_frames
    if args.long_rope_anchor == "window" and args.rope_anchor == "absolute":
        args.rope_anchor = "both"
    if args.only_stage in ("long_rollout", CONTROL) and args.students == "self_forcing":
        parser.error(f"--students self_forcing trains no {args.only_stage} stage")
    if args.student_checkpoint == "best" and not args.validation_every:
        parser.error("--student-checkpoint best chooses by the validations: add --validation-every N")
    if args.validation_prompts is not None and not 1 <= args.validation_prompts <= 64:
        parser.error(f"--validation-prompts {args.validation_prompts}: between 1 and 64 (validation.max_prompts)")
    if args.adam_beta1 is not None and not 0 <= args.adam_beta1 < 1:
        parser.error(f"--adam-beta1 {args.adam_beta1}: in [0, 1)")
    args.stage_steps = stage_steps(parser, args.stage_steps, args.student_steps)
    if args.resample_draws < 1:
        parser.error(f"--resample-draws {args.resample_draws}: at least 1")
    if args.save_long_clips < 0:
        parser.error(f"--save-long-clips {args.save_long_clips}: a number of clips, 0 or more")
    if args.long_critic_windows is not None and args.long_critic_windows < 1:
        parser.error(f"--long-critic-windows {args.long_critic_windows}: at least 1")
    if (args.long_critic_windows or 1) > 1 and (args.switch_prob is None or args.switch_prob > 0):
        parser.error("--long-critic-windows > 1 needs --switch-prob 0 (the long-rollout config switches prompts)")
    if (args.long_critic_windows or 1) > 1 and args.long_context_steps == "full":
        parser.error("--long-critic-windows > 1 needs the exit-step context, not --long-context-steps full")
    if args.long_validation_every is not None and (args.long_validation_every < 1 or not args.validation_every):
        parser.error("--long-validation-every N: N >= 1, beside --validation-every (the Self-Forcing student's)")
    if args.long_update_every is not None and args.long_update_every < 1:
        parser.error(f"--long-update-every {args.long_update_every}: at least 1")
    if args.long_first_window_share is not None and not 0 <= args.long_first_window_share <= 1:
        parser.error(f"--long-first-window-share {args.long_first_window_share}: a share in [0, 1]")
    if args.teacher_gate is not None and args.teacher_ckpt:
        parser.error("--teacher-gate trains the teacher on: it does not combine with --teacher-ckpt")
    if args.teacher_gate is not None and not 0 < args.teacher_gate <= 1:
        parser.error(f"--teacher-gate {args.teacher_gate}: an accuracy in (0, 1]")
    if args.only_stage == "teacher" and args.teacher_ckpt:
        parser.error("--teacher-ckpt names a trained teacher: there is no teacher stage to train")
    if args.only_stage == CONTROL and args.long_init != "self_forcing":
        parser.error(f"--only-stage {CONTROL} is the control of --long-init self_forcing: add that flag")
    if args.students == "self_forcing" and args.stop_after == "long_rollout":
        parser.error("--students self_forcing trains no long-rollout student: stop after self_forcing")
    if args.switch_only:
        args.prompt_switch = True
    if args.switch_renoise is not None and not args.prompt_switch:
        parser.error("--switch-renoise varies the prompt switch: add --prompt-switch")
    if args.switch_criterion_only and not args.prompt_switch:
        parser.error("--switch-criterion-only trims the prompt switch: add --prompt-switch")
    if args.switch_criterion_only and args.switch_sink_frames is not None:
        parser.error("--switch-sink-frames adds a switch run no criterion judges: drop it or --switch-criterion-only")
    if args.switch_sink_frames is not None and not args.prompt_switch:
        parser.error("--switch-sink-frames varies the prompt switch: add --prompt-switch")
    if args.tiny:
        args.num_prompts, args.teacher_steps, args.long_multiple = (
            min(args.num_prompts, 4),
            2,
            min(args.long_multiple, 3),
        )
        args.score_workers = 1  # four clips: a spawned process costs more than it scores
    return args


def stage_steps(parser, given: list, student_steps: Optional[int]) -> dict:
    """``--stage-steps STAGE=N ...`` as ``{stage: N}``, with ``--student-steps`` for LongRollout and the control."""
    steps = {}
    for item in given:
        stage, _, count = item.partition("=")
        if stage not in TRAINED_STAGES or not count.isdigit() or int(count) < 1:
            parser.error(f"--stage-steps {item}: STAGE=N with N >= 1, STAGE one of {', '.join(TRAINED_STAGES)}")
        steps[stage] = int(count)
    if student_steps is not None:
        for stage in ("long_rollout", CONTROL):
            if stage in steps:
                parser.error(f"--stage-steps {stage}=... and --student-steps both set its steps: keep one")
            steps[stage] = student_steps
    return steps


def train_all(args) -> Optional[dict]:
    """Every stage's checkpoint, training what is missing; None after ``--stop-after``."""
    checkpoints = {"teacher": Path(args.teacher_ckpt) if args.teacher_ckpt else None}
    if checkpoints["teacher"] is None:
        checkpoints["teacher"] = train_or_reuse(
            args, "teacher", args.teacher_minutes, {}, args.stage_steps.get("teacher")
        )
    if args.stop_after == "teacher":
        return None
    teacher = checkpoints["teacher"]
    ode_inits = dict(student=teacher, teacher=teacher)
    checkpoints["ode"] = train_or_reuse(args, "ode", args.ode_minutes, ode_inits, args.stage_steps.get("ode"))
    if args.stop_after == "ode":
        return None
    for name in ("self_forcing", "long_rollout")[: 1 if args.students == "self_forcing" else 2]:
        # the same teacher and budget; the same init by default
        start = checkpoints["self_forcing"] if name == "long_rollout" and args.long_init == "self_forcing" else None
        inits = dict(student=start or checkpoints["ode"], teacher=teacher, critic=teacher)
        # LongRollout is not needed by the control (it starts from Self-Forcing) nor by an evaluation that does not
        # score it (a chain leaves out a student whose training failed: the evaluation must not train it instead)
        unneeded = args.only_stage == CONTROL or (args.score and name not in args.score)
        if not (name == "long_rollout" and unneeded):
            checkpoints[name] = train_or_reuse(args, name, args.student_minutes, inits, args.stage_steps.get(name))
        # the control, unless only other students are scored (an evaluation need not train it)
        if name == "long_rollout" and args.long_init == "self_forcing" and (not args.score or CONTROL in args.score):
            more = dict(student=checkpoints["self_forcing"], teacher=teacher, critic=teacher)
            steps = args.stage_steps.get(CONTROL)
            checkpoints[CONTROL] = train_or_reuse(args, CONTROL, args.student_minutes, more, steps)
        if args.stop_after == name:
            return None
    return checkpoints


class StageDone(Exception):
    """``--only-stage`` trained its stage: nothing else runs."""


def train_or_reuse(args, stage: str, minutes: float, inits: dict, steps: Optional[int] = None) -> Path:
    """``train``, except that under ``--only-stage`` every other stage must already have its checkpoint."""
    if args.only_stage not in (None, stage):
        done = last_checkpoint(Path(args.out) / stage)
        if done is None:
            print(f"--only-stage {args.only_stage}: stage {stage} has no checkpoint in {args.out}; train it first")
            raise SystemExit(2)
        return chosen_checkpoint(args, stage, done)
    path = train(args, stage, minutes, inits, steps)
    if stage == "teacher" and args.teacher_gate is not None:
        path = gate_teacher(args, path)
    if args.only_stage == stage:
        raise StageDone
    return chosen_checkpoint(args, stage, path)


GATE_SEED_OFFSET = 10**6  # the gate's seeds lie apart from the evaluation's: the teacher is not picked on them


def gate_teacher(args, ckpt: Path) -> Path:
    """``--teacher-gate ACC``: sample the held captions at the clip length (seeds apart from the evaluation's) and
    train the teacher on, ``--teacher-gate-minutes`` at a time, until colour, shape and direction all reach ACC or
    ``--teacher-gate-rounds`` extra rounds are spent. A teacher that has not learnt the motion yet (chain 9: direction
    0.615 after 5.5 minutes) makes every student below it copy its mistakes. Each check is kept in
    ``teacher/gate.json`` (the report shows it), with the step it chose: a teacher that stays below ACC is used anyway,
    and said so, at its best check (``best_gate_check``)."""
    from opensora.datasets.moving_shapes import all_captions
    from opensora.training.run_dir import checkpoint_step

    cfg, clip = teacher_config_and_clip(args)
    prompts = all_captions()[: args.num_prompts]
    seeds = [args.seed + GATE_SEED_OFFSET + i for i in range(len(prompts))]
    record = Path(args.out) / "teacher" / "gate.json"
    checks = json.loads(record.read_text())["checks"] if record.is_file() else []

    def write(**chosen):  # the checks so far, and the step chosen once the gate stops
        record.write_text(
            json.dumps(dict(gate=args.teacher_gate, seeds=[seeds[0], seeds[-1]], checks=checks, **chosen))
        )

    while True:
        if checks and checks[-1]["step"] == checkpoint_step(ckpt):  # checked already (a repeated call, a copied run)
            scores = checks[-1]
        else:
            _, videos = sample_teacher(args, cfg, ckpt, prompts, seeds, clip)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the trainer's next round gets the card back
            acc = accuracy(videos, prompts, args.motion, args.score_workers)
            scores = dict(ckpt=str(ckpt), step=checkpoint_step(ckpt), **{k: acc[k] for k in GATE_KEYS})
            checks.append(scores)
            write()
        passed = gate_passed(scores, args.teacher_gate)
        print(f"   teacher gate at step {scores['step']}: " + " ".join(f"{k} {scores[k]:.3f}" for k in GATE_KEYS)
              + (" (passed)" if passed else f" (below {args.teacher_gate})"), flush=True)  # fmt: skip
        more = None
        if not passed and len(checks) - 1 < args.teacher_gate_rounds:  # the first check came before any extra round
            more = train(args, "teacher", args.teacher_gate_minutes, {}, resume=True)
            if more == ckpt:  # no step was trained: stop rather than check the same weights again
                print("   teacher gate: the extra round trained no step", flush=True)
        if more is None or more == ckpt:  # the gate stops here and chooses (gated_teacher reuses the choice)
            write(chosen=best_gate_check(checks, args.teacher_gate, record.parent)["step"])
            return gated_teacher(record.parent, ckpt)
        ckpt = more


def trained_students(args) -> dict:
    """The students' final checkpoints in ``--out`` (``--switch-only``: nothing trains); exit 2 when none is there."""
    names = ("self_forcing",) if args.students == "self_forcing" else DMD_STAGES
    found = {name: chosen_checkpoint(args, name, last_checkpoint(Path(args.out) / name)) for name in names}
    found = {name: path for name, path in found.items() if path is not None and (not args.score or name in args.score)}
    if not found:
        print(f"--switch-only: no trained student in {args.out}; train them first")
        raise SystemExit(2)
    return found


def evaluate_switch_only(args, save=lambda report: None) -> dict:
    """``--switch-only``: each trained student's prompt switch (``student_switch``), and nothing else."""
    prompts, seeds, _, clip, report = evaluation_inputs(args)
    students = trained_students(args)
    report["pending"] = list(students)
    for name, ckpt in students.items():
        report[name] = dict(ckpt=str(ckpt), **student_switch(args, name, ckpt, prompts, seeds, clip))
        report["pending"].remove(name)
        save(report)
    del report["pending"]
    return report


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.switch_only:
        with kept_process_pool(args.score_workers):
            report = evaluate_switch_only(args, save=lambda partial: write_report(out / "report_switch.json", partial,
                                                                                  partial=True))  # fmt: skip
        write_report(out / "report_switch.json", report)
        print_switches(report, student_names(report))
        print(f"report: {out / 'report_switch.json'}")
        return report
    try:
        checkpoints = train_all(args)
    except StageDone:
        return {}
    if checkpoints is None:  # --stop-after
        return {}
    with kept_process_pool(args.score_workers):  # one pool of score workers for the dozen scorings that follow
        report = evaluate(
            args, checkpoints, save=lambda partial: write_report(out / "report.json", partial, partial=True)
        )
    write_report(out / "report.json", report)
    print_report(report, student_names(report))
    print(f"report: {out / 'report.json'}")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
    from opensora.parallel.process_group import release_process_group

    release_process_group(succeeded=True)  # the in-process stages' group, freed before the interpreter is torn down
