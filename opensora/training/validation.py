"""Validation samples during training: a fixed prompt set sampled with a role's EMA weights every N steps.

Config (keys and defaults: ``opensora.training.defaults.VALIDATION_DEFAULTS``)::

    validation = dict(every=500, prompts=["a red circle moving left", ...], score="moving_shapes")

Every ``every`` optimizer steps rank 0

* refreshes a private copy of the role's network (built once from the role's config -- a deep copy when the trained
  network was wrapped after building, e.g. LoRA -- on the training device, in the training dtype, eval mode, no
  grad) with the live weights and then the role's EMA weights (the live weights
  when the role keeps no EMA), and samples the prompts through ``VideoSampler`` (the sampler, same
  timestep shift as the training method) with per-sample seeds; a causal network streams them chunk by chunk
  (``validation_windows.streaming_generator``: the config's sampling keys, as ``--streaming`` samples it);
* writes ``{outputs}/samples/step-XXXXXXX/NNNN_slug.mp4``, ``samples.csv`` (``path,text``, as the inference CLI
  writes it: ``tools/eval_moving_shapes.py`` reads it) and ``validation.json`` (settings, time, scores);
* logs a frame grid (one row per sample) and, where tensorboard can encode video (moviepy), the videos to
  tensorboard; the grid and the mp4s to wandb when it is enabled;
* with ``score="moving_shapes"`` scores the uint8 frames in memory with ``opensora.eval.moving_shapes`` under the
  ``motion`` rule (the validation's, else the dataset's: a wrap clip is read on the torus, as the benchmarks read it;
  ``moving_shapes_windows.score_clips``), before mp4 compression, so numbers can differ slightly from scoring the
  files, and logs ``val/color_acc``,
  ``val/shape_acc``, ``val/direction_acc``, ``val/all_acc`` (with ``long_frames``: long clips scored per window,
  ``val/*_window_min``, see ``opensora.training.validation_windows``); always ``val/seconds`` and ``val/num_samples``
  (``metrics.jsonl``: a separate record with the same ``step``; tensorboard tags ``val/...``);
* with ``best_metric`` (a score it logs) notes that score in ``{outputs}/best.json``, which names the best step's
  checkpoint (the trainer's own, saved just before; ``opensora.best_checkpoint``);
* with ``at_end`` (default) also validates the step a run ends on when ``every`` does not divide it (``max_minutes``
  or ``max_steps`` reached), after the checkpoint saved there, so the best checkpoint is chosen among every
  checkpointed validation, the last included (a time-limited run shorter than ``every`` is validated once). Not
  after a preemption, which must exit quickly.

No effect on training: the live network is only read, every RNG stream (python, numpy, torch CPU, the current CUDA
device) is saved before and restored after, and validation saves no checkpoint itself, so losses are bit-identical
with and without validation and resume stays exact (``tests/test_validation.py``). A validation that fails (e.g. out
of memory) is logged with its traceback and skipped; training goes on.

Other ranks skip validation and block in the next step's first collective until rank 0 catches up; there is no
barrier. (Where the role's EMA is sharded over the ranks, every rank first takes part in gathering it to rank 0.)
That wait must stay well inside the process-group timeout (30 min, ``init_distributed``): validation stops starting
new batches once ``max_seconds`` (default 300 s) are spent, so it lasts at most ``max_seconds`` plus one batch, and a
config may list at most ``max_prompts`` prompts.
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

import numpy as np
import torch

from opensora.config import ConfigKeyError, ConfigValueError
from opensora.training.defaults import VALIDATION_DEFAULTS
from opensora.training.rng import get_rng_state, set_rng_state

logger = logging.getLogger(__name__)

SCORERS = (None, "moving_shapes")
CLIP_SCORES = ("color", "shape", "direction", "all")  # val/{name}_acc of the clip-length samples
GRID_FRAMES = 8  # frames per sample in the logged grid (evenly spaced)


# ---- settings (pure; checked on every rank before anything is built) ------------------------------------------
def validation_settings(cfg: Mapping) -> Optional[Dict[str, Any]]:
    """The resolved ``validation`` settings of ``cfg``, or None when validation is off. Raises ``ConfigKeyError``
    for an unknown key (naming the nearest) and ``ConfigValueError`` for a bad value."""
    given = cfg.get("validation")
    if given is None:
        return None
    if not isinstance(given, Mapping):
        raise ConfigValueError(f"validation must be a dict, got {type(given).__name__}")
    for key in given:
        if key not in VALIDATION_DEFAULTS:
            near = difflib.get_close_matches(key, VALIDATION_DEFAULTS, n=1)
            hint = f"; did you mean 'validation.{near[0]}'" if near else ""
            raise ConfigKeyError(f"unknown key 'validation.{key}'{hint} (keys: {list(VALIDATION_DEFAULTS)})")
    s = {**VALIDATION_DEFAULTS, **dict(given)}
    if not s["every"]:
        return None
    if int(s["every"]) != s["every"] or s["every"] < 0:
        raise ConfigValueError(f"validation.every must be a whole number >= 0, got {s['every']!r}")
    s["every"] = int(s["every"])
    if s["prompts"] is None and s["prompt_file"] is None:
        raise ConfigValueError("validation needs validation.prompts (a list) or validation.prompt_file")
    if s["prompt_file"] is not None:  # replaces the prompts (so --validation.prompt_file F works on any config)
        from opensora.inference.prompts import read_prompt_file

        prompts = read_prompt_file(s["prompt_file"])
    else:
        prompts = [s["prompts"]] if isinstance(s["prompts"], str) else list(s["prompts"])
    if not prompts or not all(isinstance(p, str) and p.strip() for p in prompts):
        raise ConfigValueError("validation prompts must be non-empty strings")
    if len(prompts) > int(s["max_prompts"]):
        raise ConfigValueError(
            f"validation lists {len(prompts)} prompts, more than validation.max_prompts="
            f"{s['max_prompts']}: rank 0 would keep the other ranks waiting too long"
        )
    s["prompts"] = prompts
    if s["seeds"] is None:
        s["seeds"] = [int(s["seed"]) + i for i in range(len(prompts))]
    elif len(s["seeds"]) != len(prompts):
        raise ConfigValueError(f"validation.seeds lists {len(s['seeds'])} seeds for {len(prompts)} prompts")
    s["seeds"] = [int(x) for x in s["seeds"]]
    if s["score"] not in SCORERS:
        raise ConfigValueError(f"validation.score must be one of {SCORERS}, got {s['score']!r}")
    if float(s["max_seconds"]) <= 0 or int(s["batch_size"]) < 1:
        raise ConfigValueError("validation.max_seconds must be > 0 and validation.batch_size >= 1")

    from opensora.role_config import role_configs

    roles = role_configs(cfg)
    # which network the config samples: validation.role, else the config's own sampling role (distillation configs set
    # ``role`` for the inference script too); a config with one network samples that one
    role = s["role"] or cfg.get("role") or (next(iter(roles)) if len(roles) == 1 else None)
    if role is None:
        raise ConfigValueError(
            f"validation needs the role to sample: this config trains {sorted(roles)}; set validation.role "
            "(or the config's top-level role)"
        )
    if role not in roles:
        raise ConfigValueError(f"validation.role {role!r} is not a role of this config; roles: {sorted(roles)}")
    s["role"] = role
    # sampling settings: the validation dict, else the config's own sampling keys (distillation configs carry them)
    # a few-step student samples on the step list its method trains it for (else the config's sampling step_list)
    method_steps = (cfg.get("method") or {}).get("step_list")
    for steps in (method_steps, cfg.get("step_list")):
        if s["step_list"] is None:
            s["step_list"] = steps
    if s["step_list"] is not None:
        s["step_list"] = [float(t) for t in s["step_list"]]
    s["num_steps"] = int(s["num_steps"] or cfg.get("num_steps") or 20)
    if s["guidance_scale"] is None:
        s["guidance_scale"] = cfg.get("guidance_scale") or (1.0 if s["step_list"] is not None else 4.0)
    s["guidance_scale"] = float(s["guidance_scale"])
    if s["resolution"] is None or s["num_frames"] is None:
        buckets = cfg.get("bucket_config") or {}
        if not buckets:
            raise ConfigValueError("validation needs resolution and num_frames (the config has no bucket_config)")
        from opensora.datasets.buckets import first_bucket

        first_res, first_frames = first_bucket(buckets)
        s["resolution"] = s["resolution"] or first_res
        s["num_frames"] = s["num_frames"] or first_frames
    s["num_frames"] = int(s["num_frames"])
    # the motion rule clips are scored by: the validation's, else the dataset's (a wrap or bounce dataset)
    s["motion"] = s["motion"] or (cfg.get("dataset") or {}).get("motion") or "linear"
    from opensora.datasets.moving_shapes import MOTIONS
    from opensora.training.validation_windows import long_clip_settings

    if s["motion"] not in MOTIONS:
        raise ConfigValueError(f"validation.motion must be one of {list(MOTIONS)}, got {s['motion']!r}")
    return best_metric_settings(long_clip_settings(s), cfg)


def scored_metrics(s: Mapping) -> List[str]:
    """The scores a validation with resolved settings ``s`` logs (what ``best_metric`` may name)."""
    if s["score"] != "moving_shapes":
        return []
    names = [f"val/{a}_acc" for a in CLIP_SCORES]
    if s["long_frames"] is not None:
        from opensora.training.validation_windows import ATTRIBUTES, WINDOW_KINDS

        names += [f"val/{a}_{kind}" for kind in WINDOW_KINDS for a in ATTRIBUTES]
        names.append("val/all_window_min")
    return names


def best_metric_settings(s: dict, cfg: Mapping) -> dict:
    """Check ``best_metric``: a score this validation logs, at steps that have a checkpoint to keep."""
    if s["best_metric"] is None:
        return s
    names = scored_metrics(s)
    if s["best_metric"] not in names:
        near = difflib.get_close_matches(str(s["best_metric"]), names, n=1)
        hint = f"; did you mean {near[0]!r}" if near else ""
        listed = names or "none: set validation.score='moving_shapes'"
        raise ConfigValueError(
            f"validation.best_metric {s['best_metric']!r} is not a score this validation logs{hint} (scores: {listed})"
        )
    from opensora.training.defaults import TRAINER_DEFAULTS

    if not cfg.get("save_at_end", TRAINER_DEFAULTS["save_at_end"]):
        raise ConfigValueError(
            "validation.best_metric keeps the best step's checkpoint; save_at_end=False saves none at the last step"
        )
    ckpt_every = int(cfg.get("ckpt_every", TRAINER_DEFAULTS["ckpt_every"]) or 0)
    if ckpt_every <= 0 or s["every"] % ckpt_every:
        raise ConfigValueError(
            f"validation.best_metric keeps the checkpoint of the best validation step: validation.every "
            f"({s['every']}) must be a multiple of ckpt_every ({ckpt_every}); set ckpt_every={s['every']}"
        )
    return s


def frame_grid(videos: np.ndarray, frames: int = GRID_FRAMES) -> np.ndarray:
    """uint8 ``[N, T, H, W, 3]`` -> one uint8 ``[N*H, k*W, 3]`` image: a row per sample, ``k`` evenly spaced frames."""
    n, t, h, w, c = videos.shape
    picks = np.unique(np.linspace(0, t - 1, num=min(frames, t)).round().astype(int))
    rows = videos[:, picks]  # [N, k, H, W, 3]
    return rows.transpose(0, 2, 1, 3, 4).reshape(n * h, len(picks) * w, c)


# ---- the hook the trainer calls ----------------------------------------------------------------------------------
class Validator:
    """Built on every rank (so config errors surface everywhere); samples only where ``is_main``.

    Args:
        settings: ``validation_settings(cfg)``.
        cfg: the run's config (the role's network config and the method's timestep shift are read from it).
        roles: the trainer's roles (only ``roles[settings["role"]]`` is read: its unwrapped network and EMA).
        components: the frozen VAE and text conditioner (shared with training; both are deterministic).
        metrics: the trainer's ``MetricsLogger``.
        outputs: the run directory.
    """

    def __init__(self, settings: Mapping, cfg: Mapping, roles: Mapping, components, metrics, outputs, is_main: bool):
        self.settings = dict(settings)
        self.every = self.settings["every"]
        self.cfg = cfg
        self.role = roles[self.settings["role"]]
        self.components = components
        self.metrics = metrics
        self.outputs = Path(outputs)
        self.is_main = is_main
        self._network = None  # the private copy, built at the first validation
        self._ema_weights = None  # a sharded EMA's whole tensors, gathered at the start of a validation

    @classmethod
    def from_config(cls, cfg, roles, components, metrics, outputs, is_main: bool) -> Optional["Validator"]:
        settings = validation_settings(cfg)
        return None if settings is None else cls(settings, cfg, roles, components, metrics, outputs, is_main)

    def _gathers(self) -> bool:
        """Whether the role's EMA is sharded over the ranks, so that every rank takes part in each validation."""
        return bool(getattr(self.role.ema, "collective", False))

    def _takes_part(self) -> bool:
        """Rank 0 validates; the other ranks join only to gather a sharded EMA."""
        return self.is_main or self._gathers()

    def due(self, step: int) -> bool:
        return self._takes_part() and step % self.every == 0

    def due_at_end(self, step: int) -> bool:
        """Whether the run's last step (``step``, checkpointed) still needs its validation (``at_end``)."""
        return bool(self.settings["at_end"]) and step % self.every != 0 and self._takes_part()

    def run(self, step: int) -> Optional[dict]:
        """Sample, write, score and log for ``step``; returns the logged record (None off rank 0). A sharded EMA is
        gathered to rank 0 first, on every rank, before anything that could fail on rank 0 alone."""
        try:
            self._ema_weights = self.role.ema.gathered() if self._gathers() else None
        except Exception:  # rank 0 only (host memory), after every rank's last gather: training goes on
            logger.exception("validation at step %d: gathering the EMA failed; skipped", step)
            self._ema_weights = None
            return None
        if not self.is_main:
            return None
        started = time.monotonic()
        rng = get_rng_state()
        try:
            with torch.no_grad():
                videos, prompts, seeds = self._sample(started)
            record = self._write_and_log(step, videos, prompts, seeds, started)
        except Exception:  # e.g. out of memory: a failed validation must not end (or hang) a long training run
            logger.exception("validation at step %d failed; training goes on", step)
            self._network = None  # rebuilt next time (frees its memory now)
            self._ema_weights = None
            return None
        finally:
            set_rng_state(rng)
        logger.info(
            "validation at step %d: %d samples in %.1f s%s",
            step,
            len(prompts),
            record["val/seconds"],
            # the long clips' worst windows too: a log is sometimes all a cut run brings back
            "".join(f", {k} {v:.3f}" for k, v in record.items() if k.endswith(("_acc", "_window_min"))),
        )
        return record

    # ---- sampling ----------------------------------------------------------------------------------------------
    def _refreshed_network(self) -> torch.nn.Module:
        """The private copy with the role's current EMA weights (its live weights when it keeps no EMA)."""
        live = self.role.unwrap()
        if self._network is None:
            from opensora.inference.sampler import role_model_config
            from opensora.registry import MODELS, build_module

            first = next(live.parameters())
            # built under the saved RNG state (``run``): its random init draws are undone there
            network = build_module(role_model_config(self.cfg, self.settings["role"]), MODELS)
            if set(network.state_dict()) != set(live.state_dict()):
                # the trained network was wrapped after building (e.g. LoRA adapters): copy it as it is (under
                # no_grad and with requires_grad off, the copied parameters' training hooks never fire)
                network = copy.deepcopy(live)
            self._network = network.to(first.device, first.dtype).eval().requires_grad_(False)
        self.role.wait_for_params()
        self._network.load_state_dict(live.state_dict(), strict=True)
        if self._ema_weights is not None:
            # the trainable weights; the rest keep the live values loaded above
            unexpected = self._network.load_state_dict(self._ema_weights, strict=False).unexpected_keys
            self._ema_weights = None
            if unexpected:
                raise KeyError(f"EMA weights the validation network lacks: {unexpected[:5]}")
        elif self.role.ema is not None and self.role.ema.enabled:
            self.role.ema.copy_to(self._network)
        return self._network

    def _sample(self, started: float):
        from opensora.inference.sampler import VideoSampler, video_size_for

        s = self.settings
        sampler = VideoSampler(
            self._refreshed_network(),
            self.components.vae,
            self.components.text_encoder,
            shift=(self.cfg.get("method") or {}).get("shift") or {},
            progress=False,
        )
        height, width = video_size_for(s["resolution"], s["aspect_ratio"])
        from opensora.training.validation_windows import streaming_generator

        # a causal network streams chunk by chunk, as it trains and as users sample it (--streaming); sampled whole,
        # a Self-Forcing student scored direction 0.58-0.92 where streamed it scored 1.00 (one H200 run)
        stream = streaming_generator(sampler, s, self.cfg, height, width)
        self._sampler, self._stream, self._size = sampler, stream, (height, width)  # the long clips reuse them
        prompts, seeds, batch = s["prompts"], s["seeds"], int(s["batch_size"])
        videos = []
        for start in range(0, len(prompts), batch):
            if start and time.monotonic() - started > float(s["max_seconds"]):
                logger.warning(
                    "validation: max_seconds=%s spent after %d of %d samples; the rest are skipped",
                    s["max_seconds"],
                    start,
                    len(prompts),
                )
                prompts, seeds = prompts[:start], seeds[:start]
                break
            some_prompts, some_seeds = prompts[start : start + batch], seeds[start : start + batch]
            if stream is not None:
                videos.append(stream.generate(some_prompts, some_seeds, s["num_frames"], height, width))
                continue
            videos.append(
                sampler.generate(
                    some_prompts,
                    some_seeds,
                    num_frames=s["num_frames"],
                    height=height,
                    width=width,
                    num_steps=s["num_steps"],
                    step_list=s["step_list"],
                    guidance_scale=s["guidance_scale"],
                )
            )
        return torch.cat(videos).numpy(), list(prompts), list(seeds)

    # ---- outputs -----------------------------------------------------------------------------------------------
    def _write_and_log(
        self, step: int, videos: np.ndarray, prompts: List[str], seeds: List[int], started: float
    ) -> dict:
        from opensora.inference.io import save_samples

        s = self.settings
        save_dir = self.outputs / "samples" / f"step-{step:07d}"
        paths = save_samples(save_dir, prompts, videos, fps=s["fps"])
        rows = [dict(path=path.name, text=prompt) for path, prompt in zip(paths, prompts)]
        record: Dict[str, float] = {}
        report = None
        if s["score"] == "moving_shapes":  # under the run's motion rule (a wrap clip may cross an edge)
            from opensora.eval.moving_shapes_windows import score_clips

            report = score_clips(videos, [row["text"] for row in rows], s["motion"], [row["path"] for row in rows])
            record.update({f"val/{a}_acc": getattr(report, f"{a}_acc") for a in CLIP_SCORES})
        if s["long_frames"]:  # per-window scores of long clips (drift past the training length)
            from opensora.training.validation_windows import long_clip_record

            args = (self._sampler, self._stream, s, prompts, seeds, *self._size, save_dir, started)
            record.update(long_clip_record(*args))
        record["val/num_samples"] = len(prompts)
        record["val/seconds"] = time.monotonic() - started  # sampling, writing and scoring
        settings = {k: s[k] for k in ("role", "num_frames", "resolution", "num_steps", "step_list", "guidance_scale")}
        summary = dict(
            step=step,
            **settings,
            seeds=seeds,
            ema=self.role.ema is not None,
            metrics=record,
            rows=report.rows if report is not None else rows,
        )
        (save_dir / "validation.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
        self.metrics.log(step, record, prefix="")
        self.metrics.log_samples(step, frame_grid(videos), videos, paths, prompts, fps=s["fps"])
        self._note_best(step, record)
        return record

    # ---- the best checkpoint (``validation.best_metric``) ---------------------------------------------------------
    def _note_best(self, step: int, record: Mapping[str, float]) -> None:
        metric = self.settings["best_metric"]
        value = record.get(metric) if metric is not None else None
        if value is None or not np.isfinite(value):  # off, or not scored this time (no windows)
            return
        wanted = len(self.settings["prompts"])
        cut = record.get("val/num_samples", wanted) < wanted or record.get("val/long_samples", wanted) < wanted
        if cut:  # max_seconds cut it short: a score over other (fewer) prompts does not compete with full ones
            logger.warning("validation at step %d sampled fewer prompts than listed: not a best candidate", step)
            return
        from opensora.best_checkpoint import note_value

        best = note_value(self.outputs, metric, step, value)["best"]
        logger.info("best checkpoint by %s: step %d (%.4f)", metric, best["step"], best["value"])
