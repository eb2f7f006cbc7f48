"""The algorithm-agnostic training loop.

config -> components (VAE, text conditioner) -> roles (boosted models, optimizers, schedulers, EMAs) -> method
-> data -> loop. Each micro-step the loop calls ``method.single_train_step(batch, iteration)`` and backwards
``loss_map["total_loss"]`` through the booster owning the first optimizer of the iteration; at the end of an
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
from opensora.registry import DATASETS, METHODS, MODELS, build_module
from opensora.training import checkpoint as ckpt
from opensora.training.distributed import all_reduce_mean, barrier, init_distributed
from opensora.training.metrics import MetricsLogger
from opensora.training.profiling import StepProfiler
from opensora.models.mmdit.sequence_parallel import build_sequence_groups
from opensora.training.rng import seed_everything
from opensora.dtypes import resolve_dtype
from opensora.training.roles import Components, Role, build_role
from opensora.training.throughput import ThroughputMeter

logger = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    pass


def role_configs(cfg: Config) -> Dict[str, dict]:
    """``cfg.models`` (distillation), or the single Open-Sora-style ``model`` role built from top-level keys."""
    if cfg.get("models"):
        return {name: dict(role) for name, role in cfg.models.items()}
    optimizer = dict(cfg.get("optimizer", {}))
    optimizer.setdefault("lr", cfg.lr)
    ema = None
    if cfg.get("ema_decay") is not None:
        ema = dict(decay=cfg.ema_decay, start_step=cfg.get("ema_start_step", 0), warmup=cfg.get("ema_warmup", True))
    return {
        "model": dict(
            model=cfg.model,
            trainable=True,
            precision=cfg.get("precision", "bf16"),
            optimizer=optimizer,
            warmup_steps=cfg.get("warmup_steps", 0),
            grad_clip=cfg.get("grad_clip"),
            ema=ema,
        )
    }


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.rank, self.world_size, _, self.device = init_distributed()
        self.is_main = self.rank == 0
        # sequence parallelism: groups of `sp_size` consecutive ranks share each sample (same data, same noise)
        sp_size = int(cfg.get("sequence_parallel_size", 1))
        self.sp = build_sequence_groups(sp_size) if sp_size != 1 else None
        self.dp_rank, self.dp_size = self.rank // sp_size, self.world_size // sp_size
        self.outputs = Path(cfg.outputs)
        self.max_steps = int(cfg.max_steps)
        self.grad_accum = int(cfg.get("grad_accum", 1))
        self.ckpt_every = int(cfg.get("ckpt_every", 0))
        self.max_consecutive_nonfinite = int(cfg.get("max_consecutive_nonfinite", 5))
        # wall-clock budget (job time limits, fixed-time benchmarks): stop and save at the first step past it
        self.max_minutes = cfg.get("max_minutes")
        seed_everything(int(cfg.seed))  # same initial weights on every rank
        if self.is_main:
            save_config(cfg, self.outputs)

        dtype = resolve_dtype(cfg.get("precision", "bf16"))
        vae = build_module(cfg.get("vae"), MODELS)
        text_encoder = build_module(cfg.get("text_encoder"), MODELS)
        vae = vae.to(self.device, dtype).eval().requires_grad_(False) if vae is not None else None
        text_encoder = text_encoder.to(self.device) if text_encoder is not None else None
        null_text = text_encoder.null_embeddings(1) if text_encoder is not None else None
        self.components = Components(vae=vae, text_encoder=text_encoder, device=self.device, dtype=dtype,
                                     null_text=null_text)

        self.roles: Dict[str, Role] = {
            name: build_role(name, role_cfg, self.components, cfg.plugin, self.is_main)
            for name, role_cfg in role_configs(cfg).items()
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
            num_workers=int(cfg.get("num_workers", 2)),
            pin_memory=self.device.type == "cuda",
        )
        self.metrics = MetricsLogger(self.outputs, enabled=self.is_main, tensorboard=cfg.get("tensorboard", True),
                                     wandb_cfg=cfg.get("wandb"), run_config=cfg.to_dict())
        self.throughput = ThroughputMeter(self.device, world_size=self.dp_size, ranks_per_sample=sp_size)
        self.profiler = StepProfiler(cfg.get("profile_steps"), self.outputs, self.rank, self.device)
        self.step = 0
        self.nonfinite_in_a_row = 0
        self.nonfinite_total = 0

    def _split_sequences(self) -> None:
        for name, role in self.roles.items():
            module = role.unwrap()
            if not hasattr(module, "set_sequence_parallel"):
                raise ValueError(f"sequence_parallel_size={self.sp.size}: role '{name}' ({type(module).__name__}) "
                                 "has no set_sequence_parallel")  # fmt: skip
            module.set_sequence_parallel(self.sp)
        if self.is_main:
            logger.info("sequence parallel: %d ranks per sample (roles %s), %d data-parallel ranks", self.sp.size,
                        ", ".join(self.roles), self.dp_size)

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
            self.outputs, self.step, self.roles,
            extra_state=dict(trainer=trainer_state, data=self.loader.state_dict()),
            config_text=self.cfg.pretty_text, keep_last=int(self.cfg.get("keep_last", 3)),
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

    def _all_finite(self, loss: torch.Tensor) -> bool:
        # every rank must agree, or ranks would disagree about stepping and deadlock
        bad = all_reduce_mean(torch.tensor(0.0 if torch.isfinite(loss).all() else 1.0, device=self.device))
        return bad.item() == 0.0

    def _update_emas(self, iteration: int) -> None:
        for name in self.method.roles_to_update(iteration):
            role = self.roles[name]
            if role.ema is not None:
                role.wait_for_params()
                role.ema.update(role.unwrap(), step=self.step)

    def train(self) -> None:
        progress = tqdm(total=self.max_steps, initial=self.step, disable=not self.is_main, desc="train",
                        dynamic_ncols=True)
        batches = self._batches()
        started = time.monotonic()
        while self.step < self.max_steps and not self._out_of_time(started):
            iteration = self.step
            loss_maps, skipped = [], False
            self.profiler.begin(self.step)
            self.throughput.start()
            for _ in range(self.grad_accum):
                batch = next(batches)
                loss_map, outputs = self.method.single_train_step(batch, iteration)
                loss = loss_map["total_loss"]
                if not self._all_finite(loss):
                    skipped = True
                    break
                self._backward(loss, iteration)
                loss_maps.append({k: v.detach().float() for k, v in loss_map.items()})
                self.throughput.add(outputs)
            if skipped:
                self._handle_nonfinite(iteration)
                continue
            self.nonfinite_in_a_row = 0
            grad_norms = self.method.optimizers_schedulers_step(iteration)
            self.method.optimizers_zero_grad(iteration)
            self.step += 1
            self._update_emas(iteration)
            self.profiler.end(self.step)
            record = self._record(loss_maps, grad_norms)
            self.metrics.log(self.step, record)
            progress.update(1)
            progress.set_postfix(loss=f"{record['loss']:.4f}")
            if self.ckpt_every and self.step % self.ckpt_every == 0 and self.step < self.max_steps:
                self.save()
        progress.close()
        if self.cfg.get("save_at_end", True):
            self.save()
        self.metrics.close()
        barrier()

    def _out_of_time(self, started: float) -> bool:
        if self.max_minutes is None:
            return False
        # rank 0's clock decides, so every rank stops at the same step
        late = float(time.monotonic() - started > 60.0 * float(self.max_minutes)) if self.is_main else 0.0
        if all_reduce_mean(torch.tensor(late, device=self.device)).item() > 0:
            if self.is_main:
                logger.info("max_minutes=%s reached at step %d: saving and stopping", self.max_minutes, self.step)
            return True
        return False

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

    def _record(self, loss_maps, grad_norms) -> dict:
        """One metrics record: losses averaged over micro-steps and ranks, lr and grad norm per trainable role
        (plain ``lr`` / ``grad_norm`` when only one role trains, so single-model runs keep Open-Sora's names)."""
        record = {}
        for key in loss_maps[0]:
            value = all_reduce_mean(torch.stack([m[key] for m in loss_maps]).mean()).item()
            record["loss" if key == "total_loss" else key] = value
        trainable = [role for role in self.roles.values() if role.trainable]
        for role in trainable:
            suffix = "" if len(trainable) == 1 else f"/{role.name}"
            if role.lr_scheduler is not None:
                record["lr" + suffix] = role.lr_scheduler.get_last_lr()[0]
            if role.name in grad_norms:
                record["grad_norm" + suffix] = grad_norms[role.name]
        record.update(self.throughput.stop())
        record["nonfinite_total"] = self.nonfinite_total
        record["skipped_samples"] = self.loader.num_skipped
        record["bad_files"] = len(self.loader.bad_paths)
        return record
