"""The algorithm-agnostic training loop.

config -> components (VAE, text conditioner) -> roles (boosted models, optimizers, schedulers, EMAs) -> method
-> data -> loop. Each micro-step the loop calls ``method.single_train_step(batch, iteration)`` and backwards
``loss_map["total_loss"]`` into every role whose optimizer steps this iteration (``_backward``); at the end of an
accumulation window it calls ``method.optimizers_schedulers_step`` and ``method.optimizers_zero_grad``. It never
looks at which method it runs.
"""

import logging
import time
from pathlib import Path
from typing import Dict, Optional

import torch
from mmengine.config import Config
from tqdm import tqdm

from opensora.config import save_config
from opensora.datasets.dataloader import build_dataloader
from opensora.dtypes import resolve_dtype
from opensora.parallel.sequence_parallel import SequenceParallelModel, build_sequence_groups
from opensora.registry import DATASETS, METHODS, MODELS, build_module
from opensora.role_config import role_configs
from opensora.roles import Components, Role
from opensora.training import checkpoint as ckpt
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
        if self.is_main:
            save_config(cfg, self.outputs)

        dtype = resolve_dtype(self.setting("precision"))
        vae = build_module(cfg.get("vae"), MODELS)
        text_encoder = build_module(cfg.get("text_encoder"), MODELS)
        vae = vae.to(self.device, dtype).eval().requires_grad_(False) if vae is not None else None
        text_encoder = text_encoder.to(self.device) if text_encoder is not None else None
        null_text = text_encoder.null_embeddings(1) if text_encoder is not None else None
        self.components = Components(
            vae=vae, text_encoder=text_encoder, device=self.device, dtype=dtype, null_text=null_text
        )

        self.roles: Dict[str, Role] = {
            name: build_role(name, role_cfg, self.components, cfg.plugin, self.is_main, self.max_steps)
            for name, role_cfg in role_cfgs.items()
        }
        self.method = build_module(cfg.method, METHODS, roles=self.roles, components=self.components)
        if self.sp is not None:
            self._split_sequences()
        # after boosting (colossalai's lazy imports draw from `random`): different noise on every data-parallel rank
        seed_everything(int(cfg.seed) + self.dp_rank)

        dataset = build_module(cfg.dataset, DATASETS)
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
        path = ckpt.resolve_resume_path(self.outputs, load=load, resume_auto=auto)
        if path is None:
            if auto and self.is_main:
                logger.info("--resume auto: no complete checkpoint in %s, starting fresh", self.outputs)
            # a fresh start must not append to the records of an earlier run (e.g. one that died before saving)
            self.metrics.truncate_after(self.step)
            return
        loaded = ckpt.load_checkpoint(path, self.roles)
        state = loaded.extra_state
        self.step = int(state["trainer"]["step"])
        self.nonfinite_total = int(state["trainer"].get("nonfinite_total", 0))
        self.loader.load_state_dict(state["data"])
        self.metrics.truncate_after(self.step)
        if self.is_main:
            logger.info("resumed from %s at step %d", path, self.step)

    def save(self) -> Path:
        trainer_state = dict(step=self.step, nonfinite_total=self.nonfinite_total)
        return ckpt.save_checkpoint(
            self.outputs,
            self.step,
            self.roles,
            extra_state=dict(trainer=trainer_state, data=self.loader.state_dict()),
            config_text=self.cfg.pretty_text,
            keep_last=int(self.setting("keep_last")),
        )

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

    def _step_verdict(self, losses, started: float) -> tuple:
        """(every rank's losses finite, time budget spent): one all-reduce and one host sync per step, after the
        backward kernels are queued. Every rank must agree on both, or ranks would disagree about stepping or
        stopping and deadlock; rank 0's clock decides the budget."""
        nonfinite = torch.stack([~torch.isfinite(loss.detach()).all() for loss in losses]).any().float()
        late = self.is_main and self.max_minutes is not None and time.monotonic() - started > 60.0 * self.max_minutes
        flags = torch.stack((nonfinite, torch.full_like(nonfinite, float(late))))  # a fill, not a host-to-device copy
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.SUM)
        nonfinite, late = flags.tolist()
        return nonfinite == 0, late > 0

    def _update_emas(self, iteration: int) -> None:
        for name in self.method.roles_to_update(iteration):
            role = self.roles[name]
            if role.ema is not None:
                role.wait_for_params()
                role.ema.update(role.unwrap(), step=self.step)

    def _fence_emas(self) -> None:
        for role in self.roles.values():
            if role.ema is not None:
                role.ema.fence()

    def train(self) -> None:
        """The loop. Per optimizer step the host waits for the GPU once (``_step_verdict``); the step's metrics are
        all-reduced on the device and read one step later (``_flush``), so no ``.item()`` stalls the next step."""
        progress = tqdm(
            total=self.max_steps, initial=self.step, disable=not self.is_main, desc="train", dynamic_ncols=True
        )
        batches = self._batches()
        started = time.monotonic()
        pending = None  # the previous step's metrics, still on the device
        out_of_time = False
        while self.step < self.max_steps and not out_of_time:
            iteration = self.step
            losses, loss_maps = [], []
            self.profiler.begin(self.step)
            self.throughput.start()
            for _ in range(self.grad_accum):
                batch = next(batches)
                loss_map, outputs = self.method.single_train_step(batch, iteration)
                # a non-finite loss is backwarded too and its window's gradients discarded below: no sync before
                # the backward
                self._backward(loss_map["total_loss"], iteration)
                losses.append(loss_map["total_loss"])
                loss_maps.append({k: v.detach().float() for k, v in loss_map.items()})
                self.throughput.add(outputs)
            finite, out_of_time = self._step_verdict(losses, started)
            if not finite:
                self._handle_nonfinite(iteration)
                continue
            self.nonfinite_in_a_row = 0
            self._fence_emas()  # the optimizers write the weights the previous step's overlapped EMA updates read
            grad_norms = self.method.optimizers_schedulers_step(iteration)
            self.method.optimizers_zero_grad(iteration)
            self.step += 1
            self._update_emas(iteration)
            timing = self.throughput.stop()
            self.profiler.end(self.step)
            self._flush(pending, progress)
            pending = self._pending_record(loss_maps, grad_norms, timing)
            if self.ckpt_every and self.step % self.ckpt_every == 0 and self.step < self.max_steps:
                pending = self._flush(pending, progress)  # records reach the disk before the checkpoint covering them
                self.save()
                self.throughput.restart()
            if self.validator is not None and self.validator.due(self.step):
                pending = self._flush(pending, progress)  # this step's record first, then its validation record
                self.validator.run(self.step)
                self.throughput.restart()
        if out_of_time and self.is_main:
            logger.info("max_minutes=%s reached at step %d: saving and stopping", self.max_minutes, self.step)
        self._flush(pending, progress)
        progress.close()
        if self.setting("save_at_end"):
            self.save()
        self.metrics.close()
        barrier()

    def _batches(self):
        """Endless iterator over epochs; the loader knows where a resumed run left off (and stops on an empty one)."""
        return self.loader.batches_forever()

    def _handle_nonfinite(self, iteration: int) -> None:
        self.method.optimizers_zero_grad(iteration)
        self.nonfinite_in_a_row += 1
        self.nonfinite_total += 1
        if self.is_main:
            logger.warning("non-finite loss at step %d: step skipped (%d in a row)", self.step, self.nonfinite_in_a_row)
        if self.nonfinite_in_a_row >= self.max_consecutive_nonfinite:
            raise NonFiniteLossError(
                f"{self.nonfinite_in_a_row} non-finite losses in a row at step {self.step}; stopping"
            )

    def _pending_record(self, loss_maps, grad_norms, timing) -> tuple:
        """This step's metrics with the losses averaged over micro-steps and ranks on the device (the all-reduce and
        a non-blocking copy to the host are queued now, read by ``_flush`` one step later without waiting for the
        steps queued since: ``HostCopy``); lr and grad norm per trainable role (plain ``lr`` /
        ``grad_norm`` when only one role trains, so single-model runs keep Open-Sora's names)."""
        keys = list(loss_maps[0])
        means = torch.stack([torch.stack([m[key] for m in loss_maps]).mean() for key in keys])
        record = {}
        trainable = [role for role in self.roles.values() if role.trainable]
        for role in trainable:
            suffix = "" if len(trainable) == 1 else f"/{role.name}"
            if role.lr_scheduler is not None:
                record["lr" + suffix] = role.lr_scheduler.get_last_lr()[0]
            if role.name in grad_norms:
                record["grad_norm" + suffix] = grad_norms[role.name]
        record["nonfinite_total"] = self.nonfinite_total
        record["skipped_samples"] = self.loader.num_skipped
        record["bad_files"] = len(self.loader.bad_paths)
        device_keys = [key for key, value in record.items() if torch.is_tensor(value)]
        on_host = HostCopy([all_reduce_mean(means)] + [record[key] for key in device_keys])
        return self.step, keys, device_keys, on_host, record, timing

    def _flush(self, pending, progress=None) -> None:
        """Write a pending record (``_pending_record``) to the metrics; returns ``None`` (nothing left pending)."""
        if pending is None:
            return None
        step, keys, device_keys, on_host, record, timing = pending
        losses, *device_values = on_host.values()
        values = dict(zip(("loss" if key == "total_loss" else key for key in keys), losses.tolist()))
        record = {**record, **{key: float(value) for key, value in zip(device_keys, device_values)}}
        record = {**values, **record, **timing.record()}
        self.metrics.log(step, record)
        if progress is not None:
            progress.update(step - progress.n)
            progress.set_postfix(loss=f"{record['loss']:.4f}")
        return None
