"""Atomic, resumable step checkpoints written through the Booster.

One directory per trainable role (``model`` for plain training; ``student``, ``critic``... for
distillation). Layout of one checkpoint, ``{outputs}/checkpoints/step-{step:07d}/`` (names, marker and
newest-checkpoint lookup: ``opensora.checkpoint_layout``, shared with inference and the converter)::

    {role}/model/          booster.save_model(shard=True, safetensors)       all ranks take part
    {role}/optimizer/      booster.save_optimizer(shard=True)                all ranks take part
    {role}/lr_scheduler.pt booster.save_lr_scheduler                         (if a scheduler is given)
    {role}/ema.safetensors EMA weights, whole, written by rank 0 (a sharded  (if an EMA is given)
                           EMA gathers its pieces from every rank first)
    {role}/arch.json       the network's keyword arguments as JSON, rank 0   (if the model records ``arch``)
    {role}/master/rank{r}.pt fp32 master weights held by rank r's optimizer  (bf16/fp16 training only)
    {role}/lora.json       a LoRA role (``opensora.lora``): settings, init_from, base sha256, rank 0; such a role
    {role}/adapter.safetensors  saves only its adapter (rank 0) instead of model/; optimizer/, master/ and the
                           EMA then hold the adapter's state only (the optimizer never sees the frozen base)
    extra_state.pt         caller's dict (sampler state, {step, epoch, ...}), rank 0, tensors/plain types
    rng/rank{r}.pt         python/numpy/torch(/cuda) RNG state of every rank r
    config.py              the resolved config text, for people to read      (if given; never executed on load)
    meta.json              step, world size, time
    manifest.json          size and CRC-32 of every file above (``opensora.checkpoint_manifest``)
    COMPLETE               completion marker, written last

Every rank writes into a hidden sibling ``.tmp-step-{step:07d}``; after a barrier rank 0 writes the marker and
renames the directory into place (``os.replace`` is atomic on one filesystem), so a crash mid-save leaves the
previous checkpoint untouched and only a tmp directory behind, which the next save removes.
Everything is loadable with ``torch.load(weights_only=True)``, and every load here is weights-only, ColossalAI's
included (``opensora.safe_load``); a checkpoint is checked against its manifest before anything is loaded.

Why ``master/``: ColossalAI's checkpoint IO rebuilds the optimizer's fp32 master weights from the saved
bf16/fp16 model weights on load, which rounds them, so a resumed bf16 run drifts from the uninterrupted one.
Saving each rank's master shards and copying them back makes the resume exact (same world size only; with a
different world size the rounded masters are kept and a warning says so).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from opensora.best_checkpoint import best_step
from opensora.checkpoint_layout import (
    ADAPTER_FILE,
    COMPLETE_MARKER,
    CONFIG_FILE,
    EMA_FILE,
    LORA_FILE,
    META_FILE,
    MODEL_DIR,
    TMP_PREFIX,
    checkpoint_dir,
    checkpoint_root,
    find_latest_checkpoint,  # noqa: F401  (re-exported: callers and tests find the newest checkpoint here)
    is_complete,
    list_checkpoints,
)
from opensora.checkpoint_manifest import DamagedCheckpointError, verify_checkpoint, write_manifest
from opensora.safe_load import load_tensors, weights_only_loads

from .checkpoint_checks import any_rank_failed, check_model_fits, is_write_failure, save_failure
from .distributed import barrier, broadcast_object, get_rank, get_world_size
from .rng import get_rng_state, set_rng_state

logger = logging.getLogger(__name__)


def _remove_leftover_tmp_dirs(root: Path) -> None:
    if root.is_dir():
        for child in root.iterdir():
            if child.name.startswith(TMP_PREFIX) and child.is_dir():
                shutil.rmtree(child, ignore_errors=True)


def _sizes_match(path: Path) -> bool:
    try:
        verify_checkpoint(path, quiet=True)
        return True
    except DamagedCheckpointError:
        return False


def prune_checkpoints(outputs: str | Path, keep_last: int, spare: Path | None = None) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints; returns the deleted paths. A damaged checkpoint
    (its files differ in size from its manifest) neither counts as kept nor is deleted: it stays for its owner to
    inspect, and the intact older ones it would have pushed out stay too. The run's best checkpoint by its
    validation metric (``opensora.best_checkpoint``) is kept as well, outside the count. ``spare``, the checkpoint
    just saved, counts as the newest whatever its step: a run resumed from an earlier step leaves later checkpoints
    of its old course on disk, and those go first."""
    if keep_last is None or keep_last <= 0:
        return []
    best = best_step(outputs)
    intact = [path for step, path in list_checkpoints(outputs) if step != best and _sizes_match(path)]
    if spare is not None and Path(spare) in intact:
        intact = [path for path in intact if path != Path(spare)] + [Path(spare)]
    doomed = intact[:-keep_last]
    for path in doomed:
        # Rename first so a crash mid-delete never leaves a half-deleted dir that still looks complete.
        trash = path.with_name(f"{TMP_PREFIX}delete-{path.name}")
        os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
    return doomed


def _gemini_master_chunks(model) -> list[torch.Tensor] | None:
    """This rank's fp32 master chunks of a GeminiDDP model (None for any other model).

    Gemini keeps the fp32 masters in chunks of its own, not in the optimizer (HybridAdam sees empty stand-ins
    outside a step), and its model checkpoint stores them cast to bf16: a resume would restart the masters from
    bf16-rounded values. Saving each rank's chunk payloads (its shards, or whole chunks where kept gathered) and
    writing them back after the load keeps the resume exact; bf16(master) is what the load put in the working
    weights, so those stay consistent."""
    manager, fp32_params = getattr(model, "chunk_manager", None), getattr(model, "fp32_params", None)
    if manager is None or not fp32_params or not getattr(manager, "reuse_fp16_chunk", False):
        return None
    return [chunk.payload for chunk in manager.get_chunks(fp32_params)]


def _master_params(model, optimizer) -> list[torch.Tensor]:
    """The optimizer's own (master) parameters, when training keeps them apart from low-precision weights."""
    from .ema import unwrap_model

    gemini = _gemini_master_chunks(model)
    if gemini is not None:
        return gemini
    inner = getattr(optimizer, "optim", None)
    low_precision = any(p.is_floating_point() and p.dtype != torch.float32 for p in unwrap_model(model).parameters())
    if inner is None or not low_precision:
        return []
    return [p for group in inner.param_groups for p in group["params"]]


def _save_master_params(model, optimizer, directory: Path, rank: int) -> None:
    masters = _master_params(model, optimizer)
    if masters:
        torch.save([p.detach().cpu() for p in masters], directory / f"rank{rank}.pt")


def _load_master_params(model, optimizer, directory: Path, rank: int, saved_world_size: int) -> None:
    masters = _master_params(model, optimizer)
    path = directory / f"rank{rank}.pt"
    if not masters or not directory.is_dir():
        return
    if saved_world_size != get_world_size() or not path.is_file():
        warnings.warn(
            f"fp32 master weights were saved with world size {saved_world_size}, now "
            f"{get_world_size()}: rebuilding them from the low-precision model weights"
        )
        return
    saved = load_tensors(path)
    if len(saved) != len(masters) or any(a.shape != b.shape for a, b in zip(saved, masters)):
        raise RuntimeError(f"{path} does not match this optimizer's master parameters (model or plugin changed?)")
    with torch.no_grad():
        for master, value in zip(masters, saved):
            master.copy_(value)


def _publish(tmp: Path, final: Path, meta: dict) -> None:
    """Rank 0: mark ``tmp`` complete and move it to ``final`` (replacing an older save of the same step)."""
    (tmp / COMPLETE_MARKER).write_text(json.dumps(meta) + "\n")
    if final.exists():
        old = final.with_name(f"{TMP_PREFIX}old-{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def _trained_roles(roles: Mapping[str, Any]) -> dict[str, Any]:
    """Roles with a booster (the trainable ones); frozen roles are rebuilt from their config, never saved."""
    return {name: role for name, role in roles.items() if getattr(role, "booster", None) is not None}


def _materialise_adam_state(optimizer) -> None:
    """Give every parameter of a torch Adam/AdamW the state its first step would create (zeros, step 0).

    ColossalAI's ZeRO checkpoint IO indexes the optimizer state by parameter and raises ``KeyError`` for a
    parameter that has none: one that never received a gradient, or any parameter before the first step. The
    zeros are exactly what Adam creates lazily, so training is unchanged and resume stays exact.
    """
    inner = getattr(optimizer, "optim", optimizer)
    if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
        return
    for group in inner.param_groups:
        on_device = group.get("fused") or group.get("capturable")
        for param in group["params"]:
            if inner.state.get(param):
                continue
            state = {
                "step": torch.zeros((), dtype=torch.float32, device=param.device if on_device else "cpu"),
                "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
            }
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            inner.state[param] = state


def place_adam_steps(optimizer) -> None:
    """After loading an Adam state: keep each group's ``fused`` / ``foreach`` as this run built them, and put fused
    / capturable Adam's ``step`` counters on their parameter's device as fp32 tensors, where torch keeps them (its
    kernels refuse host counters). ColossalAI's ZeRO loader (``load_states_into_optimizer``) moves every state
    tensor to the parameter's device except ``step``, which stays on the host."""
    inner = getattr(optimizer, "optim", optimizer)
    if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
        return
    for group in inner.param_groups:
        # the loaders replace the groups with the saved ones: keep the implementation this run built (a checkpoint
        # saved with foreach would otherwise turn fused off for good, and a fused optimizer's AMP-scaling flag
        # stays set while the groups say foreach, which GradScaler's fp16 path then trips over)
        for key in ("fused", "foreach"):
            if key in inner.defaults:
                group[key] = inner.defaults[key]
        if not (group.get("fused") or group.get("capturable")):
            continue
        for param in group["params"]:
            step = inner.state.get(param, {}).get("step")
            if torch.is_tensor(step) and (step.device != param.device or step.dtype != torch.float32):
                inner.state[param]["step"] = step.to(device=param.device, dtype=torch.float32)


def _save_adapter(role, directory: Path, rank: int) -> None:
    """A LoRA role's adapter and its lora.json (rank 0; the adapter is replicated on every rank)."""
    from safetensors.torch import save_file

    from opensora.lora import adapter_state_dict, record_to_json

    if rank == 0:
        save_file(adapter_state_dict(role.unwrap()), str(directory / ADAPTER_FILE))
        (directory / LORA_FILE).write_text(record_to_json(role.lora) + "\n")


def _load_adapter(name: str, role, directory: Path) -> None:
    """Check lora.json against the role (same settings, same base weights) and copy the adapter in."""
    from safetensors.torch import load_file

    from opensora.cli_errors import UserInputError
    from opensora.lora import LORA_KEYS, check_same_base, load_adapter_state_dict, record_from_json

    record_file = directory / LORA_FILE
    if not record_file.is_file():
        raise UserInputError(
            f"role '{name}' trains a LoRA adapter but {directory} holds full weights (no "
            f"{LORA_FILE}); start from it with init_from instead of --load/--resume"
        )
    saved = record_from_json(record_file.read_text(), str(record_file))
    changed = [key for key in LORA_KEYS if saved.get(key) != role.lora[key]]
    if changed:
        raise UserInputError(
            f"role '{name}': the checkpoint's LoRA settings differ from the config in {changed} "
            f"(saved {[saved.get(k) for k in changed]}, config {[role.lora[k] for k in changed]})"
        )
    check_same_base(
        saved, role.lora["base_sha256"], f"role '{name}' in {directory}", base_name=role.lora["init_from"]["path"]
    )
    load_adapter_state_dict(role.unwrap(), load_file(str(directory / ADAPTER_FILE)), str(directory / ADAPTER_FILE))
    update_masters = getattr(role.model, "update_master_params", None)  # LowLevelZero: refresh its fp32 masters
    if update_masters is not None:
        update_masters()


def _save_role(role, directory: Path, rank: int, size_per_shard_mb: int, ema_whole: dict | None = None) -> None:
    booster, model, optimizer = role.booster, role.model, role.optimizer
    if getattr(role, "lora", None) is not None:
        _save_adapter(role, directory, rank)
    else:
        booster.save_model(
            model, str(directory / MODEL_DIR), shard=True, use_safetensors=True, size_per_shard=size_per_shard_mb
        )
    if optimizer is not None:
        _materialise_adam_state(optimizer)
        booster.save_optimizer(optimizer, str(directory / "optimizer"), shard=True, size_per_shard=size_per_shard_mb)
        _save_master_params(model, optimizer, directory / "master", rank)
    if role.lr_scheduler is not None:
        booster.save_lr_scheduler(role.lr_scheduler, str(directory / "lr_scheduler.pt"))
    if rank == 0 and ema_whole is not None:  # a sharded EMA, gathered before any rank wrote
        role.ema.write(directory / EMA_FILE, ema_whole)
    elif rank == 0 and role.ema is not None:
        role.ema.save(directory / EMA_FILE)
    arch = getattr(role.unwrap(), "arch", None) if hasattr(role, "unwrap") else None
    if rank == 0 and isinstance(arch, dict):  # the architecture as JSON: reading a checkpoint never runs its config
        from opensora.convert.arch import ARCH_FILE, arch_to_json

        (directory / ARCH_FILE).write_text(arch_to_json(arch) + "\n")


def save_checkpoint(
    outputs: str | Path,
    step: int,
    roles: Mapping[str, Any],
    extra_state: dict[str, Any] | None = None,
    config_text: str | None = None,
    keep_last: int | None = None,
    size_per_shard_mb: int = 1024,
) -> Path:
    """Write checkpoint ``step`` atomically; every rank must call it. Returns the final directory.

    ``roles`` maps role names to objects with ``booster, model, optimizer, lr_scheduler, ema`` attributes
    (``opensora.roles.Role``); each trainable role is saved under its own sub-directory, frozen roles
    (no booster) are skipped. ``extra_state`` (rank 0's copy is saved) holds tensors and plain python types only,
    e.g. ``{"trainer": {"step": 6}, "data": loader.state_dict()}``. ``keep_last`` > 0 deletes older complete
    checkpoints afterwards.
    """
    rank, world_size = get_rank(), get_world_size()
    root = checkpoint_root(outputs)
    final = checkpoint_dir(outputs, step)
    tmp = root / f"{TMP_PREFIX}{final.name}"
    trained = _trained_roles(roles)

    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        _remove_leftover_tmp_dirs(root)  # debris of a crashed save (ours or an earlier run's)
        tmp.mkdir()
        (tmp / "rng").mkdir()
        for name in trained:
            (tmp / name / "master").mkdir(parents=True)
    barrier()

    # sharded EMAs gather to rank 0 on every rank first: after a write that only some ranks do (their masters, rank
    # 0's scheduler), a failed one sends its rank to ``any_rank_failed`` while the others would wait in a gather
    ema_whole = {name: role.ema.gathered() for name, role in trained.items() if getattr(role.ema, "collective", False)}
    error = None
    try:
        for name, role in trained.items():
            _save_role(role, tmp / name, rank, size_per_shard_mb, ema_whole.get(name))
        torch.save(get_rng_state(), tmp / "rng" / f"rank{rank}.pt")
        if rank == 0:
            torch.save(dict(extra_state or {}), tmp / "extra_state.pt")
            if config_text is not None:
                (tmp / CONFIG_FILE).write_text(config_text)
    except Exception as failed:  # disk full, quota, permissions...: every rank stops, the tmp dir goes at once
        error = failed
    if any_rank_failed(error):  # a collective: also the barrier that ends the writing phase
        failure = save_failure(tmp, final, error or OSError("another rank failed to write its part"))
        if error is not None and not is_write_failure(error):
            raise error  # not an IO problem: keep the original error (the tmp dir is gone already)
        raise failure from error

    meta = {
        "step": int(step),
        "world_size": world_size,
        "roles": sorted(trained),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    error = None
    if rank == 0:
        try:
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
            write_manifest(tmp)  # after every other file, before the marker
            _publish(tmp, final, meta)
        except OSError as failed:
            error = failed
        else:
            prune_checkpoints(outputs, keep_last, spare=final)
    if any_rank_failed(error):  # a collective: also the barrier that ends the save on every rank
        raise save_failure(tmp, final, error or OSError("rank 0 failed to finish the checkpoint")) from error
    return final


@dataclass
class LoadedState:
    """What ``load_checkpoint`` hands back besides the restored roles."""

    path: Path
    step: int
    extra_state: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


def _load_role(name: str, role, directory: Path, saved_world_size: int, load_optimizer: bool) -> None:
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint has no role '{name}' (expected {directory})")
    booster, model, optimizer = role.booster, role.model, role.optimizer
    if role.ema is not None:
        role.ema.fence()  # the weights written below may still be read by an overlapped EMA update
    if getattr(role, "lora", None) is not None:
        _load_adapter(name, role, directory)
    else:
        check_model_fits(
            directory / MODEL_DIR, role.unwrap() if hasattr(role, "unwrap") else model, f"'{name}' network"
        )
        booster.load_model(model, str(directory / MODEL_DIR))
    if load_optimizer and optimizer is not None:
        booster.load_optimizer(optimizer, str(directory / "optimizer"))
        place_adam_steps(optimizer)
        _load_master_params(model, optimizer, directory / "master", get_rank(), saved_world_size)
    if load_optimizer and role.lr_scheduler is not None:
        scheduler_file = directory / "lr_scheduler.pt"
        if not scheduler_file.is_file():
            raise FileNotFoundError(f"{scheduler_file} missing: role '{name}' was saved without a scheduler")
        booster.load_lr_scheduler(role.lr_scheduler, str(scheduler_file))
    ema_file = directory / EMA_FILE
    if role.ema is not None and ema_file.is_file():
        role.ema.load(ema_file)
    elif role.ema is not None and get_rank() == 0:
        warnings.warn(f"{directory} has no EMA weights; role '{name}' keeps its freshly copied EMA")


def load_checkpoint(
    path: str | Path,
    roles: Mapping[str, Any],
    restore_rng: bool = True,
    load_optimizer: bool = True,
) -> LoadedState:
    """Restore a complete checkpoint into boosted roles; every rank must call it.

    Each trainable role's model/optimizer/scheduler go through its ``booster.load_*``; its EMA (if any) is filled
    on rank 0; this rank's RNG state is restored (``restore_rng``). ``load_optimizer=False`` loads weights only
    (fine-tuning from a checkpoint).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    if not is_complete(path):
        raise RuntimeError(f"checkpoint {path} has no {COMPLETE_MARKER} marker: it is an interrupted save")
    verify_checkpoint(path, quiet=True)  # sizes, every rank (a stat per file); checksums: rank 0 in resolve_resume_path
    meta = json.loads((path / META_FILE).read_text())
    with weights_only_loads():  # ColossalAI's loads of optimizer shards, param groups and lr_scheduler.pt too
        for name, role in _trained_roles(roles).items():
            _load_role(name, role, path / name, int(meta.get("world_size", 0)), load_optimizer)

    extra_state = load_tensors(path / "extra_state.pt")
    if restore_rng:
        rng_file = path / "rng" / f"rank{get_rank()}.pt"
        if rng_file.is_file():
            set_rng_state(load_tensors(rng_file))
        else:
            warnings.warn(
                f"{rng_file} missing (saved with world size {meta.get('world_size')}); this rank's RNG is not restored"
            )
    barrier()
    return LoadedState(path=path, step=int(meta["step"]), extra_state=extra_state, meta=meta)


def _verified_choice(outputs, load) -> tuple[str | None, str | None]:
    """Rank 0: (checkpoint to resume from, None) or (None, why not). ``load`` must verify (sizes and checksums);
    without it the newest complete checkpoint under ``outputs`` that verifies is taken, and each damaged newer one is
    skipped with a warning naming it."""
    candidates = [Path(load)] if load is not None else [path for _, path in reversed(list_checkpoints(outputs))]
    for path in candidates:
        try:
            verify_checkpoint(path, checksums=True)
            return str(path), None
        except DamagedCheckpointError as damaged:
            if load is not None:
                return None, str(damaged)
            logger.warning("--resume auto: skipping a damaged checkpoint: %s", str(damaged).split("; ")[0])
    if candidates:  # a fresh start would drop the run's records and mix a new run into its directory
        return None, (
            f"--resume auto: every checkpoint under {checkpoint_root(outputs)} is damaged (the warnings above name "
            f"the files); copy a good one back, or start elsewhere with --outputs NEW_DIR"
        )
    return None, None


def resolve_resume_path(outputs: str | Path, load: str | Path | None = None, resume_auto: bool = False) -> Path | None:
    """``--load DIR`` wins; ``--resume auto`` picks the newest complete checkpoint that verifies. Rank 0 checks the
    files against the checkpoint's manifest (sizes and checksums) and every rank gets its answer: a damaged ``--load``
    is the same one-line error on every rank."""
    if load is None and not resume_auto:
        return None
    path, error = broadcast_object(_verified_choice(outputs, load) if get_rank() == 0 else None)
    if error is not None:
        raise DamagedCheckpointError(Path(load or checkpoint_root(outputs)), error)
    return None if path is None else Path(path)
