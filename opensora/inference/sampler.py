"""The sampler: text (+ reference image/video) -> latent noise -> Euler flow sampler with CFG -> decoded video.

``VideoSampler.from_config(cfg, ckpt)`` builds the network of one role from the config, loads its weights
(EMA by default) and the frozen autoencoder and text conditioner; ``generate(prompts, seeds, ...)`` returns
uint8 videos ``[N, T, H, W, 3]``.

Choices that matter for reproducing training:

* Timestep shift: ``shift_alpha_for(latent (T, H, W), model.patch_size, **cfg.method.shift)`` -- the function
  and arguments the training method used.
* Conditions: the model sees the noisy latent on every frame plus ``cond = [mask, masked reference latents]``
  (``opensora.diffusion.conditions``); a t2v sample of a conditioned model gets the all-zero condition, as in
  training. After the last step the reference frames are pasted back into the latent, so conditioned frames
  are returned exactly as encoded.
* Guidance (``opensora.diffusion.guidance``, one convention): without a reference,
  ``v = u + w_txt (c - u)`` in 2 passes (c: prompt, u: empty prompt). With a reference,
  ``v = u_noimg + w_img (u_img - u_noimg) + w_txt (c - u_img)`` in 3 passes; when ``w_img == 1`` the third
  term vanishes and only 2 passes run. ``w_txt == 1`` (and no image guidance) runs 1 pass.
* Seeds: sample ``i`` draws its noise from its own CPU ``torch.Generator`` seeded with ``seeds[i]``, so the
  batch size and the device never change which noise a sample gets.
* Sequence parallelism (``set_sequence_parallel``): the ranks of one group get the same prompts and seeds, so
  the same noise; the network splits every sample's tokens over them (the trainer's all-to-all) and each rank
  gets the whole velocity, so all run the same Euler loop. Only the group's rank 0 decodes: ``generate``
  returns ``None`` for the videos on the other ranks.
"""

from __future__ import annotations

import contextlib
import functools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from tqdm import tqdm

from opensora.adapters.mmdit import MMDiTAdapter
from opensora.convert.weights import LoadedWeights, check_shapes_fit, load_role_weights
from opensora.datasets.buckets import ASPECT_RATIOS, bucket_size, parse_resolution
from opensora.diffusion.conditions import (
    CONDITION_TYPES,
    num_v2v_frames,
    paste_condition_frames,
    reference_condition,
)
from opensora.diffusion.flow_matching import shift_alpha_for
from opensora.diffusion.sampling import sample
from opensora.inference.io import load_reference, to_uint8_frames
from opensora.models.vae.base import resolve_dtype
from opensora.registry import MODELS, build_module
from opensora.role_config import role_configs

REFERENCE_TYPES = CONDITION_TYPES[1:]  # i2v_head, i2v_tail, i2v_loop, v2v_head, v2v_tail


# ----------------------------------------------------------------------------------------------------------
# Small resolvers (pure)
# ----------------------------------------------------------------------------------------------------------
def resolve_device(device: Union[str, torch.device, None] = "auto") -> torch.device:
    """``"auto"`` / None: CUDA when available, else the CPU."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_sampling_dtype(dtype: Union[str, torch.dtype, None], device: torch.device) -> torch.dtype:
    """``"auto"`` / None: bf16 on CUDA, fp32 on the CPU (bf16 matmuls are slow on most CPUs)."""
    if dtype is None or (isinstance(dtype, str) and dtype == "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return resolve_dtype(dtype)


def parse_aspect_ratio(aspect_ratio: Union[str, float, None]) -> float:
    """Height / width from ``"9:16"`` (height:width, as ``ASPECT_RATIOS``), a number, or None (square)."""
    if aspect_ratio is None:
        return 1.0
    if isinstance(aspect_ratio, (int, float)):
        ratio = float(aspect_ratio)
    else:
        named = dict(ASPECT_RATIOS)
        text = str(aspect_ratio).strip()
        if text in named:
            ratio = named[text]
        elif ":" in text:
            height, width = text.split(":", 1)
            ratio = float(height) / float(width)
        else:
            ratio = float(text)
    if ratio <= 0:
        raise ValueError(f"aspect ratio must be positive, got {aspect_ratio!r}")
    return ratio


def video_size_for(resolution: str, aspect_ratio=None, size_multiple: int = 16) -> Tuple[int, int]:
    """(height, width) for a bucket-style resolution name (``"256px"``, ``"720p"``, ``"32x32"``) and aspect ratio.

    An exact ``"HxW"`` ignores the aspect ratio; an area name keeps its pixel area at that ratio with sides
    rounded to ``size_multiple``, exactly as training buckets are sized.
    """
    res = parse_resolution(resolution)
    if res.exact_size is not None:
        return res.exact_size
    return bucket_size(res.area, parse_aspect_ratio(aspect_ratio), size_multiple)


def role_model_config(cfg: Mapping, role: str = "model") -> Mapping:
    """The network config of ``role`` (``opensora.role_config``: ``models[role]``, or plain training's ``model``)."""
    roles = role_configs(cfg)
    if role not in roles:
        raise KeyError(f"config has no role '{role}'; roles: {sorted(roles)}")
    return roles[role]["model"]


def seeded_noise(seeds: Sequence[int], shape: Sequence[int], device=None) -> torch.Tensor:
    """``[len(seeds), *shape]`` float32 standard normal; row ``i`` comes from ``torch.Generator().manual_seed(seeds[i])``
    on the CPU, so it depends on nothing but its seed."""
    return noise_from_generators([torch.Generator("cpu").manual_seed(int(s)) for s in seeds], shape, device)


def noise_from_generators(generators: Sequence[torch.Generator], shape: Sequence[int], device=None) -> torch.Tensor:
    """``[len(generators), *shape]`` float32 standard normal, row ``i`` drawn next from CPU generator ``i``.

    CPU normal sampling is single-threaded per call and was the largest fixed cost of few-step sampling (72 clips of
    MovingShapes latents: 14M values, ~0.1-0.4 s), so rows are drawn in parallel threads straight into one (pinned,
    for a CUDA target) buffer and copied without blocking; the values are those of the plain per-row loop.
    """
    shape = tuple(shape)
    pinned = device is not None and torch.device(device).type == "cuda"
    noise = torch.empty((len(generators), *shape), pin_memory=pinned)

    def fill(i):
        torch.randn(shape, generator=generators[i], out=noise[i])

    workers = min(len(generators), os.cpu_count() or 1, 16)
    if workers > 1 and noise.numel() >= 1 << 20:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(fill, range(len(generators))))
    else:
        for i in range(len(generators)):
            fill(i)
    return noise.to(device, non_blocking=pinned) if device is not None else noise


def _module_dtype(module: nn.Module, default: torch.dtype) -> torch.dtype:
    """dtype of a module's first floating parameter/buffer (``default`` for a parameter-free one)."""
    for tensor in list(module.parameters()) + list(module.buffers()):
        if tensor.is_floating_point():
            return tensor.dtype
    return default


# ----------------------------------------------------------------------------------------------------------
# The sampler
# ----------------------------------------------------------------------------------------------------------
@dataclass
class PreparedCondition:
    """Condition inputs for a batch: ``cond`` for the conditional passes, ``null`` for the "no image" pass."""

    cond: Optional[torch.Tensor]  # [B, C+1, T, H, W] or None (model without condition input)
    null: Optional[torch.Tensor]  # all-zero condition, or None
    has_reference: bool


class VideoSampler:
    """Build once, then ``generate`` as often as needed (text embeddings are cached by the text conditioner).

    Args:
        model: the velocity network (MMDiT interface); it runs on the device and in the dtype of its parameters.
        vae: a ``VideoAutoencoder``. text_encoder: a ``TextConditioner``-like module.
        shift: kwargs for ``shift_alpha_for`` (the training method's ``shift``).
        device: overrides the device taken from the network (only needed for a parameter-free one).
        offload: the text encoder and autoencoder live on the CPU and visit the device only while they run
        (``from_config`` puts them there; pass them on the CPU when building directly).
        v2v_frames: latent frames given by ``v2v_*`` references (int, or a fraction of T as in training).
        progress: show progress bars.
    """

    def __init__(
        self,
        model: nn.Module,
        vae: nn.Module,
        text_encoder: nn.Module,
        shift: Optional[Mapping] = None,
        device: Union[str, torch.device, None] = None,
        offload: bool = False,
        v2v_frames: Union[int, float] = 0.5,
        progress: bool = True,
        weights: Optional[LoadedWeights] = None,
    ):
        # Modules are used where and as they are (a training loop may hand in its live student): only
        # ``from_config`` moves, casts and freezes them. The network's own parameters give device and dtype.
        first = next(model.parameters(), None)
        self.device = resolve_device(device) if first is None or device is not None else first.device
        self.dtype = first.dtype if first is not None else torch.float32
        self.offload = bool(offload) and self.device.type != "cpu"  # on the CPU there is nothing to save
        self.model = model
        self.vae = vae
        self.text_encoder = text_encoder
        self.shift = dict(shift or {})
        self.v2v_frames = v2v_frames
        self.progress = progress
        self.weights = weights  # where the network's weights came from (for sidecars)
        self.patch_size = tuple(getattr(model, "patch_size", (1, 1, 1)))
        self.uses_condition = getattr(model, "cond_channels", None) is not None
        # Optional inference cache (opensora.inference.cache.jano: JanoCache, StepCache, FullCompute); None = plain model.
        self.accelerator = None
        # Whole passes replayed as CUDA graphs (pass_graphs.PassGraphs; set_cuda_graphs); None = eager passes.
        self.pass_graphs = None
        self.sp = None  # opensora.parallel.sequence_parallel.SequenceGroup while the network is split

    def set_sequence_parallel(self, sp) -> None:
        """Split the network's tokens over the ranks of ``sp`` (a ``SequenceGroup``; None or size 1: off).

        Every rank of the group must call ``generate`` with the same arguments; only ``sp.rank == 0`` decodes.
        """
        if sp is not None and sp.size == 1:
            sp = None
        if sp is not None:
            if not callable(getattr(self.model, "set_sequence_parallel", None)):
                raise ValueError(f"{type(self.model).__name__} cannot split its sequence (no set_sequence_parallel)")
            if self.accelerator is not None:
                raise ValueError("sequence parallelism does not combine with an inference cache (Jano / step cache)")
        if sp is not None or self.sp is not None:
            self.model.set_sequence_parallel(sp)
        self.sp = sp

    @property
    def decodes(self) -> bool:
        """Whether this process decodes (and writes) samples: always, except on sequence-parallel ranks > 0."""
        return self.sp is None or self.sp.rank == 0

    @classmethod
    def from_config(
        cls,
        cfg: Mapping,
        ckpt,
        role: str = "model",
        ema: bool = True,
        device: Union[str, torch.device, None] = "auto",
        dtype: Union[str, torch.dtype, None] = "auto",
        offload: bool = False,
        progress: bool = True,
    ) -> "VideoSampler":
        """Network of ``role`` from ``cfg`` with weights from ``ckpt`` (checkpoint directory: EMA unless
        ``ema=False``; or one safetensors file), strictly loaded; autoencoder and text conditioner from ``cfg``."""
        model = build_module(role_model_config(cfg, role), MODELS)
        weights = load_role_weights(ckpt, role=role, ema=ema)
        check_shapes_fit(
            {k: v.shape for k, v in weights.state_dict.items()},
            model,
            f"weights in {weights.path}",
            f"'{role}' network of this config",
        )  # names the first mismatching tensor, one line
        model.load_state_dict(weights.state_dict, strict=True)
        device = resolve_device(device)
        dtype = resolve_sampling_dtype(dtype, device)
        home = torch.device("cpu") if offload and device.type != "cpu" else device  # of the frozen helpers
        model = model.to(device, dtype).eval().requires_grad_(False)
        vae = build_module(cfg["vae"], MODELS).to(home, dtype).eval().requires_grad_(False)
        text_encoder = build_module(cfg["text_encoder"], MODELS).to(home).eval()
        method = cfg.get("method") or {}
        shift = method.get("shift") or {}
        v2v_frames = (method.get("condition_kwargs") or {}).get("v2v_frames", 0.5)
        return cls(
            model,
            vae,
            text_encoder,
            shift=shift,
            device=device,
            offload=offload,
            v2v_frames=v2v_frames,
            progress=progress,
            weights=weights,
        )

    # ---- helpers ------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _resident(self, module: nn.Module):
        """With ``offload``, move ``module`` to the device for the block and back to the CPU after it."""
        if not self.offload:
            yield module
            return
        module.to(self.device)
        try:
            yield module
        finally:
            module.to("cpu")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def latent_size(self, num_frames: int, height: int, width: int) -> Tuple[int, int, int]:
        return tuple(self.vae.get_latent_size((num_frames, height, width)))

    def shift_alpha(self, latent_size: Sequence[int]) -> float:
        return shift_alpha_for(tuple(latent_size), self.patch_size, **self.shift)

    def encode_text(self, prompts: Sequence[str]) -> Tuple[dict, dict]:
        """(prompt features, empty-prompt features), both on the device."""
        with self._resident(self.text_encoder) as encoder:
            text = encoder.encode(list(prompts))
            null = encoder.null_embeddings(len(prompts))
        to_device = lambda d: {k: v.to(self.device) for k, v in d.items()}  # noqa: E731
        return to_device(text), to_device(null)

    def encode_video(self, video: torch.Tensor) -> torch.Tensor:
        """``[B, 3, T, H, W]`` in [-1, 1] -> float32 latents on the device."""
        with self._resident(self.vae) as vae, torch.no_grad():
            return vae.encode(video.to(self.device, _module_dtype(vae, self.dtype))).float()

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents -> uint8 ``[B, T, H, W, 3]`` on the CPU."""
        with self._resident(self.vae) as vae, torch.no_grad():
            return to_uint8_frames(vae.decode(latents.to(self.device, _module_dtype(vae, self.dtype))))

    def encode_reference(self, reference: torch.Tensor, cond_type: str, latent_size: Sequence[int]) -> torch.Tensor:
        """Reference ``[3, T, H, W]`` (already at the target size) -> its latent frames ``[1, C, k, h, w]``.

        ``i2v_*`` uses the first frame (repeated to fill one latent frame of a temporally compressing
        autoencoder). ``v2v_head`` takes the reference's first frames, ``v2v_tail`` its last ones, as many as
        the ``k`` given latent frames decode to; each keeps its place (head frames open the output, tail
        frames close it).
        """
        if cond_type not in REFERENCE_TYPES:
            raise ValueError(f"cond_type '{cond_type}' takes no reference; reference types: {REFERENCE_TYPES}")
        _, height, width = latent_size
        latent_frames = 1 if cond_type.startswith("i2v") else num_v2v_frames(latent_size[0], self.v2v_frames)
        pixel_frames = self.vae.get_video_size((latent_frames, height, width))[0]
        if cond_type.startswith("i2v"):
            clip = reference[:, :1].expand(-1, pixel_frames, -1, -1)
        else:
            if reference.shape[1] < pixel_frames:
                raise ValueError(
                    f"{cond_type} needs a reference video of at least {pixel_frames} frames "
                    f"({latent_frames} latent frames), got {reference.shape[1]}"
                )
            clip = reference[:, :pixel_frames] if cond_type == "v2v_head" else reference[:, -pixel_frames:]
        latent = self.encode_video(clip.unsqueeze(0))
        if latent.shape[2] != latent_frames:
            raise ValueError(f"reference encoded to {latent.shape[2]} latent frames, expected {latent_frames}")
        return latent

    def prepare_condition(
        self, batch: int, latent_size: Sequence[int], cond_type: str = "t2v", ref_latent: Optional[torch.Tensor] = None
    ) -> PreparedCondition:
        if cond_type not in CONDITION_TYPES:
            raise ValueError(f"unknown cond_type '{cond_type}'; expected one of {CONDITION_TYPES}")
        if cond_type != "t2v" and not self.uses_condition:
            raise ValueError(f"cond_type '{cond_type}' needs a model built with cond_channels (this one has none)")
        if not self.uses_condition:
            return PreparedCondition(None, None, False)
        channels = self.vae.latent_channels
        zeros = torch.zeros(batch, channels + 1, *latent_size, device=self.device)
        if cond_type == "t2v":
            return PreparedCondition(zeros, zeros, False)
        if ref_latent is None:
            raise ValueError(f"cond_type '{cond_type}' needs a reference (--ref PATH)")
        cond, _ = reference_condition(ref_latent.expand(batch, -1, -1, -1, -1), latent_size[0], cond_type)
        return PreparedCondition(cond, zeros, True)

    def set_cuda_graphs(self, enabled: bool) -> None:
        """Replay each sampling pass as a CUDA graph (``pass_graphs.PassGraphs``: one graph per pass shape, kept
        across videos). Only plain passes are graphed: an inference cache (``accelerator``) or sequence parallelism
        runs its own way, and off a GPU every pass is eager."""
        from .pass_graphs import PassGraphs

        self.pass_graphs = PassGraphs() if enabled and self.device.type == "cuda" else None

    def _model_fn(self, x, t, cond=None, text_mask_has_padding=None, **text):
        if self.accelerator is not None:
            network = functools.partial(self.accelerator, self.model)
        elif self.pass_graphs is not None and self.sp is None:
            network = functools.partial(self.pass_graphs, self.model)
        else:
            network = self.model
        return MMDiTAdapter.call_network(
            network, x, t, text, cond, self.dtype, text_mask_has_padding=text_mask_has_padding
        )

    def denoise(
        self,
        noise: torch.Tensor,
        text: Mapping,
        null_text: Mapping,
        condition: PreparedCondition,
        num_steps: Optional[int] = None,
        step_list: Optional[Sequence[float]] = None,
        guidance_scale: float = 1.0,
        image_guidance_scale: float = 1.0,
    ) -> torch.Tensor:
        """Euler-integrate ``noise`` to clean latents with CFG; reference frames are pasted into the result."""
        # one host sync here instead of one per model pass (MMDiT.key_mask inspects the mask otherwise)
        has_padding = not (bool(text["text_mask"].all()) and bool(null_text["text_mask"].all()))

        def kwargs(text_part, cond):
            out = dict(text_part, text_mask_has_padding=has_padding)
            if cond is not None:
                out["cond"] = cond
            return out

        cond_kwargs = kwargs(text, condition.cond)
        uncond_kwargs = kwargs(null_text, condition.cond)  # image kept, text dropped
        uncond_all = None
        if condition.has_reference and image_guidance_scale != 1.0:
            uncond_all = kwargs(null_text, condition.null)  # neither
        if self.accelerator is not None:  # one model call per step: the cache needs the step count
            self.accelerator.begin(
                num_steps if step_list is None else len(step_list) - (1 if float(step_list[-1]) == 0.0 else 0),
                noise.shape[0],
            )
        latents = sample(
            self._model_fn,
            noise,
            num_steps=None if step_list is not None else num_steps,
            shift_alpha=self.shift_alpha(noise.shape[2:]),
            cond_kwargs=cond_kwargs,
            uncond_kwargs=uncond_kwargs,
            uncond_all_kwargs=uncond_all,
            guidance_scale=guidance_scale,
            image_guidance_scale=image_guidance_scale if uncond_all is not None else 1.0,
            step_list=step_list,
            progress=self.progress,
        )
        if condition.has_reference:
            latents = paste_condition_frames(latents, condition.cond)
        return latents

    # ---- the entry point ----------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[str],
        seeds: Sequence[int],
        num_frames: int,
        height: int,
        width: int,
        num_steps: Optional[int] = 30,
        step_list: Optional[Sequence[float]] = None,
        guidance_scale: float = 7.5,
        image_guidance_scale: float = 1.0,
        cond_type: str = "t2v",
        ref: Union[str, torch.Tensor, None] = None,
        batch_size: Optional[int] = None,
        return_latents: bool = False,
    ):
        """uint8 videos ``[N, T, H, W, 3]`` (CPU) for ``prompts`` with per-sample ``seeds``.

        ``ref``: a path to an image/video or a float ``[3, T, H, W]`` tensor in [-1, 1] at ``(height, width)``;
        required for every ``cond_type`` but ``t2v``, shared by all prompts. ``step_list`` (explicit t values,
        few-step students) replaces ``num_steps``. ``batch_size`` (default: all at once) never changes the
        result. With ``return_latents`` returns ``(videos, latents)``. On a sequence-parallel rank other than 0
        (``not self.decodes``) nothing is decoded and ``videos`` is None; the latents are returned everywhere.
        """
        prompts, seeds = list(prompts), [int(s) for s in seeds]
        if len(prompts) != len(seeds) or not prompts:
            raise ValueError(f"need one seed per prompt (and at least one prompt); got {len(prompts)} and {len(seeds)}")
        if step_list is None and not num_steps:
            raise ValueError("give num_steps >= 1 or a step_list")
        latent_size = self.latent_size(num_frames, height, width)
        ref_latent = None
        if cond_type != "t2v":
            if ref is None:
                raise ValueError(f"cond_type '{cond_type}' needs a reference image or video (ref=...)")
            reference = load_reference(ref, (height, width)) if not isinstance(ref, torch.Tensor) else ref
            if tuple(reference.shape[-2:]) != (height, width):
                raise ValueError(f"reference is {tuple(reference.shape[-2:])}, expected {(height, width)}")
            ref_latent = self.encode_reference(reference, cond_type, latent_size)
        elif ref is not None:
            raise ValueError("a reference was given with cond_type 't2v'; pick i2v_* or v2v_* to use it")

        batch_size = int(batch_size or len(prompts))
        starts = range(0, len(prompts), batch_size)
        videos, latents_out = [], []
        for start in tqdm(starts, disable=not self.progress or len(starts) < 2, desc="batches"):
            chunk_prompts = prompts[start : start + batch_size]
            chunk_seeds = seeds[start : start + batch_size]
            text, null_text = self.encode_text(chunk_prompts)
            condition = self.prepare_condition(len(chunk_prompts), latent_size, cond_type, ref_latent)
            noise = seeded_noise(chunk_seeds, (self.vae.latent_channels, *latent_size), device=self.device)
            latents = self.denoise(
                noise, text, null_text, condition, num_steps, step_list, guidance_scale, image_guidance_scale
            )
            if self.decodes:
                videos.append(self.decode(latents))
            if return_latents:
                latents_out.append(latents.cpu())
        videos = torch.cat(videos) if videos else None
        return (videos, torch.cat(latents_out)) if return_latents else videos
