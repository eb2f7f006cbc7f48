"""Roles: the networks a method trains or queries, and the frozen components they share.

This is the contract between methods (``opensora.methods``) and the trainer (``opensora.training``): the trainer
builds one ``Role`` per entry of the config's ``models`` (``opensora.training.role_builder``) and hands them to
the method by name; methods reach roles by name, the trainer only iterates over them. Nothing here needs
ColossalAI, so methods, adapters and their tests import it without the training stack.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import torch
import torch.nn as nn


@dataclass
class Components:
    """Frozen helpers shared by every role: autoencoder, text conditioner, device and compute dtype."""

    vae: Optional[nn.Module]
    text_encoder: Optional[nn.Module]
    device: torch.device
    dtype: torch.dtype
    null_text: Optional[Dict[str, torch.Tensor]] = None  # encode([""]), computed once at start-up
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class Role:
    name: str
    model: nn.Module  # the boosted wrapper when trainable
    trainable: bool
    optimizer: Any = None
    lr_scheduler: Any = None
    booster: Any = None
    ema: Any = None  # an EMA (rank 0) or ShardedEMA (every ZeRO rank) when the role asks for one
    grad_clip: Optional[float] = None
    plugin_clips: bool = False  # ZeRO/Hybrid/Gemini plugins clip inside optimizer.step()
    lora: Optional[Dict[str, Any]] = None  # a LoRA role's lora.json record (opensora.lora.lora_record)

    def unwrap(self) -> nn.Module:
        return self.model.unwrap() if hasattr(self.model, "unwrap") else self.model

    def wait_for_params(self) -> None:
        """Block until this rank's parameters hold the last step's values. With LowLevelZero's
        ``overlap_allgather`` the updated shards are gathered asynchronously and waited for by the next forward;
        readers outside a forward (the EMA) must wait first."""
        wait = getattr(self.model, "_force_wait_all_gather", None)
        if wait is not None:
            wait()

    def _optimizer_chain(self) -> list:
        """The optimizer, then each optimizer it wraps (booster and ZeRO wrappers keep theirs as ``.optim``)."""
        chain = [self.optimizer]
        while hasattr(chain[-1], "optim"):
            chain.append(chain[-1].optim)
        return chain

    def skips_on_device(self) -> bool:
        """Whether ``clip_and_step(found_inf=flag)`` can skip a step on the device: the inner optimizer honours
        ``found_inf`` (torch's fused Adam / AdamW / SGD: the update is not applied and the step counters are
        restored) and its wrappers only copy the unchanged masters back into the weights afterwards. Gemini keeps
        its own chunked weights: not trusted with it."""
        *wrappers, inner = self._optimizer_chain()
        supported = bool(getattr(inner, "_step_supports_amp_scaling", False))
        return supported and not any(type(w).__name__ == "GeminiOptimizer" for w in wrappers)

    def clip_and_step(self, found_inf: Optional[torch.Tensor] = None):
        """Clip gradients to ``grad_clip`` and step; returns the pre-clip global grad norm: a float, or a 0-dim
        device tensor that the caller reads later (no host sync in the step; ``opensora.training.zero_sync``).

        ``found_inf``: a one-element float tensor on the device, 1 to make this step a no-op without the host
        reading it (``skips_on_device`` must hold)."""
        inner = self._optimizer_chain()[-1] if found_inf is not None else None
        if inner is not None:
            inner.found_inf = found_inf  # torch's fused kernels read this attribute (GradScaler sets it too)
        try:
            if self.plugin_clips:
                self.optimizer.step()
                norm = self.optimizer.get_grad_norm()
            else:
                max_norm = self.grad_clip if self.grad_clip is not None else float("inf")
                norm = self.optimizer.clip_grad_by_norm(max_norm)
                self.optimizer.step()
        finally:
            if inner is not None:
                del inner.found_inf
        if norm is None:
            return None
        return norm.detach() if torch.is_tensor(norm) else float(norm)
