"""The algorithm-agnostic training loop.

config -> components (VAE, text conditioner) -> roles (boosted models, optimizers, schedulers, EMAs) -> method
-> data -> loop. Each micro-step the loop calls ``method.single_train_step(batch, iteration)`` and backwards
``loss_map["total_loss"]`` into every role whose optimizer steps this iteration (``_backward``); at the end of an
accumulation window it calls ``method.optimizers_step`` and ``method.optimizers_zero_grad``, and once the step is
known to count (its losses finite on every rank) ``method.schedulers_step``. It never looks at which method it runs.

A step whose loss is not finite on some rank is skipped: no weight, optimizer state, EMA or scheduler changes, and
the step counter does not move. Where every stepping optimizer can skip on the device (``Role.skips_on_device``) and
the method's step does not depend on the iteration, the loop never waits for the verdict before stepping: the
optimizer gets the all-reduced flag as ``found_inf`` and the host reads the verdict one step later, while the GPU
still holds the next step's forward and backward (``_settle``). Checkpoints, validation and the end of the run
settle first, so they see exactly what the synchronous check would have produced.
"""

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

import torch
from mmengine.config import Config
from tqdm import tqdm

from opensora.best_checkpoint import forget_after
from opensora.cli_errors import UserInputError
from opensora.config import ConfigValueError, save_config
from opensora.datasets.dataloader import build_dataloader
from opensora.dtypes import resolve_dtype
from opensora.parallel.sequence_parallel import SequenceParallelModel, build_sequence_groups
from opensora.registry import DATASETS, METHODS, build_module
from opensora.role_config import role_configs
from opensora.roles import Role
from opensora.training import checkpoint as ckpt
from opensora.training.compile_time import CompileLog
from opensora.training.components import build_components
from opensora.training.defaults import TRAINER_DEFAULTS
from opensora.training.distributed import all_reduce_mean, barrier, init_distributed
from opensora.training.host_copy import HostCopy
from opensora.training.metrics import MetricsLogger
from opensora.training.profiling import StepProfiler
from opensora.training.rng import seed_everything
from opensora.training.role_builder import build_role
from opensora.training.throughput import ThroughputMeter
from opensora.training.validation import Validator

logger = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    pass


NONFINITE_CHECKS = ("auto", "sync", "device")


@dataclass
class QueuedStep:
    """An optimizer step queued on the device, with what the host needs to finish it once its verdict is read."""

    iteration: int
    verdict: Any  # [any rank's loss non-finite, rank 0 past the time budget]: ``Trainer._verdict``
    metrics: HostCopy  # the losses averaged over micro-steps and ranks, then the device grad norms
    loss_keys: list
    grad_norms: dict  # role -> norm (float or device tensor; the tensors are read from ``metrics``)
    data_counts: dict  # the loader's skipped samples and bad files after this step's batches
    timing: Any  # a StepTiming
    weights_written: Optional[torch.cuda.Event]  # after the optimizer step: where an EMA update of it may start


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        role_cfgs = role_configs(cfg)  # config mistakes surface before anything is built
        self.rank, self.world_size, _, self.device = init_distributed()
        self.is_main = self.rank == 0
        # sequence parallelism: groups of `sp_size` consecutive ranks share each sample (same data, same noise)
        sp_size = int(self.setting("sequence_parallel_size"))
        self.sp = build_sequence_groups(sp_size) if sp_size != 1 else None
        self.dp_rank, self.dp_size = self.rank // sp_size, self.world_size // sp_size
        self.outputs = Path(self.setting("outputs"))
        self.max_steps = int(self.setting("max_steps"))
        self.grad_accum = int(self.setting("grad_accum"))
        self.ckpt_every = int(self.setting("ckpt_every"))
        self.max_consecutive_nonfinite = int(self.setting("max_consecutive_nonfinite"))
        # wall-clock budget (job time limits, fixed-time benchmarks): stop and save at the first step past it
        max_minutes = self.setting("max_minutes")
        self.max_minutes = None if max_minutes is None else float(max_minutes)
        seed_everything(int(cfg.seed))  # same initial weights on every rank

        dtype = resolve_dtype(self.setting("precision"))
        # the dataset first: one of precomputed features checks them against the config and spares the encoders
        dataset = build_module(cfg.dataset, DATASETS)
        self.components = build_components(cfg, self.device, dtype, dataset)

        self.roles: Dict[str, Role] = {
            name: build_role(name, role_cfg, self.components, cfg.plugin, self.is_main, self.max_steps)
            for name, role_cfg in role_cfgs.items()
        }
        self.method = build_module(cfg.method, METHODS, roles=self.roles, components=self.components)
        if self.sp is not None:
            self._split_sequences()
        # after boosting (colossalai's lazy imports draw from `random`): different noise on every data-parallel rank
        seed_everything(int(cfg.seed) + self.dp_rank)

        self.loader, _ = build_dataloader(  # the loader owns its sampler and its resumable state
            dataset,
            bucket_config=cfg.bucket_config,
            seed=int(cfg.seed),
            rank=self.dp_rank,
            world_size=self.dp_size,
            num_workers=int(self.setting("num_workers")),
            pin_memory=self.device.type == "cuda",
            prefetch_factor=int(self.setting("prefetch_factor")),
            persistent_workers=bool(self.setting("persistent_workers")),
        )
        self.metrics = MetricsLogger(
            self.outputs,
            enabled=self.is_main,
            tensorboard=self.setting("tensorboard"),
            wandb_cfg=self.setting("wandb"),
            run_config=cfg.to_dict(),
        )
        self.throughput = ThroughputMeter(self.device, world_size=self.dp_size, ranks_per_sample=sp_size)
        self.profiler = StepProfiler(self.setting("profile_steps"), self.outputs, self.rank, self.device)
        # samples during training (rank 0; other ranks meet it at the next collective): None when off
        self.validator = Validator.from_config(
            cfg, self.roles, self.components, self.metrics, self.outputs, is_main=self.is_main
        )
        self.step = 0
        self.nonfinite_in_a_row = 0
        self.nonfinite_total = 0
        self.compile_log = CompileLog()  # logs the seconds torch.compile took when a step compiled
        self.defer_check = self._choose_nonfinite_check()
        self.out_of_time = False
        self.preemption = None  # an ``opensora.training.preemption.Preemption`` (``requested``) set by the launcher
        self.preempted = False  # every rank agreed to stop at a stop signal (``_verdict``)
        self.stop_signal = 0  # its number (the largest one, where ranks got different signals)
        self.last_checkpoint: Optional[Path] = None
        self._records_started = False  # config.py and the metrics sinks: written once the start is settled

    def _choose_nonfinite_check(self) -> bool:
        """True: skip non-finite steps on the device and read the verdict a step late (see the module docstring)."""
        check = self.setting("nonfinite_check")
        if check not in NONFINITE_CHECKS:
            raise ConfigValueError(f"nonfinite_check={check!r}: expected one of {', '.join(NONFINITE_CHECKS)}")
        roles = [role for role in self.roles.values() if role.trainable and role.optimizer is not None]
        unsupported = [role.name for role in roles if not role.skips_on_device()]
        why = None
        if not self.method.same_step_every_iteration:
            why = f"method {type(self.method).__name__}'s step depends on the iteration"
        elif unsupported:
            why = f"the optimizers of roles {unsupported} cannot skip a step on the device (fused torch AdamW can)"
        if check == "device" and why is not None:
            raise ConfigValueError(f"nonfinite_check='device': {why}; use 'auto' or 'sync'")
        if self.is_main and check == "auto" and why is not None:
            logger.info("non-finite check before each optimizer step (one host wait per step): %s", why)
        return check != "sync" and why is None

    def setting(self, name: str):
        """Top-level config key ``name``, or its default from ``TRAINER_DEFAULTS``."""
        return self.cfg.get(name, TRAINER_DEFAULTS[name])

    def _split_sequences(self) -> None:
        for name, role in self.roles.items():
            module = role.unwrap()
            if not isinstance(module, SequenceParallelModel):
                raise ValueError(
                    f"sequence_parallel_size={self.sp.size}: role '{name}' ({type(module).__name__}) "
                    "is not a SequenceParallelModel"
                )
            module.set_sequence_parallel(self.sp)
        if self.is_main:
            logger.info(
                "sequence parallel: %d ranks per sample (roles %s), %d data-parallel ranks",
                self.sp.size,
                ", ".join(self.roles),
                self.dp_size,
            )

    # ---- checkpoints ----------------------------------------------------------------------------------------
    def resume(self, load: Optional[str] = None, auto: bool = False) -> None:
        """Resume from checkpoint directory ``load``, or with ``auto`` from the newest complete one in outputs."""
        self.resume_from(ckpt.resolve_resume_path(self.outputs, load=load, resume_auto=auto), auto)

    def resume_from(self, path: Optional[Path], auto: bool = False) -> None:
        """Resume from ``path``, a checkpoint ``checkpoint.resolve_resume_path`` chose and verified (None: fresh)."""
        if path is None:
            if auto and self.is_main:
                logger.info("--resume auto: no complete checkpoint in %s, starting fresh", self.outputs)
            self._start_records()
            return
        loaded = ckpt.load_checkpoint(path, self.roles)
        state = loaded.extra_state
        self.step = int(state["trainer"]["step"])
        if self.step >= self.max_steps:
            raise UserInputError(
                f"{path} is at step {self.step}, at or past --max-steps {self.max_steps}: nothing to train. "
                f"--max-steps counts all steps (not steps to add): pass --max-steps {self.step + self.max_steps} "
                f"to train {self.max_steps} more"
            )
        self.nonfinite_total = int(state["trainer"].get("nonfinite_total", 0))
        self.loader.load_state_dict(state["data"])
        self._start_records()
        if self.is_main:
            logger.info("resumed from %s at step %d", path, self.step)

    def _start_records(self) -> None:
        """Write the run's config and open its metrics, once the checkpoint it continues from has loaded (a refused
        resume leaves the run directory as it was). A fresh start drops records of an earlier run past its step."""
        if self.is_main and not self._records_started:
            save_config(self.cfg, self.outputs)
        self._records_started = True
        self.metrics.truncate_after(self.step)
        if self.is_main:  # the best-checkpoint record (validation.best_metric) forgets the steps trained again
            forget_after(self.outputs, self.step)

    def save(self) -> Path:
        trainer_state = dict(step=self.step, nonfinite_total=self.nonfinite_total)
        path = ckpt.save_checkpoint(
            self.outputs,
            self.step,
            self.roles,
            extra_state=dict(trainer=trainer_state, data=self.loader.state_dict()),
            config_text=self.cfg.pretty_text,
            keep_last=int(self.setting("keep_last")),
        )
        self.last_checkpoint = path
        return path

    # ---- the loop -------------------------------------------------------------------------------------------
    def _updating_roles(self, iteration: int) -> list:
        optimizers = self.method.get_optimizers(iteration)
        return [next(r for r in self.roles.values() if r.optimizer is opt) for opt in optimizers]

    def _backward(self, loss: torch.Tensor, iteration: int) -> None:
        """Backward ``loss`` into every role whose optimizer steps this iteration.

        One role: through its booster. Several (a sum of per-role losses): through each role's
        optimizer with ``inputs`` restricted to that role's parameters, so every ZeRO optimizer reduces exactly
        its own gradients (a single ``loss.backward()`` would leave the others' buckets unreduced).
        """
        scaled = loss / self.grad_accum
        roles = self._updating_roles(iteration)
        if len(roles) == 1:
            roles[0].booster.backward(scaled, roles[0].optimizer)
            return
        for position, role in enumerate(roles):
            params = [p for p in role.model.parameters() if p.requires_grad]
            role.optimizer.backward(scaled, inputs=params, retain_graph=position < len(roles) - 1)

    def _verdict(self, losses, started: float) -> tuple:
        """(flags, verdict): flags = [any rank's losses non-finite, rank 0 past the time budget, any rank got a stop
        signal] as 0/1 on the device, all-reduced with MAX after the backward kernels are queued; the verdict is their host copy, queued
        now and read a step later (deferred check), or the values read at once (the one host wait of a step). Every
        rank must agree on both, or ranks would disagree about stepping or stopping and deadlock; rank 0's clock
        decides the budget."""
        nonfinite = torch.stack([~torch.isfinite(loss.detach()).all() for loss in losses]).any().float()
        late = self.is_main and self.max_minutes is not None and time.monotonic() - started > 60.0 * self.max_minutes
        stop = 0 if self.preemption is None else self.preemption.signal_number  # which signal: rank 0 names it
        # fills, not host-to-device copies
        flags = torch.stack(
            (nonfinite, torch.full_like(nonfinite, float(late)), torch.full_like(nonfinite, float(stop)))
        )
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        return flags, HostCopy([flags]) if self.defer_check else flags.tolist()

    def _read_verdict(self, verdict) -> bool:
        """Whether the step's losses were finite everywhere (``verdict`` from ``_verdict``); notes a spent time
        budget."""
        nonfinite, late, stop = verdict.values()[0].tolist() if isinstance(verdict, HostCopy) else verdict
        self.out_of_time = self.out_of_time or late > 0
        if stop > 0 and not self.preempted:
            self.preempted, self.stop_signal = True, int(stop)
        return nonfinite == 0

    def _update_emas(self, iteration: int, after: Optional[torch.cuda.Event]) -> None:
        for name in self.method.roles_to_update(iteration):
            role = self.roles[name]
            if role.ema is not None:
                role.wait_for_params()
                # ZeRO's fp32 masters where the EMA can read them (exact weights, no cast pass), else the weights
                masters = role.ema.masters_of(role.optimizer)
                role.ema.update(role.unwrap(), step=self.step, after=after, values=masters)

    def _fence_emas(self) -> None:
        for role in self.roles.values():
            if role.ema is not None:
                role.ema.fence()

    def train(self) -> None:
        """The loop. The host never waits for the GPU inside a step where the non-finite check is deferred (else
        once per step, before the optimizer step); metrics are all-reduced on the device and read one step later
        (``_flush``), so no ``.item()`` stalls the next step."""
        if not self._records_started:
            self._start_records()
        progress = tqdm(
            total=self.max_steps, initial=self.step, disable=not self.is_main, desc="train", dynamic_ncols=True
        )
        try:
            self._loop(progress)
        finally:
            progress.close()  # ends the bar's line, so an error message starts on a line of its own

    def _loop(self, progress) -> None:
        batches = self._batches()
        started = time.monotonic()
        first_step = self.step  # a resumed run that trains no step validates nothing at its end
        self._pending = None  # the previous step's metrics, still on the device
        self.out_of_time = False
        queued = None  # the last step queued whose verdict is not read yet (deferred check only)
        while self.step + (queued is not None) < self.max_steps and not (self.out_of_time or self.preempted):
            iteration = self.step + (queued is not None)  # assumes the queued step counts: the method ignores it
            losses, loss_maps = [], []
            self.profiler.begin(iteration)
            self.throughput.start()
            for _ in range(self.grad_accum):
                batch = next(batches)
                loss_map, outputs = self.method.single_train_step(batch, iteration)
                # a non-finite loss is backwarded too and its window's gradients discarded: no sync before the backward
                self._backward(loss_map["total_loss"], iteration)
                losses.append(loss_map["total_loss"])
                loss_maps.append({k: v.detach().float() for k, v in loss_map.items()})
                self.throughput.add(outputs)
            flags, verdict = self._verdict(losses, started)
            if queued is not None:  # the GPU still holds this step's forward and backward: it does not drain here
                self._settle(queued, progress)
                queued = None
            if not self.defer_check and not self._read_verdict(verdict):
                self.method.optimizers_zero_grad(iteration)
                self._skipped()
                continue
            self._fence_emas()  # the optimizers write the weights the previous step's overlapped EMA updates read
            grad_norms = self.method.optimizers_step(iteration, found_inf=flags[0] if self.defer_check else None)
            self.method.optimizers_zero_grad(iteration)
            this_step = self._queued_step(iteration, verdict, loss_maps, grad_norms, self.throughput.stop())
            self.profiler.end(iteration + 1)
            if self.defer_check and not self._settles_now(iteration + 1):
                queued = this_step
                continue
            if self._settle(this_step, progress):
                self._after_step(progress)
        if queued is not None:
            self._settle(queued, progress)
        if self.out_of_time and self.is_main:
            logger.info("max_minutes=%s reached at step %d: saving and stopping", self.max_minutes, self.step)
        self._pending = self._flush(self._pending, progress)
        progress.close()
        saved_now = self.last_checkpoint is not None and self.last_checkpoint.name == f"step-{self.step:07d}"
        if (self.setting("save_at_end") or self.preempted) and not saved_now:
            self.save()
        if self.step > first_step and not self.preempted and self.validator is not None:
            if self.validator.due_at_end(self.step):  # after the save: best.json may name this step's checkpoint
                self.validator.run(self.step)
        self.metrics.close()
        barrier()

    def _settles_now(self, count: int) -> bool:
        """Whether a step that would be the ``count``-th must be settled before the loop goes on: a checkpoint,
        a validation or the end of the run comes after it. (Validation is due on rank 0 only: ranks may settle a step
        at different points, which is safe because settling issues no collective.)"""
        return (
            count >= self.max_steps
            or (self.ckpt_every and count % self.ckpt_every == 0)
            or (self.validator is not None and self.validator.due(count))
        )

    def _queued_step(self, iteration, verdict, loss_maps, grad_norms, timing) -> QueuedStep:
        """A just-queued optimizer step: its losses averaged over micro-steps and ranks on the device (the all-reduce
        and a non-blocking copy to the host are queued now; ``HostCopy``), and what the host finishes it with."""
        keys = list(loss_maps[0])
        means = torch.stack([torch.stack([m[key] for m in loss_maps]).mean() for key in keys])
        device_norms = [grad_norms[name] for name in self._trainable_names() if torch.is_tensor(grad_norms.get(name))]
        weights_written = None
        if self.defer_check and any(role.ema is not None for role in self.roles.values()) and means.is_cuda:
            weights_written = torch.cuda.Event()
            weights_written.record()
        return QueuedStep(
            iteration=iteration,
            verdict=verdict,
            metrics=HostCopy([all_reduce_mean(means)] + device_norms),
            loss_keys=keys,
            grad_norms=grad_norms,
            data_counts=dict(skipped_samples=self.loader.num_skipped, bad_files=len(self.loader.bad_paths)),
            timing=timing,
            weights_written=weights_written,
        )

    def _settle(self, step: QueuedStep, progress) -> bool:
        """Finish a queued step on the host once its verdict is read: a finite one counts (scheduler, step counter,
        EMA, metrics), a non-finite one was a no-op on the device and is counted as skipped. Returns whether it
        counted."""
        if self.defer_check and not self._read_verdict(step.verdict):  # (the synchronous check read it already)
            self._skipped()
            return False
        self.nonfinite_in_a_row = 0
        self.method.schedulers_step(step.iteration)
        self.step += 1
        self._update_emas(step.iteration, after=step.weights_written)
        self._pending = self._flush(self._pending, progress)
        self._pending = (self.step, step, self._host_record(step.grad_norms))
        return True

    def _after_step(self, progress) -> None:
        """Checkpoint and validation after a counted step that was settled at once."""
        if self.ckpt_every and self.step % self.ckpt_every == 0 and self.step < self.max_steps:
            self._pending = self._flush(self._pending, progress)  # records reach the disk before the checkpoint
            self.save()
            self.throughput.restart()
        if self.validator is not None and self.validator.due(self.step):
            self._pending = self._flush(self._pending, progress)  # this step's record first, then its validation
            self.validator.run(self.step)
            self.throughput.restart()

    def _batches(self):
        """Endless iterator over epochs; the loader knows where a resumed run left off (and stops on an empty one)."""
        return self.loader.batches_forever()

    def _skipped(self) -> None:
        """Count a skipped step; stop the run after ``max_consecutive_nonfinite`` in a row."""
        self.nonfinite_in_a_row += 1
        self.nonfinite_total += 1
        if self.is_main:
            logger.warning("non-finite loss at step %d: step skipped (%d in a row)", self.step, self.nonfinite_in_a_row)
        if self.nonfinite_in_a_row >= self.max_consecutive_nonfinite:
            raise NonFiniteLossError(
                f"{self.nonfinite_in_a_row} non-finite losses in a row at step {self.step}; stopping"
            )

    def _trainable_names(self) -> list:
        return [name for name, role in self.roles.items() if role.trainable]

    def _host_record(self, grad_norms: dict) -> dict:
        """A counted step's record as far as the host knows it: lr (after its scheduler step) and grad norm per
        trainable role (plain ``lr`` / ``grad_norm`` when only one role trains, so single-model runs keep Open-Sora's
        names; a device norm stays a tensor until ``_flush``), and the skip count."""
        record = {}
        names = self._trainable_names()
        for name in names:
            suffix = "" if len(names) == 1 else f"/{name}"
            scheduler = self.roles[name].lr_scheduler
            if scheduler is not None:
                record["lr" + suffix] = scheduler.get_last_lr()[0]
            if name in grad_norms:
                record["grad_norm" + suffix] = grad_norms[name]
        record["nonfinite_total"] = self.nonfinite_total
        return record

    def _flush(self, pending, progress=None) -> None:
        """Write a pending record (``_settle``) to the metrics; returns ``None`` (nothing left pending)."""
        if pending is None:
            return None
        count, step, record = pending
        losses, *device_norms = step.metrics.values()
        values = dict(zip(("loss" if key == "total_loss" else key for key in step.loss_keys), losses.tolist()))
        device_keys = [key for key, value in record.items() if torch.is_tensor(value)]  # in ``_queued_step``'s order
        record = {**record, **{key: float(value) for key, value in zip(device_keys, device_norms)}}
        record = {**values, **record, **step.data_counts, **step.timing.record()}
        self.metrics.log(count, record)
        if self.is_main:  # what compiled blocks cost at start-up, and any later recompile
            self.compile_log.after_step(count, record.get("step_time", 0.0))
        if progress is not None:
            progress.update(count - progress.n)
            progress.set_postfix(loss=f"{record['loss']:.4f}")
        return None
