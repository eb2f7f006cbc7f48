"""Building blocks of the MMDiT: embedders, adaLN-zero modulation, double- and single-stream blocks.

Shapes: token streams are [B, N, hidden]; ``vec`` (timestep + pooled text [+ guidance]) is [B, hidden];
``rope`` is the (cos, sin) pair for the joint sequence (text first, then video); ``mask`` is a boolean key
mask broadcastable to [B, heads, N, N] or ``None``.

``kv_hook`` (optional, every block): a callable ``(k, v, mask) -> (k, v, mask)`` applied to the joint sequence's
keys and values after RoPE, before attention (or an ``attention.RowGroups``: per group of batch rows its own
keys/values, each group attended without a mask). It is the one seam through which inference accelerations see
attention: a streaming KV cache prepends the keys/values of earlier chunks, a region cache adds those of tokens it
did not recompute. Queries are never touched, so the block's output keeps the shape of its input.
"""

import math
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from opensora.parallel.sampling_exchange import exchanged_attention
from opensora.parallel.sequence_parallel import attention_row_by_row, heads_to_tokens, tokens_to_heads

from .attention import RowGroups, attention
from .rope import apply_rope_qk, rotate_pairs

LN_EPS = 1e-6


def timestep_embedding(t: torch.Tensor, dim: int = 256, scale: float = 1000.0, max_period: float = 10000.0):
    """Sinusoidal features of ``scale * t`` [B] -> [B, dim] (cos half first, then sin), fp32."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = (t.float() * scale)[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class MLPEmbedder(nn.Module):
    """Linear -> SiLU -> Linear: maps timestep features / pooled text to the hidden size."""

    def __init__(self, in_dim: int, hidden_size: int):
        super().__init__()
        self.in_layer = nn.Linear(in_dim, hidden_size)
        self.out_layer = nn.Linear(hidden_size, hidden_size)

    def forward(self, x):
        return self.out_layer(F.silu(self.in_layer(x)))


class QKNorm(nn.Module):
    """RMSNorm of queries and keys per head (learned scale), which keeps attention logits bounded."""

    def __init__(self, head_dim: int):
        super().__init__()
        self.query_scale = nn.Parameter(torch.ones(head_dim))
        self.key_scale = nn.Parameter(torch.ones(head_dim))

    def forward(self, q, k):
        # Scales in the activation dtype, so the fused kernel runs under autocast.
        d = q.shape[-1:]
        q = F.rms_norm(q, d, self.query_scale.to(q.dtype), LN_EPS)
        return q, F.rms_norm(k, d, self.key_scale.to(k.dtype), LN_EPS)


class Modulation(nn.Module):
    """adaLN-zero: ``vec`` -> ``count`` (shift, scale, gate) triples; zero-initialised so blocks start as identity."""

    def __init__(self, hidden_size: int, count: int):
        super().__init__()
        self.count = count
        self.lin = nn.Linear(hidden_size, 3 * count * hidden_size)
        nn.init.zeros_(self.lin.weight)
        nn.init.zeros_(self.lin.bias)

    def forward(self, vec):
        return self.lin(F.silu(vec))[:, None, :].chunk(3 * self.count, dim=-1)


def modulate(x, shift, scale):
    """``(1 + scale) * layer_norm(x) + shift``."""
    return torch.addcmul(shift, F.layer_norm(x, x.shape[-1:], eps=LN_EPS), 1 + scale)


def gated_residual(x, gate, update):
    """``x + gate * update`` in one kernel."""
    return torch.addcmul(x, gate, update)


def split_heads(qkv: torch.Tensor, num_heads: int):
    """[B, N, 3*hidden] -> q, k, v each [B, heads, N, head_dim]."""
    b, n, _ = qkv.shape
    return qkv.view(b, n, 3, num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)


class StreamAttention(nn.Module):
    """Fused QKV projection + QK-norm for one stream; the attention itself is joint and done by the block."""

    def __init__(self, hidden_size: int, num_heads: int, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=qkv_bias)
        self.norm = QKNorm(hidden_size // num_heads) if qk_norm else None
        self.proj = nn.Linear(hidden_size, hidden_size)

    def qkv_heads(self, x):
        q, k, v = split_heads(self.qkv(x), self.num_heads)
        if self.norm is not None:
            q, k = self.norm(q, k)
        return q, k, v


def mlp(hidden_size: int, mlp_ratio: float) -> nn.Sequential:
    mlp_hidden = int(hidden_size * mlp_ratio)
    return nn.Sequential(
        nn.Linear(hidden_size, mlp_hidden), nn.GELU(approximate="tanh"), nn.Linear(mlp_hidden, hidden_size)
    )


def uses_sampling_exchange(sp, kv_hook) -> bool:
    """Whether attention under sequence parallelism takes the copy-saving sampling exchange (sampling_exchange.py):
    no autograd, no kv_hook, and neither the row-by-row overlap nor the training path asked for."""
    return (
        sp is not None
        and kv_hook is None
        and sp.sampling_exchange != "old"
        and not sp.overlap_rows
        and not torch.is_grad_enabled()
    )


def joint_attention_of_streams(streams, rope, mask, backend, sp=None, kv_hook=None):
    """``joint_attention`` of the token-concatenation of ``streams`` (one (q, k, v) per stream, text first), which
    the sampling exchange reads without concatenating."""
    if uses_sampling_exchange(sp, kv_hook):
        return exchanged_attention(
            streams,
            rope,
            rotate_pairs,
            lambda q, k, v: attention(q, k, v, mask=mask, backend=backend),
            sp,
            sp.sampling_exchange,
            sp.exchange_issue,
        )
    q, k, v = (torch.cat(parts, dim=2) for parts in zip(*streams))
    return joint_attention(q, k, v, rope, mask, backend, sp, kv_hook)


def joint_attention(q, k, v, rope, mask, backend, sp=None, kv_hook=None):
    """RoPE on this rank's q/k, then attention over the joint sequence -> [B, N_local, hidden]. With sequence
    parallelism (``sp``, see opensora.parallel.sequence_parallel) q/k/v hold this rank's tokens and are exchanged for a head split
    around the attention. ``kv_hook`` (see the module docstring) may extend keys, values and the mask."""
    q, k = apply_rope_qk(q, k, *rope)
    if kv_hook is not None:
        if sp is not None:
            raise ValueError("a kv_hook (KV cache / region cache) cannot be combined with sequence parallelism")
        hooked = kv_hook(k, v, mask)
        if isinstance(hooked, RowGroups):  # groups of rows with key sets of their own, no mask
            return hooked.attend(q, backend)
        k, v, mask = hooked
    if sp is None:
        return attention(q, k, v.contiguous(), mask=mask, backend=backend)
    if (
        sp.overlap_rows and len(q) > 1 and not torch.is_grad_enabled()
    ):  # sampling: overlap the exchanges with attention, row by row

        def attend_row(q, k, v, row):
            row_mask = mask[row : row + 1] if mask is not None and len(mask) > 1 else mask
            return attention(q, k, v, mask=row_mask, backend=backend)

        return attention_row_by_row(q, k, v, sp, attend_row)
    q, k, v = tokens_to_heads(q, k, v, sp=sp)
    return heads_to_tokens(attention(q, k, v, mask=mask, backend=backend), sp)


class DoubleStreamBlock(nn.Module):
    """Separate weights for text and video tokens; one attention over the concatenated (text, video) sequence."""

    def __init__(self, hidden_size, num_heads, mlp_ratio, qkv_bias=True, qk_norm=True, attn_backend="auto"):
        super().__init__()
        self.attn_backend = attn_backend
        self.sp = None  # a SequenceGroup when sequence parallel (MMDiT.set_sequence_parallel)
        self.img_mod = Modulation(hidden_size, 2)
        self.img_attn = StreamAttention(hidden_size, num_heads, qkv_bias, qk_norm)
        self.img_mlp = mlp(hidden_size, mlp_ratio)
        self.txt_mod = Modulation(hidden_size, 2)
        self.txt_attn = StreamAttention(hidden_size, num_heads, qkv_bias, qk_norm)
        self.txt_mlp = mlp(hidden_size, mlp_ratio)

    def forward(
        self, img, txt, vec, rope, mask: Optional[torch.Tensor], kv_hook=None
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``txt=None``: the text rows are not run (a causal model's text cache, causal.py ``TextKVCache``): the
        ``kv_hook`` supplies the text keys/values, ``rope`` and ``mask`` cover the video queries only, and the
        returned text is None."""
        i_shift1, i_scale1, i_gate1, i_shift2, i_scale2, i_gate2 = self.img_mod(vec)
        img_q, img_k, img_v = self.img_attn.qkv_heads(modulate(img, i_shift1, i_scale1))
        if txt is None:
            if kv_hook is None:
                raise ValueError("a video-only pass (txt=None) needs a kv_hook that supplies the text keys/values")
            out = joint_attention(img_q, img_k, img_v, rope, mask, self.attn_backend, self.sp, kv_hook)
            img = gated_residual(img, i_gate1, self.img_attn.proj(out))
            return gated_residual(img, i_gate2, self.img_mlp(modulate(img, i_shift2, i_scale2))), None
        t_shift1, t_scale1, t_gate1, t_shift2, t_scale2, t_gate2 = self.txt_mod(vec)
        txt_q, txt_k, txt_v = self.txt_attn.qkv_heads(modulate(txt, t_shift1, t_scale1))
        streams = ((txt_q, txt_k, txt_v), (img_q, img_k, img_v))
        out = joint_attention_of_streams(streams, rope, mask, self.attn_backend, self.sp, kv_hook)
        txt_len = txt.shape[1]
        txt_out, img_out = out[:, :txt_len], out[:, txt_len:]

        img = gated_residual(img, i_gate1, self.img_attn.proj(img_out))
        img = gated_residual(img, i_gate2, self.img_mlp(modulate(img, i_shift2, i_scale2)))
        txt = gated_residual(txt, t_gate1, self.txt_attn.proj(txt_out))
        txt = gated_residual(txt, t_gate2, self.txt_mlp(modulate(txt, t_shift2, t_scale2)))
        return img, txt


class SingleStreamBlock(nn.Module):
    """One set of weights for all tokens; QKV and the MLP input share one linear, attention+MLP out another."""

    def __init__(self, hidden_size, num_heads, mlp_ratio, qkv_bias=True, qk_norm=True, attn_backend="auto"):
        super().__init__()
        self.attn_backend = attn_backend
        self.sp = None  # a SequenceGroup when sequence parallel (MMDiT.set_sequence_parallel)
        self.num_heads = num_heads
        self.hidden_size = hidden_size
        self.mlp_hidden = int(hidden_size * mlp_ratio)
        self.modulation = Modulation(hidden_size, 1)
        # qkv_bias only applies to the qkv part; a single fused linear has one bias, so keep it always on.
        self.linear1 = nn.Linear(hidden_size, 3 * hidden_size + self.mlp_hidden)
        self.linear2 = nn.Linear(hidden_size + self.mlp_hidden, hidden_size)
        self.norm = QKNorm(hidden_size // num_heads) if qk_norm else None
        self.mlp_act = nn.GELU(approximate="tanh")

    def forward(self, x, vec, rope, mask: Optional[torch.Tensor], kv_hook=None) -> torch.Tensor:
        shift, scale, gate = self.modulation(vec)
        qkv, mlp_in = self.linear1(modulate(x, shift, scale)).split([3 * self.hidden_size, self.mlp_hidden], -1)
        q, k, v = split_heads(qkv, self.num_heads)
        if self.norm is not None:
            q, k = self.norm(q, k)
        if uses_sampling_exchange(self.sp, kv_hook):  # reads q/k/v in place, no contiguous copies
            out = joint_attention_of_streams(((q, k, v),), rope, mask, self.attn_backend, self.sp, kv_hook)
        else:
            out = joint_attention(q.contiguous(), k.contiguous(), v, rope, mask, self.attn_backend, self.sp, kv_hook)
        return gated_residual(x, gate, self.linear2(torch.cat((out, self.mlp_act(mlp_in)), dim=-1)))


class FinalLayer(nn.Module):
    """adaLN (shift, scale) + linear to patch values; both zero-initialised so the model starts at output 0."""

    def __init__(self, hidden_size: int, out_features: int):
        super().__init__()
        self.adaLN_modulation = nn.Linear(hidden_size, 2 * hidden_size)
        self.linear = nn.Linear(hidden_size, out_features)
        for layer in (self.adaLN_modulation, self.linear):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x, vec):
        shift, scale = self.adaLN_modulation(F.silu(vec))[:, None, :].chunk(2, dim=-1)
        return self.linear(modulate(x, shift, scale))
