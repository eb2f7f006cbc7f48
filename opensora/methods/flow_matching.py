"""Flow-matching training (pretraining / finetuning) of one role, ``model``: the first method.

One micro-step: encode video and text (frozen components) -> drop text for CFG -> draw t (logit-normal,
resolution-shifted) and noise -> build the I2V/V2V condition per sample -> predict the velocity -> masked MSE
that ignores condition frames.
"""

from typing import Mapping, Optional

import torch

from opensora.adapters.mmdit import MMDiTAdapter
from opensora.diffusion.conditions import build_training_condition
from opensora.diffusion.flow_matching import (
    add_noise,
    drop_text,
    masked_mse,
    sample_training_timesteps,
    shift_alpha_for,
    velocity_target,
)
from opensora.methods.base import TrainingMethod
from opensora.models.mmdit.flops import mmdit_train_flops
from opensora.registry import METHODS


@METHODS.register_module()
class FlowMatching(TrainingMethod):
    required_roles = ("model",)
    trainable_roles = ("model",)
    same_step_every_iteration = True  # ``iteration`` is not read

    def __init__(
        self,
        roles,
        components,
        timestep_kind: str = "logit_normal",
        timestep_mean: float = 0.0,
        timestep_std: float = 1.0,
        shift: Optional[Mapping] = None,
        text_dropout: float = 0.1,
        condition_probs: Optional[Mapping[str, float]] = None,
        condition_kwargs: Optional[Mapping] = None,
    ):
        super().__init__(roles, components)
        self.timestep = dict(kind=timestep_kind, mean=timestep_mean, std=timestep_std)
        self.shift = dict(shift or {})
        self.text_dropout = text_dropout
        self.condition_probs = dict(condition_probs or {"t2v": 1.0})
        self.condition_kwargs = dict(condition_kwargs or {})
        model = self.roles["model"].unwrap()
        self.patch_size = tuple(model.patch_size)
        self.uses_condition = getattr(model, "cond_channels", None) is not None
        self.model_dtype = next(model.parameters()).dtype
        self._null_text_length: Optional[int] = None

    @torch.no_grad()
    def encode_batch(self, batch: Mapping) -> tuple:
        """(x0 latents float32, text features) on the device. A batch that carries pre-extracted ``latents``
        and/or text features (``text_emb``, ``pooled``, optional ``text_mask``) skips the VAE / text encoder;
        host tensors (pinned by the loader) are copied without blocking the host."""
        comp = self.components
        if "latents" in batch:
            x0 = batch["latents"].to(comp.device, non_blocking=True).float()
        else:
            video = batch["video"].to(comp.device, comp.dtype, non_blocking=True)
            x0 = comp.vae.encode(video).float()
        if "text_emb" in batch:
            keys = [k for k in ("text_emb", "text_mask", "pooled") if k in batch]
            text = {k: batch[k].to(comp.device, non_blocking=True) for k in keys}
        else:
            text = comp.text_encoder.encode(list(batch["text"]))
            text = {k: v.to(comp.device, non_blocking=True) for k, v in text.items()}
        return x0, text

    def text_length_bound(self, batch: Mapping) -> Optional[int]:
        """A host int >= every row's valid text length after CFG dropout, or None (the model then reads the lengths
        back from the GPU once per forward, a host wait that stalls the launch queue). Both input paths give the same
        bound, so training from precomputed features stays bit-identical to training from the videos: the last valid
        column of the loader's host mask (its longest row, valid tokens coming first), or the tokenizer's count of the
        longest prompt, raised to the null text's length when dropout may swap it in."""
        if "text_emb" in batch:
            mask = batch.get("text_mask")
            if mask is None or mask.device.type != "cpu":
                return None
            valid_columns = mask.bool().any(0).nonzero()  # the last valid column: a safe cut for any mask pattern
            longest = int(valid_columns.max()) + 1 if len(valid_columns) else 0
        else:
            text_lengths = getattr(self.components.text_encoder, "text_lengths", None)
            lengths = text_lengths(list(batch["text"])) if text_lengths is not None else None
            if lengths is None:  # an encoder without host counts, or one that pads on the left
                return None
            longest = max(lengths)
        null = self.components.null_text
        if null is not None and self.text_dropout > 0:
            if self._null_text_length is None:  # one device read, on the first step
                mask = null.get("text_mask")
                self._null_text_length = int(mask.sum(-1).max()) if mask is not None else null["text_emb"].shape[1]
            longest = max(longest, self._null_text_length)
        return longest

    def single_train_step(self, batch: Mapping, iteration: int):
        comp = self.components
        x0, text = self.encode_batch(batch)
        bound = self.text_length_bound(batch)  # after encoding: the encoder remembers the prompts' counts
        batch_size = x0.shape[0]
        if comp.null_text is not None:
            text, _ = drop_text(text, comp.null_text, self.text_dropout)
        elif self.text_dropout > 0:
            raise ValueError("text_dropout > 0 needs a text encoder (its null text); set text_dropout=0")

        alpha = shift_alpha_for(tuple(x0.shape[2:]), self.patch_size, **self.shift)
        t = sample_training_timesteps(batch_size, shift_alpha=alpha, device=comp.device, **self.timestep)
        noise = torch.randn_like(x0)
        x_t = add_noise(x0, noise, t)
        target = velocity_target(x0, noise)

        cond, loss_mask = None, None
        if self.uses_condition:
            condition = build_training_condition(x0, self.condition_probs, **self.condition_kwargs)
            cond, loss_mask = condition.cond, condition.loss_mask

        # whether the text has padded tokens is not read here: a mask means "may have padding" (the model in
        # training reads the valid lengths once to trim the text, models/mmdit/text_padding.py); no mask, no padding
        pred = MMDiTAdapter.call_network(
            self.roles["model"].model,
            x_t,
            t,
            text,
            cond,
            self.model_dtype,
            text_mask_has_padding=text.get("text_mask") is not None,
            text_length_bound=bound,
        )
        loss = masked_mse(pred, target, loss_mask)

        num_video_tokens = x0[0, 0].numel() // (self.patch_size[0] * self.patch_size[1] * self.patch_size[2])
        num_text_tokens = text["text_emb"].shape[1]
        model = self.roles["model"].unwrap()
        outputs = dict(
            num_samples=batch_size,
            num_tokens=batch_size * num_video_tokens,
            flops=mmdit_train_flops(model, num_video_tokens, num_text_tokens, batch_size),
        )
        return {"total_loss": loss}, outputs
