"""The MMDiT adapter: the runtime operations methods and the sampler need, with no algorithm in them.

A method (a distillation algorithm) orchestrates *which* network to query *when*; an adapter knows *how* to query one model
family: prepare a raw batch once (text embeddings, the explicit null text, latent shape), add noise, call a
network and turn its output into a velocity or an x0 prediction, and convert a sampled discrete timestep into
the family's continuous, shifted time. Adapters receive role *handles* (``opensora.roles.Role``),
never role names, so what a role *means* stays in the method. Adding a model family means adding an
adapter (registered in ``ADAPTERS``); adding a method means adding a method: N + M, not N x M.

``MMDiTAdapter`` covers our flow-matching MMDiT (t in [0, 1], t = 1 is noise, the network predicts the velocity
``eps - x0``). ``call_network`` is the one place that runs an MMDiT: the flow-matching method, the distillation
methods (through ``predict_velocity``) and the sampler all go through it. The distillation operations are
text-to-video only: a model with condition channels gets the all-zero (no frames given) condition.
A causal MMDiT (``causal_chunk_frames > 0``) can also be queried chunk by chunk with a KV cache
(``new_kv_cache`` / ``predict_x0_streaming``; ``capabilities_for(handle)`` then lists ``"streaming"``).
"""

from dataclasses import dataclass, replace
from typing import Dict, Mapping, Optional, Tuple

import torch

from opensora.diffusion import flow_matching as fm
from opensora.registry import ADAPTERS


@dataclass
class PreparedBatch:
    """What every network call of one training step shares; built once by ``MMDiTAdapter.prepare_batch``."""

    latent_shape: Tuple[int, ...]  # [B, C, T, H, W]
    text: Dict[str, torch.Tensor]  # prompt embeddings (text_emb, text_mask, pooled)
    null_text: Dict[str, torch.Tensor]  # the start-up null-text embeddings broadcast to the batch
    shift_alpha: float  # resolution/length time shift for this latent size

    @property
    def batch_size(self) -> int:
        return self.latent_shape[0]


def _broadcast_text(text: Mapping[str, torch.Tensor], batch_size: int) -> Dict[str, torch.Tensor]:
    """Expand a batch-1 embedding dict (the null text) to ``batch_size`` rows without copying."""
    return {key: value.expand(batch_size, *value.shape[1:]) for key, value in text.items()}


@ADAPTERS.register_module()
class MMDiTAdapter:
    """Operations on an MMDiT role handle (velocity-predicting flow-matching transformer)."""

    # What the adapter can do for a network that supports it; ``capabilities_for(handle)`` answers for one network.
    capabilities = frozenset({"cfg", "predict_x0", "predict_velocity", "streaming"})

    def __init__(
        self,
        components,
        num_train_timesteps: int = 1000,
        shift: Optional[Mapping] = None,
        patch_size: Tuple[int, int, int] = (1, 2, 2),
        min_time: float = 1e-3,
    ):
        if components.text_encoder is None or components.null_text is None:
            raise ValueError(
                "MMDiTAdapter needs components.text_encoder and components.null_text (computed once at "
                "start-up from text_encoder.null_embeddings(1)); the config has no text_encoder"
            )
        if components.vae is None:
            raise ValueError("MMDiTAdapter needs components.vae to know the latent size; the config has no vae")
        self.components = components
        self.num_train_timesteps = int(num_train_timesteps)
        self.shift = dict(shift or {})
        self.patch_size = tuple(patch_size)
        self.min_time = float(min_time)

    # ---- batch ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def prepare_batch(self, batch: Mapping) -> PreparedBatch:
        """Encode prompts and fix the latent shape. The video itself is not encoded: the methods here are
        data-free (the generator makes its own samples), only the prompts and the size come from the data."""
        comp = self.components
        video = batch["video"]
        if video.dim() != 5:
            raise ValueError(f"batch['video'] must be [B, C, T, H, W], got {tuple(video.shape)}")
        latent_thw = tuple(comp.vae.get_latent_size(video.shape[2:]))
        batch_size = video.shape[0]
        latent_shape = (batch_size, comp.vae.latent_channels, *latent_thw)
        text = comp.text_encoder.encode(list(batch["text"]))
        text = {key: value.to(comp.device) for key, value in text.items()}
        null_text = _broadcast_text({k: v.to(comp.device) for k, v in comp.null_text.items()}, batch_size)
        alpha = fm.shift_alpha_for(latent_thw, self.patch_size, **self.shift)
        return PreparedBatch(latent_shape=latent_shape, text=text, null_text=null_text, shift_alpha=alpha)

    def roll_prompts(self, batch: PreparedBatch, shift: int = 1) -> PreparedBatch:
        """``batch`` with each sample's prompt replaced by the prompt ``shift`` samples before it (sample ``i`` takes
        sample ``i - shift``'s text): other prompts from the same data, e.g. for a prompt switch mid-rollout."""
        text = {key: value.roll(shift, dims=0) for key, value in batch.text.items()}
        return replace(batch, text=text)

    def repeat_batch(self, batch: PreparedBatch, times: int) -> PreparedBatch:
        """``batch`` ``times`` over along the sample axis: row ``k * B + i`` is sample ``i`` (its prompt), for ``times``
        clips per sample judged in one call (e.g. several windows of one rollout, concatenated copy by copy)."""
        size = batch.batch_size * int(times)
        text = {key: value.repeat(int(times), *([1] * (value.dim() - 1))) for key, value in batch.text.items()}
        null_text = {key: value[:1].expand(size, *value.shape[1:]) for key, value in batch.null_text.items()}
        return replace(batch, latent_shape=(size, *batch.latent_shape[1:]), text=text, null_text=null_text)

    def noise(self, batch: PreparedBatch) -> torch.Tensor:
        return torch.randn(batch.latent_shape, device=self.components.device, dtype=torch.float32)

    # ---- timestep mechanics (the sampling policy lives in the method) ---------------------------------------
    def shift_and_clamp_timestep(self, timestep_index: torch.Tensor, batch: PreparedBatch) -> torch.Tensor:
        """Discrete index in [0, num_train_timesteps] -> continuous float32 t in [min_time, 1], shifted for
        the batch's latent size with the same ``time_shift`` training and inference use."""
        t = timestep_index.float() / self.num_train_timesteps
        return fm.time_shift(t, batch.shift_alpha).clamp(self.min_time, 1.0)

    @staticmethod
    def add_noise(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return fm.add_noise(x0, noise, t)

    @staticmethod
    def velocity_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        return fm.velocity_target(x0, noise)

    # ---- network calls ------------------------------------------------------------------------------------
    @staticmethod
    def call_network(
        network,
        x: torch.Tensor,
        t: torch.Tensor,
        text: Mapping[str, torch.Tensor],
        cond: Optional[torch.Tensor] = None,
        dtype: Optional[torch.dtype] = None,
        **extra,
    ) -> torch.Tensor:
        """One forward of an MMDiT (plain or boosted): floating inputs cast to its compute ``dtype`` (default:
        its parameters'), text features from ``text`` (``text_emb``, ``text_mask``, ``pooled``); returns the
        network's output as it comes (the velocity, in ``dtype``). ``extra``: further forward keywords (the
        streaming ``kv_cache`` / ``start_frame`` / ``store_kv``)."""
        dtype = dtype or next(network.parameters()).dtype
        return network(
            x=x.to(dtype),
            timestep=t.to(dtype),
            text_emb=text["text_emb"].to(dtype),
            text_mask=text.get("text_mask"),
            pooled=text["pooled"].to(dtype),
            cond=None if cond is None else cond.to(dtype),
            **extra,
        )

    def predict_velocity(
        self, handle, noisy: torch.Tensor, t: torch.Tensor, batch: PreparedBatch, conditional: bool = True
    ) -> torch.Tensor:
        """The network's velocity for ``noisy`` at time ``t`` [B] with the prompt (or the null text); float32.

        Gradients flow when the caller has grad enabled and the handle's parameters require grad.
        """
        t, text, cond, dtype = self._t2v_inputs(handle, noisy, t, batch, conditional)
        return self.call_network(handle.model, noisy, t, text, cond, dtype).float()

    @staticmethod
    def _t2v_inputs(handle, noisy: torch.Tensor, t: torch.Tensor, batch: PreparedBatch, conditional: bool):
        """(t [B], text features, the all-zero t2v condition or None, the network's dtype) for ``call_network``."""
        network = handle.unwrap()
        dtype = next(network.parameters()).dtype
        text = batch.text if conditional else batch.null_text
        cond = None
        cond_channels = getattr(network, "cond_channels", None)
        if cond_channels:  # text-to-video: mask 0 everywhere, no condition frames
            cond = torch.zeros((noisy.shape[0], cond_channels, *noisy.shape[2:]), device=noisy.device, dtype=dtype)
        t = t.expand(noisy.shape[0]) if t.dim() == 0 else t
        return t, text, cond, dtype

    def predict_x0(
        self, handle, noisy: torch.Tensor, t: torch.Tensor, batch: PreparedBatch, conditional: bool = True
    ) -> torch.Tensor:
        """x0 implied by the velocity: ``x_t - t * v`` (float32)."""
        t = t.expand(noisy.shape[0]) if t.dim() == 0 else t
        velocity = self.predict_velocity(handle, noisy, t, batch, conditional=conditional)
        return fm.predict_x0(noisy.float(), velocity, t.float())

    # ---- streaming (causal networks) ------------------------------------------------------------------------
    def capabilities_for(self, handle) -> frozenset:
        """``capabilities`` that hold for this handle's network: ``"streaming"`` only for a causal MMDiT."""
        causal = getattr(handle.unwrap(), "causal_chunk_frames", 0) > 0
        return self.capabilities if causal else self.capabilities - {"streaming"}

    def new_kv_cache(
        self,
        handle,
        batch: PreparedBatch,
        window_frames: Optional[int] = None,
        sink_frames: int = 0,
        rope_anchor: str = "absolute",
    ):
        """An empty ``KVCache`` for ``handle``'s causal network (one per network and guidance branch)."""
        network = handle.unwrap()
        if "streaming" not in self.capabilities_for(handle):
            raise ValueError("new_kv_cache needs a causal MMDiT (built with causal_chunk_frames > 0)")
        return network.new_kv_cache(window_frames=window_frames, sink_frames=sink_frames, rope_anchor=rope_anchor)

    def predict_x0_streaming(
        self,
        handle,
        noisy_chunk: torch.Tensor,
        t: torch.Tensor,
        batch: PreparedBatch,
        cache,
        start_frame: int,
        store_kv: bool,
        conditional: bool = True,
    ) -> torch.Tensor:
        """x0 (float32) of one chunk ``noisy_chunk`` [B, C, Tc, H, W] at time ``t`` and absolute latent frame
        ``start_frame``, attending to the frames in ``cache`` (``MMDiT.forward_chunk``); ``store_kv=True`` appends
        the chunk to the cache. Gradients flow through the chunk (not the cache) when grad is enabled."""
        t, text, cond, dtype = self._t2v_inputs(handle, noisy_chunk, t, batch, conditional)
        # through handle.model (not unwrap()), so a booster wrapper's forward hooks run as for any forward
        velocity = self.call_network(
            handle.model,
            noisy_chunk,
            t,
            text,
            cond,
            dtype,
            kv_cache=cache,
            start_frame=int(start_frame),
            store_kv=bool(store_kv),
        ).float()
        return fm.predict_x0(noisy_chunk.float(), velocity, t.float())

    # ---- accounting ---------------------------------------------------------------------------------------
    def forward_flops(self, handle, batch: PreparedBatch) -> float:
        """FLOPs of one forward pass of ``handle`` on ``batch`` (for MFU logging)."""
        from opensora.models.mmdit.flops import mmdit_forward_flops

        network = handle.unwrap()
        tokens = fm.num_latent_tokens(batch.latent_shape[2:], tuple(network.patch_size))
        flops = mmdit_forward_flops(network, tokens, batch.text["text_emb"].shape[1], batch.batch_size)
        return float(flops["total"] if isinstance(flops, Mapping) else flops)

    def num_tokens(self, handle, batch: PreparedBatch) -> int:
        return batch.batch_size * fm.num_latent_tokens(batch.latent_shape[2:], tuple(handle.unwrap().patch_size))
