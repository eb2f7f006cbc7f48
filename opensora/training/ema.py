"""Exponential moving average of the model weights, kept on rank 0 only.

    shadow <- decay * shadow + (1 - decay) * param        (step >= start_step)
    shadow <- param                                       (step <  start_step: plain copy)

The shadow starts as a copy of the weights at construction. Which weights it sees: the *unwrapped* model's
trainable parameters (``requires_grad``), keyed by their ``named_parameters()`` names, so an EMA state dict
loads straight into the bare model. Under the plugins we use those are the full working weights on every rank:

* TorchDDP and LowLevelZero stage 1/2: parameters are replicated; ZeRO shards only gradients/optimizer
  state (the fp32 master copy), and after ``optimizer.step()`` the updated working params are all-gathered.
  With ``precision="bf16"`` the working params are the **bf16** copies, so the EMA averages bf16-rounded
  weights (accumulated in fp32 here).
* HybridParallelPlugin with tp_size=1 (our no-op policy): parameters are whole on every rank.
* Gemini / FSDP / tensor parallel shard the parameters themselves: this class does NOT gather them.

``update(..., values=...)`` folds in other tensors of the same shapes instead of some parameters: the trainer passes
ZeRO's fp32 masters where one rank holds them whole (``zero_single_rank.whole_masters``), as Open-Sora's
``update_ema`` averages the master weights under ZeRO. The fp32 values are what the bf16 weights are rounded from,
and the update then reads 12 bytes a parameter instead of 18 (no bf16-to-fp32 cast pass): on a 1B step that GPU
traffic is what the EMA costs. With several ranks each holds only a shard of the masters, so the bf16 weights are
averaged as above.

With ``world_size > 1`` only rank 0 allocates the shadow; on other ranks every method is a cheap no-op. Under
LowLevelZero with several ranks the trainer keeps ``ema_sharded.ShardedEMA`` instead: each rank averages its own
pieces of the fp32 masters.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from .distributed import get_rank


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside Booster / DDP / ZeRO wrappers."""
    while True:
        if hasattr(model, "unwrap") and callable(model.unwrap):
            inner = model.unwrap()
        elif isinstance(model, nn.parallel.DistributedDataParallel):
            inner = model.module
        else:
            return model
        if inner is model:
            return model
        model = inner


def ema_step(shadow: torch.Tensor, value: torch.Tensor, decay: float) -> None:
    """In place: shadow <- decay * shadow + (1 - decay) * value (value cast to the shadow's dtype/device)."""
    shadow.lerp_(value.to(device=shadow.device, dtype=shadow.dtype), 1.0 - decay)


# Elements cast at once by ``ema_step_all``: bounds its scratch memory (128 MiB in fp32) while keeping the number of
# kernel launches per update near (parameters / this), not 2 per tensor.
CAST_CHUNK_NUMEL = 32 * 2**20


def _chunks(shadows, values, limit: int):
    """Consecutive runs of (shadow, value) pairs of one device and dtype each, at most ``limit`` elements per run
    (a tensor larger than ``limit`` forms a run of its own)."""
    run, size, key = [], 0, None
    for shadow, value in zip(shadows, values):
        pair_key = (shadow.device, shadow.dtype, value.device, value.dtype)
        if run and (pair_key != key or size + value.numel() > limit):
            yield run
            run, size = [], 0
        run.append((shadow, value))
        size += value.numel()
        key = pair_key
    if run:
        yield run


class _UpdatePlan:
    """What ``ema_step_all`` does for one list of (shadow, value) pairs, worked out once: the runs of ``_chunks``,
    detached flat views of the values and shadows, and each run's scratch size. Replaying it costs a few host ops per
    run instead of several per tensor (~340 tensors at 1B; the update then no longer holds up a host-bound step).
    Valid while the values are the same tensors on the same storage (``EMA`` checks that each update)."""

    def __init__(self, shadows: list, values: list, chunk_numel: int):
        self.runs = []
        for run in _chunks(shadows, values, chunk_numel):
            run_shadows = [s for s, _ in run]
            run_values = [v.detach() for _, v in run]
            sizes = [v.numel() for v in run_values]  # the cast scratch's pieces
            if run_values[0].device != run_shadows[0].device:  # a host-side shadow (device="cpu"): tensor by tensor
                self.runs.append(("per_tensor", run_shadows, run_values, sizes))
            elif run_values[0].dtype == run_shadows[0].dtype:
                self.runs.append(("lerp", run_shadows, run_values, sizes))
            elif all(t.is_contiguous() for t in (*run_shadows, *run_values)):
                # flat views: the scratch's pieces need no per-tensor view, and elementwise kernels do not care
                flat_shadows, flat_values = [s.view(-1) for s in run_shadows], [v.view(-1) for v in run_values]
                self.runs.append(("cast", flat_shadows, flat_values, sizes))
            else:
                self.runs.append(("cast_shaped", run_shadows, run_values, sizes))

    def run(self, decay: float) -> None:
        """The same arithmetic as ``ema_step`` per tensor, so bit-identical results: each value is first cast into
        fp32 (shadow dtype) scratch (one ``_foreach_copy_`` per run), then one ``_foreach_lerp_`` folds the run in."""
        weight = 1.0 - decay
        for kind, shadows, values, sizes in self.runs:
            if kind == "per_tensor":
                for shadow, value in zip(shadows, values):
                    ema_step(shadow, value, decay)
                continue
            if kind == "lerp":
                torch._foreach_lerp_(shadows, values, weight)
                continue
            first = shadows[0]
            pieces = torch.empty(sum(sizes), device=first.device, dtype=first.dtype).split(sizes)
            casts = list(pieces) if kind == "cast" else [piece.view_as(v) for piece, v in zip(pieces, values)]
            torch._foreach_copy_(casts, values)
            torch._foreach_lerp_(shadows, casts, weight)


def ema_step_all(shadows: list, values: list, decay: float, chunk_numel: int = CAST_CHUNK_NUMEL) -> None:
    """``ema_step`` over lists with multi-tensor kernels (``_UpdatePlan``); the same arithmetic, so bit-identical
    results. Per-tensor ``ema_step`` costs two launches and an allocation per tensor (~670 at 1B)."""
    _UpdatePlan(shadows, values, chunk_numel).run(decay)


class EMA:
    """EMA of a model's trainable weights.

    Args:
        model: the (possibly booster-wrapped) model; only names/shapes and initial values are read.
        decay: EMA decay (config key ``ema_decay``; 0.9999 in our configs).
        start_step: updates with ``step < start_step`` copy the weights instead of averaging.
        device: where the shadow lives; ``None`` = same device as each parameter; ``"cpu"`` saves GPU memory.
        dtype: shadow dtype, fp32 by default (averaging in bf16 loses the (1 - decay) increments).
        enabled: override the rank-0-only rule (default: enabled only on rank 0).
        overlap: with shadows on a GPU, run each update on a side stream of its own, so its memory traffic (18 B per
            parameter, ~7 ms of a 1B step on an H200) overlaps the next step's forward and backward instead of
            following the optimizer. The same kernels, so the same bits. Whoever writes the parameters next (the
            trainer, before the optimizer step) calls ``fence()``; every reader of the shadow here fences itself.
        warmup: average with ``min(decay, (1 + n) / (10 + n))``, n = steps since ``start_step``, so a short run's
            EMA is not dominated by the initial weights (with decay 0.999, 1300 plain updates still keep 27% of
            the zero-initialised output layers, which wrecks samples). Long runs reach ``decay`` after ~10/(1-decay)
            steps. Depends only on the step, so resume stays exact.
    """

    def __init__(
        self,
        model: nn.Module,
        decay: float = 0.9999,
        start_step: int = 0,
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        enabled: bool | None = None,
        warmup: bool = False,
        overlap: bool = True,
    ):
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA decay must be in [0, 1], got {decay}")
        self.decay = float(decay)
        self.start_step = int(start_step)
        self.warmup = bool(warmup)
        self.device = torch.device(device) if device is not None else None
        self.dtype = dtype
        self.enabled = (get_rank() == 0) if enabled is None else bool(enabled)
        self.num_updates = 0
        self.overlap = bool(overlap)
        self._stream = None  # the side stream of the overlapped updates, made on the first one
        self._done = None  # an event after the last overlapped update
        self._prepared_for = None  # (parameters key, shadows, params, plan, GPU) of the last update: ``_prepared``
        self.shadow: dict[str, torch.Tensor] = {}
        if self.enabled:
            with torch.no_grad():
                for name, param in self._tracked(model):
                    self.shadow[name] = self._init_shadow(name, param)

    collective = False  # whether save / state_dict / copy_to need every rank (``ShardedEMA``)

    def _init_shadow(self, name: str, param: torch.Tensor) -> torch.Tensor:
        return param.detach().to(device=self.device or param.device, dtype=self.dtype, copy=True)

    def _value_for(self, name: str, param: torch.Tensor, instead: dict) -> torch.Tensor:
        """What the update folds into ``name``'s shadow: ``instead``'s tensor for it, else the parameter."""
        value = instead.get(id(param))
        if value is not None and value.shape != param.shape:
            raise ValueError(f"EMA value for {name!r} has shape {tuple(value.shape)}, not {tuple(param.shape)}")
        return (param if value is None else value).detach()

    def masters_of(self, optimizer) -> dict | None:
        """The ``values`` for ``update``: ZeRO's whole fp32 masters where one rank holds them, else None (the
        weights themselves)."""
        from .zero_single_rank import whole_masters

        return whole_masters(optimizer)

    @staticmethod
    def _tracked(model: nn.Module):
        return [(n, p) for n, p in unwrap_model(model).named_parameters() if p.requires_grad]

    @torch.no_grad()
    def update(
        self, model: nn.Module, step: int, after: torch.cuda.Event | None = None, values: dict | None = None
    ) -> None:
        """Fold the model's current weights in; ``step`` is the trainer's global step (after the update).

        ``after``: an event recorded right after the optimizer step whose weights these are, for an update queued
        later (behind the next step's forward and backward, which do not write the weights): an overlapped update
        then starts at that event instead of behind everything queued so far.
        ``values``: {id(parameter): tensor of its shape} folded in instead of those parameters (the fp32 masters the
        optimizer step wrote; they must be written before ``after`` too)."""
        if not self.enabled:
            return
        shadows, params, plan, side = self._prepared(model, values or {})
        if side is not None and after is not None:
            side.wait_event(after)
        elif side is not None:  # after everything queued so far (the optimizer's writes to the parameters)
            side.wait_stream(torch.cuda.current_stream(side.device))
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            if step < self.start_step:
                for shadow, param in zip(shadows, params):
                    shadow.copy_(param)
            else:
                plan.run(self.decay_at(step))
            if side is not None:
                self._done = torch.cuda.Event()
                self._done.record(side)
        self.num_updates += 1

    def _prepared(self, model: nn.Module, instead: dict):
        """(shadows, values, update plan, side stream) for ``model``'s trainable weights (or the tensors ``instead``
        names for them). Walking the module tree is the one per-update cost when the values are the tensors of the
        last update (same objects on the same storage, in the same order): the name check, the lists, the plan and
        the stream choice are kept."""
        params = [instead.get(id(p), p) for p in unwrap_model(model).parameters() if p.requires_grad]
        key = (tuple(map(id, params)), tuple(p.data_ptr() for p in params), CAST_CHUNK_NUMEL)
        if self._prepared_for is None or self._prepared_for[0] != key:
            tracked = self._tracked(model)
            for name, _ in tracked:
                if name not in self.shadow:
                    raise KeyError(f"EMA has no weight {name!r}: was the model changed after the EMA was built?")
            shadows = [self.shadow[name] for name, _ in tracked]
            values = [self._value_for(name, param, instead) for name, param in tracked]
            plan = _UpdatePlan(shadows, values, CAST_CHUNK_NUMEL)
            device = shadows[0].device if shadows else None  # the GPU all of them are on, if one is
            if device is None or device.type != "cuda" or any(t.device != device for t in (*shadows, *values)):
                device = None
            self._prepared_for = (key, shadows, values, plan, device)
        _, shadows, values, plan, device = self._prepared_for
        return shadows, values, plan, self._side_stream(device)

    def _side_stream(self, device: torch.device | None):
        """The overlap's stream, or ``None`` (overlap off, or ``device`` None: host shadows or not all on one GPU)."""
        if not (self.overlap and device is not None and torch.cuda.is_available()):
            return None
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device=device)
        return self._stream

    def fence(self) -> None:
        """Make the current stream wait for the last overlapped update: call it before writing the parameters
        the update reads (the next optimizer step). No host sync; a no-op without an overlapped update."""
        if self._done is not None:
            torch.cuda.current_stream(self._stream.device).wait_event(self._done)

    def decay_at(self, step: int) -> float:
        if not self.warmup:
            return self.decay
        n = max(step - self.start_step, 0)
        return min(self.decay, (1.0 + n) / (10.0 + n))

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        """Write the EMA weights into ``model`` (e.g. for sampling); only meaningful where enabled."""
        self.fence()
        self._write_into(model, self.shadow)

    @staticmethod
    def _write_into(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        """Copy whole EMA tensors into the bare model's parameters of the same names (cast to their device/dtype)."""
        params = dict(unwrap_model(model).named_parameters())
        for name, value in tensors.items():
            params[name].copy_(value.to(device=params[name].device, dtype=params[name].dtype))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Weight name -> EMA tensor (the same keys as the bare model's state dict). Empty where disabled."""
        self.fence()
        return dict(self.shadow)

    def _check_keys(self, state, strict: bool) -> None:
        missing = sorted(set(self.shadow) - set(state))
        unexpected = sorted(set(state) - set(self.shadow))
        if strict and (missing or unexpected):
            raise KeyError(f"EMA state mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        if not self.enabled:
            return
        self._check_keys(state, strict)
        self.fence()
        with torch.no_grad():
            for name, value in state.items():
                if name in self.shadow:
                    self.shadow[name].copy_(value)

    def save(self, path: str | Path) -> None:
        """Write a safetensors file (fp32 tensors on CPU + decay/start_step/num_updates metadata)."""
        if not self.enabled:
            return
        self.fence()
        tensors = {name: t.detach().cpu().contiguous() for name, t in self.shadow.items()}
        save_file(tensors, str(path), metadata=self._metadata())

    def _metadata(self) -> dict[str, str]:
        return {"decay": repr(self.decay), "start_step": str(self.start_step), "num_updates": str(self.num_updates)}

    def _read_metadata(self, metadata: dict) -> None:
        self.num_updates = int(metadata.get("num_updates", self.num_updates))

    def load(self, path: str | Path, strict: bool = True) -> None:
        if not self.enabled:
            return
        from safetensors import safe_open

        self.load_state_dict(load_file(str(path)), strict=strict)
        with safe_open(str(path), framework="pt") as handle:
            self._read_metadata(handle.metadata() or {})
