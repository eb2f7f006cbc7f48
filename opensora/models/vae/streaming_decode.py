"""Exact-once chunk decode of HunyuanVideo's causal 3D VAE decoder (diffusers ``HunyuanVideoDecoder3D``).

A streamed video is decoded chunk by chunk, each latent frame once, by a small driver over the diffusers decoder's
own layers and weights (``conv_in``, the mid block's resnets and attention, the up blocks' resnets and upsamplers,
``conv_norm_out`` / ``conv_out``), in their order. Three things in that network see more than one frame:

* causal temporal convs: each keeps the trailing input frames it needs from the previous chunk
  (``conv_cache.CausalConvCache``), so its time padding comes from real frames, never from replication, after the
  first chunk; its convolutions then equal the whole clip's exactly;
* the temporal upsamplers: the whole clip upsamples frame 0 in space only and every other frame 2x in time, so the
  first chunk does the same and every later chunk upsamples all its frames 2x;
* the mid block's attention is causal over frames: its keys/values of the last ``attention_window`` latent frames
  are kept (exact while the clip is no longer than the window plus one chunk; a rolling window beyond, so memory
  stays flat);
* every GroupNorm reduces over time as well, so a chunk cannot see the statistics of the whole clip (the future is not
  decoded yet). ``stats`` makes the rule explicit:

  - ``"running"``: the statistics over every frame seen so far, this chunk included (merged exactly by Chan's rule);
  - ``"chunk"``: the statistics of the chunk alone;
  - ``"fixed"``: statistics given by the caller (``fixed_stats``, e.g. recorded from a whole-clip decode with
    ``record_stats``): with the whole clip's own statistics the chunked decode equals the whole-clip decode.

  ``benchmarks/streaming_decode.py`` measures each rule's deviation from the whole-clip decode.

The first chunk (``first=True``) starts a clip; later chunks continue it. State lives in tensors updated in place, so
a CUDA graph of a chunk decode replays it (``decode_graphs``). On a GPU with Triton the norms run as
``fused_group_norm`` (statistics over the whole GPU, normalisation + SiLU written into the next conv's padded input).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .conv_cache import CausalConvCache
from .fused_group_norm import group_moments, norm_affine, normalize_into, upsample_into
from .phase_upsample import PhaseUpsampleConv
from .score_attention import fp32_output_gemm, fp32_score_attention

STATS_RULES = ("running", "chunk", "fixed")
ATTENTION_KERNELS = ("sdpa", "fp32-scores")
UPSAMPLE_RULES = ("phase", "direct")
DEFAULT_ATTENTION_WINDOW = 8  # latent frames of earlier chunks the mid-block attention sees (a 33-frame clip: exact)


class NormStatistics:
    """The statistics rule of one GroupNorm across the chunks of a clip (module docstring): state tensors (count,
    mean, centred sum of squares per (sample, group), fp64) updated in place."""

    def __init__(self, norm: nn.GroupNorm, rule: str, fixed: Optional[tuple] = None):
        if rule not in STATS_RULES:
            raise ValueError(f"stats rule must be one of {STATS_RULES}, got {rule!r}")
        if rule == "fixed" and fixed is None:
            raise ValueError("the fixed statistics rule needs the statistics of every norm (fixed_stats)")
        self.norm, self.rule, self.fixed = norm, rule, fixed
        self.count = self.mean = self.m2 = None
        self.recorded: Optional[tuple] = None

    def __call__(self, x: torch.Tensor, first: bool, record: bool = False):
        """(mean, var) [N, G] to normalise chunk ``x`` with; updates the running state."""
        if self.rule == "fixed":
            mean, var = (t.to(x.device) for t in self.fixed)
        else:
            count, mean, var = group_moments(x, self.norm.num_groups)
            if self.rule == "running":
                mean, var = self._merge(count, mean, var, first)
        if record:
            self.recorded = (mean.detach().float().cpu(), var.detach().float().cpu())
        return mean, var

    def _merge(self, count: int, mean: torch.Tensor, var: torch.Tensor, first: bool):
        mean64, m2 = mean.double(), var.double() * count
        if first or self.count is None:
            if self.count is None or self.mean.shape != mean.shape:
                self.count = torch.zeros((), dtype=torch.float64, device=mean.device)
                self.mean, self.m2 = torch.empty_like(mean64), torch.empty_like(m2)
            self.count.fill_(count)
            self.mean.copy_(mean64)
            self.m2.copy_(m2)
        else:  # Chan's rule with the frames seen so far (device tensors: no host read, graph-safe)
            total = self.count + count
            delta = mean64 - self.mean
            self.m2.add_(m2 + delta.square() * (self.count * count / total))
            self.mean.add_(delta * (count / total))
            self.count.copy_(total)
        return self.mean.float(), (self.m2 / self.count).float()


class FrameCausalAttentionCache:
    """The mid block's frame-causal attention (diffusers ``Attention`` with its group norm, residual and output
    projection) over a chunk, with the keys/values of the last ``window`` earlier latent frames kept in a static
    buffer (right-aligned: the newest frame last). Each query frame attends to the cached frames and to the chunk's
    frames up to its own, one unmasked SDPA call per query frame (the whole clip's mask, without building it)."""

    def __init__(self, attn, window: int, norm_stats: NormStatistics, kernel: str = "sdpa"):
        if kernel not in ATTENTION_KERNELS:
            raise ValueError(f"attention kernel must be one of {ATTENTION_KERNELS}, got {kernel!r}")
        if (
            attn.spatial_norm is not None
            or attn.norm_q is not None
            or attn.norm_k is not None
            or attn.is_cross_attention
        ):
            raise ValueError("unsupported attention layout for the chunked decoder")
        self.attn, self.window, self.stats, self.kernel = attn, int(window), norm_stats, kernel
        if kernel == "fp32-scores":
            fp32_output_gemm(attn.to_q.weight.device)  # probed here, never inside a graph capture
        self.keys = self.values = None

    def __call__(self, x: torch.Tensor, first: bool, cached: int, record: bool, normalize) -> torch.Tensor:
        attn = self.attn
        b, c, t, h, w = x.shape
        hw, heads = h * w, attn.heads
        normed = torch.empty_like(x)  # x's memory format: tokens below are a view for channels-last
        normalize(self.stats, x, normed, silu=False, first=first, record=record)
        tokens = normed.permute(0, 2, 3, 4, 1).reshape(b, t * hw, c)  # [B, T*H*W, C]

        def split_heads(proj):
            return proj(tokens).view(b, t * hw, heads, -1).transpose(1, 2)

        query, key, value = split_heads(attn.to_q), split_heads(attn.to_k), split_heads(attn.to_v)
        cached = 0 if first else min(cached, self.window)
        if self.window and cached and self.keys is None:
            raise RuntimeError("attention cache read before it was filled: start the clip with first=True")
        if cached:
            span = cached * hw
            key = torch.cat((self.keys[:, :, -span:], key), dim=2)
            value = torch.cat((self.values[:, :, -span:], value), dim=2)
        outs = []
        for frame in range(t):  # query frame sees the cache and the chunk's frames up to its own
            end = (cached + frame + 1) * hw
            q = query[:, :, frame * hw : (frame + 1) * hw]
            attend = F.scaled_dot_product_attention if self.kernel == "sdpa" else fp32_score_attention
            outs.append(attend(q, key[:, :, :end], value[:, :, :end]))
        self._keep(key, value, cached + t, hw)
        out = torch.cat(outs, dim=2).transpose(1, 2).reshape(b, t * hw, -1)
        out = attn.to_out[1](attn.to_out[0](out))
        residual = x.permute(0, 2, 3, 4, 1).reshape(b, t * hw, c)
        out = (out + residual) / attn.rescale_output_factor if attn.residual_connection else out
        return out.view(b, t, h, w, c).permute(0, 4, 1, 2, 3)  # channels-last layout

    def _keep(self, key: torch.Tensor, value: torch.Tensor, frames: int, hw: int) -> None:
        if not self.window:
            return
        if self.keys is None or self.keys.shape[2] != self.window * hw or self.keys.shape[:2] != key.shape[:2]:
            shape = (*key.shape[:2], self.window * hw, key.shape[3])
            self.keys = key.new_empty(shape)
            self.values = value.new_empty(shape)
        keep = min(frames, self.window) * hw
        self.keys[:, :, -keep:].copy_(key[:, :, -keep:])
        self.values[:, :, -keep:].copy_(value[:, :, -keep:])


class StreamingDecoder:
    """Decodes consecutive latent chunks of a clip through the diffusers decoder's layers, each frame once.

    Args:
        vae: the diffusers ``AutoencoderKLHunyuanVideo`` (its ``post_quant_conv`` and ``decoder`` are used).
        stats: GroupNorm statistics rule, ``"running"`` / ``"chunk"`` / ``"fixed"`` (module docstring).
        attention_window: latent frames of earlier chunks kept for the mid block's attention.
        fixed_stats: for ``stats="fixed"``: one (mean [N, G], var [N, G]) per GroupNorm in ``norm_order``.
        attention_kernel: ``"sdpa"`` (PyTorch's fused attention) or ``"fp32-scores"`` (``score_attention``: two
            GEMMs, for the 512-wide head the flash / cuDNN kernels do not take). ``None`` (default): fp32-scores for
            a VAE on the GPU, sdpa elsewhere.
        channels_last: activations in ``torch.channels_last_3d``: cuDNN runs these convs NDHWC, so a contiguous
            layout pays a conversion on each side of every conv (31 ms of a 221 ms chunk at 480x832 on an H200); the
            fused kernels read and write channels contiguously in that layout. ``None`` (default): on for a VAE on
            the GPU (one 480x832 chunk of 3 latent frames, H200, interleaved: 182 ms vs 222 ms contiguous), off on
            the CPU (the layout the exact-cache CPU tests pin).
        upsample: ``"phase"`` (default): each upsampler's conv at the low resolution, one sub-pixel phase at a time
            (``phase_upsample``: 3.4x fewer FLOPs for the (2, 2, 2) upsamplers, a third of the decoder's conv FLOPs at
            480x832); ``"direct"``: nearest upsampling into the conv's padded input, then the 3x3x3 conv.

    ``decode(z, first)``: z are raw latents [B, C, t, h, w] (after the latent normalisation is undone); returns the
    chunk's pixel frames [B, 3, F, H, W] in z's dtype (F = 1 + 4 (t - 1) for the first chunk, 4 t after).
    """

    def __init__(
        self,
        vae,
        stats: str = "running",
        attention_window: int = DEFAULT_ATTENTION_WINDOW,
        fixed_stats: Optional[List[tuple]] = None,
        attention_kernel: Optional[str] = None,
        channels_last: Optional[bool] = None,
        upsample: str = "phase",
    ):
        from diffusers.models.autoencoders.autoencoder_kl_hunyuan_video import HunyuanVideoCausalConv3d

        if attention_window < 0:
            raise ValueError(f"attention_window must be >= 0, got {attention_window}")
        if upsample not in UPSAMPLE_RULES:
            raise ValueError(f"upsample must be one of {UPSAMPLE_RULES}, got {upsample!r}")
        self.vae, self.decoder = vae, vae.decoder
        self.stats_rule, self.attention_window = stats, int(attention_window)
        self.norm_order = [m for m in self.decoder.modules() if isinstance(m, nn.GroupNorm)]
        if fixed_stats is not None and len(fixed_stats) != len(self.norm_order):
            raise ValueError(f"fixed_stats needs {len(self.norm_order)} entries, got {len(fixed_stats)}")
        self.stats: Dict[int, NormStatistics] = {
            id(norm): NormStatistics(norm, stats, None if fixed_stats is None else fixed_stats[i])
            for i, norm in enumerate(self.norm_order)
        }
        self.convs: Dict[int, CausalConvCache] = {
            id(m): CausalConvCache.of(m) for m in self.decoder.modules() if isinstance(m, HunyuanVideoCausalConv3d)
        }
        self.upsamplers: Dict[int, PhaseUpsampleConv] = {}
        if upsample == "phase":
            self.upsamplers = {
                id(up): PhaseUpsampleConv(up) for b in self.decoder.up_blocks for up in b.upsamplers or ()
            }
        on_gpu = next(vae.parameters()).device.type == "cuda"
        if attention_kernel is None:
            attention_kernel = "fp32-scores" if on_gpu else "sdpa"
        mid = self.decoder.mid_block
        self.attentions = [
            None
            if a is None
            else FrameCausalAttentionCache(a, attention_window, self.stats[id(a.group_norm)], attention_kernel)
            for a in mid.attentions
        ]
        self.frames_seen = 0  # latent frames decoded in this clip (host state: which graph a chunk replays)
        self.record = False
        if channels_last is None:
            channels_last = on_gpu
        self.channels_last = bool(channels_last)
        self.fmt = torch.channels_last_3d if self.channels_last else torch.contiguous_format

    # --- state -----------------------------------------------------------------------------------------------
    def state_tensors(self) -> List[torch.Tensor]:
        """Every tensor the next chunk reads (conv caches, running statistics, attention keys/values)."""
        tensors = [c.cache for c in self.convs.values()] + [u.cache for u in self.upsamplers.values()]
        tensors += [t for s in self.stats.values() for t in (s.count, s.mean, s.m2)]
        tensors += [t for a in self.attentions if a is not None for t in (a.keys, a.values)]
        return [t for t in tensors if t is not None]

    def refresh(self) -> None:
        """Bring derived weights (the phase upsamplers' merged taps) up to the VAE's current weights; graph replays
        do not run the Python that would (``ExactChunkDecode`` calls this before each replay)."""
        for upsampler in self.upsamplers.values():
            upsampler.refresh()

    def recorded_stats(self) -> List[tuple]:
        """(mean, var) of every norm from the last ``decode(..., record=True)`` (``fixed_stats`` input)."""
        return [self.stats[id(n)].recorded for n in self.norm_order]

    # --- the network ------------------------------------------------------------------------------------------
    def _normalize(self, stats: NormStatistics, x, out, silu: bool, first: bool, record: bool, border: int = 0):
        """Normalise x into ``out``; True if its replicated ``border`` was written too (``normalize_into``)."""
        norm = stats.norm
        mean, var = stats(x, first, record)
        scale, shift = norm_affine(mean, var, x.shape[1], norm.weight, norm.bias, norm.eps)
        return normalize_into(x.contiguous(memory_format=self.fmt), scale, shift, out, silu, border)

    def _norm_act_conv(self, norm, conv_module, x, first: bool) -> torch.Tensor:
        """conv(SiLU(norm(x))) with the normalised activations (and, where the kernel can, the replicated border)
        written into the conv's padded input."""
        conv = self.convs[id(conv_module)]
        padded = conv.new_input(x, fmt=self.fmt)
        padded.border_filled = self._normalize(
            self.stats[id(norm)], x, padded.interior, True, first, self.record, padded.border
        )
        return conv.run(padded, first)

    def _resnet(self, block, x: torch.Tensor, first: bool) -> torch.Tensor:
        x = x.contiguous(memory_format=self.fmt)
        h = self._norm_act_conv(block.norm1, block.conv1, x, first)
        h = block.dropout(h)  # identity at inference; kept so the layer order is the block's
        h = self._norm_act_conv(block.norm2, block.conv2, h, first)
        residual = x if block.conv_shortcut is None else self.convs[id(block.conv_shortcut)](x, first, self.fmt)
        return h.add_(residual)

    def _upsample(self, up, x: torch.Tensor, first: bool) -> torch.Tensor:
        """Nearest upsampling written into the conv's padded input: the first frame of a clip in space only (or the
        same at the low resolution, ``phase_upsample``)."""
        if id(up) in self.upsamplers:
            return self.upsamplers[id(up)](x, first, self.fmt)
        ft, fh, fw = (int(f) for f in up.upsample_factor)
        conv = self.convs[id(up.conv)]
        b, c, t, h, w = x.shape
        single = 1 if first else 0
        padded = conv.new_input(x, frames=single + (t - single) * ft, size=(h * fh, w * fw), fmt=self.fmt)
        upsample_into(x.contiguous(memory_format=self.fmt), padded.interior, (ft, fh, fw), first)
        return conv.run(padded, first)

    @torch.no_grad()
    def decode(self, z: torch.Tensor, first: bool) -> torch.Tensor:
        if z.dim() != 5:
            raise ValueError(f"decode expects latents [B, C, t, h, w], got shape {tuple(z.shape)}")
        if not first and self.frames_seen == 0:
            raise RuntimeError("a later chunk before the first one: decode the clip's first chunk with first=True")
        dec = self.decoder
        cached = 0 if first else self.frames_seen
        x = self.vae.post_quant_conv(z).contiguous(memory_format=self.fmt)
        x = self.convs[id(dec.conv_in)](x, first, self.fmt)
        mid = dec.mid_block
        x = self._resnet(mid.resnets[0], x, first)
        for attention, resnet in zip(self.attentions, mid.resnets[1:]):
            if attention is not None:
                x = attention(x, first, cached, self.record, self._normalize)
            x = self._resnet(resnet, x, first)
        for block in dec.up_blocks:
            for resnet in block.resnets:
                x = self._resnet(resnet, x, first)
            for up in block.upsamplers or ():
                x = self._upsample(up, x, first)
        x = self._norm_act_conv(dec.conv_norm_out, dec.conv_out, x, first)
        self.frames_seen = (0 if first else self.frames_seen) + z.shape[2]
        return x

    def decode_clip(self, z: torch.Tensor, chunk_frames: int) -> torch.Tensor:
        """A whole clip as consecutive chunks of ``chunk_frames`` latent frames (the last may be shorter)."""
        parts = [self.decode(z[:, :, s : s + chunk_frames], s == 0) for s in range(0, z.shape[2], chunk_frames)]
        return torch.cat(parts, dim=2)


def whole_clip_stats(vae, z: torch.Tensor) -> List[tuple]:
    """Every decoder GroupNorm's (mean, var) over the whole clip ``z`` (one chunk: the clip's own statistics)."""
    decoder = StreamingDecoder(vae, stats="chunk", attention_window=z.shape[2])
    decoder.record = True
    decoder.decode(z, first=True)
    return decoder.recorded_stats()
