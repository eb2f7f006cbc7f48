"""Key layout of Open-Sora 2.0's MMDiT (``MMDiTModel``, Flux-derived) <-> ours.

Open-Sora 2.0 packs 2x2 latent patches outside the model (``(c, ph, pw)`` features, mask channel first in the
condition input), which is our patchify order for pt = 1, so ``img_in``/``cond_in``/``final_layer.linear`` keep
their shapes. Its released checkpoint uses ``fused_qkv=False`` (separate q/k/v projections; the single blocks'
value projection fused with the MLP input as ``v_mlp``); Flux itself uses fused ``qkv``/``linear1``. Both import;
``to_opensora2(..., fused_qkv=...)`` picks the export form.

=========================================================  =============================================
ours                                                       Open-Sora 2.0
=========================================================  =============================================
img_in, cond_in, txt_in, time_in.*, vector_in.*,           same names
guidance_in.*, {double,single}_blocks.N.* not listed below
double_blocks.N.{img,txt}_attn.norm.query_scale            double_blocks.N.{img,txt}_attn.norm.query_norm.scale
double_blocks.N.{img,txt}_attn.norm.key_scale              double_blocks.N.{img,txt}_attn.norm.key_norm.scale
double_blocks.N.{img,txt}_attn.qkv                         .qkv (fused) | .q_proj, .k_proj, .v_proj (split)
single_blocks.N.norm.{query,key}_scale                     single_blocks.N.norm.{query,key}_norm.scale
single_blocks.N.linear1 ([q, k, v, mlp_in] rows)           .linear1 (fused) | .q_proj, .k_proj, .v_mlp (split)
final_layer.adaLN_modulation (Linear)                      final_layer.adaLN_modulation.1 (SiLU, Linear)
=========================================================  =============================================

RoPE channel pairing. Our RoPE (and Flux's, and Open-Sora 2.0's ``use_liger_rope=False`` path) rotates adjacent
channel pairs ``(2j, 2j+1)`` of each head by frequency ``f[j]``; Open-Sora 2.0's shipped configs set
``use_liger_rope=True``, whose kernel rotates half-split pairs ``(j, j + D/2)`` by the same ``f[j]`` (its cos/sin are
the per-axis frequencies concatenated, then repeated twice). Both use the same frequency list, so the conversion is
one permutation of each head's channels, whatever the RoPE axis split: our channel ``2j`` is their ``j`` and ``2j+1``
is their ``j + D/2``. It is applied to the q and k projection rows (weights and biases) and to the q/k RMSNorm scales
(a per-channel scale moves with its channel; the norm itself does not care about order); q.k, and so attention, is
unchanged because q and k are permuted alike. ``v`` and everything else keep their order.
"""

import re
from typing import List

import torch

from .keymap import Rule, StateDict, export_state, hidden_size_of, import_state

LAYOUT = "opensora2"


def _rules(fused_qkv: bool) -> List[Rule]:
    same = [
        "img_in",
        "cond_in",
        "txt_in",
        "time_in.in_layer",
        "time_in.out_layer",
        "vector_in.in_layer",
        "vector_in.out_layer",
        "guidance_in.in_layer",
        "guidance_in.out_layer",
        "final_layer.linear",
    ]
    rules = [Rule(name, name) for name in same]
    rules.append(Rule("final_layer.adaLN_modulation", "final_layer.adaLN_modulation.1"))
    for stream in ("img", "txt"):
        block = "double_blocks.{i}." + stream
        for name in ("_mod.lin", "_attn.proj", "_mlp.0", "_mlp.2"):
            rules.append(Rule(block + name, block + name))
        rules += [
            Rule(block + "_attn.norm.query_scale", block + "_attn.norm.query_norm.scale"),
            Rule(block + "_attn.norm.key_scale", block + "_attn.norm.key_norm.scale"),
        ]
        if fused_qkv:
            rules.append(Rule(block + "_attn.qkv", block + "_attn.qkv"))
        else:
            parts = tuple(f"{block}_attn.{p}_proj" for p in "qkv")
            rules.append(Rule(block + "_attn.qkv", parts, split=(1, 1, 1)))
    single = "single_blocks.{i}."
    rules += [
        Rule(single + "modulation.lin", single + "modulation.lin"),
        Rule(single + "linear2", single + "linear2"),
        Rule(single + "norm.query_scale", single + "norm.query_norm.scale"),
        Rule(single + "norm.key_scale", single + "norm.key_norm.scale"),
    ]
    if fused_qkv:
        rules.append(Rule(single + "linear1", single + "linear1"))
    else:
        parts = (single + "q_proj", single + "k_proj", single + "v_mlp")
        rules.append(Rule(single + "linear1", parts, split=(1, 1, None)))
    return rules


def to_opensora2(state: StateDict, fused_qkv: bool = False) -> StateDict:
    """Our MMDiT state dict -> Open-Sora 2.0 ``MMDiTModel`` keys (``fused_qkv=False`` = the released v2 form)."""
    return export_state(state, _rules(fused_qkv), hidden_size_of(state, "img_in.weight"), LAYOUT)


def is_fused_qkv(state: StateDict) -> bool:
    """Whether an Open-Sora 2.0 state dict uses fused ``qkv``/``linear1`` (Flux form) or split projections."""
    fused = any(k.endswith("_attn.qkv.weight") or k.endswith(".linear1.weight") for k in state)
    split = any(k.endswith("_attn.q_proj.weight") or k.endswith(".v_mlp.weight") for k in state)
    if fused and split:
        raise ValueError("Open-Sora 2.0 state dict mixes fused (qkv/linear1) and split (q_proj/v_mlp) projections")
    return fused


def from_opensora2(state: StateDict) -> StateDict:
    """Open-Sora 2.0 ``MMDiTModel`` state dict (fused or split QKV, detected) -> our MMDiT keys."""
    return import_state(state, _rules(is_fused_qkv(state)), LAYOUT)


HALF_SPLIT = "half-split"  # use_liger_rope=True: what Open-Sora 2.0 ships
ADJACENT = "adjacent"  # use_liger_rope=False (Flux's pairing, and ours)
ROPE_PAIRINGS = (HALF_SPLIT, ADJACENT)
_QK_ROWS = re.compile(r"^(double_blocks\.\d+\.(img|txt)_attn\.qkv|single_blocks\.\d+\.linear1)\.(weight|bias)$")
_QK_SCALE = re.compile(r"^(double_blocks\.\d+\.(img|txt)_attn\.norm|single_blocks\.\d+\.norm)\.(query|key)_scale$")


def half_split_order(head_dim: int) -> torch.Tensor:
    """Channel order of a head in the half-split pairing: position ``i`` takes our channel ``order[i]``."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head dimension, got {head_dim}")
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def _permute_rows(tensor: torch.Tensor, head_dim: int, order: torch.Tensor, rows: int) -> torch.Tensor:
    """Permute each head's channels within the first ``rows`` rows of ``tensor`` (heads of ``head_dim``)."""
    head_part = tensor[:rows].unflatten(0, (-1, head_dim))[:, order].flatten(0, 1)
    return torch.cat([head_part, tensor[rows:]]) if rows < tensor.shape[0] else head_part


def convert_rope_pairing(state: StateDict, head_dim: int, to: str, inverse: bool = False) -> StateDict:
    """Our state dict (our keys) with q/k rows and q/k-norm scales reordered for RoPE pairing ``to``.

    ``inverse=True`` undoes it (import: weights trained under ``to`` -> our adjacent pairing). ``adjacent`` is the
    identity. The hidden size (rows of q, and of k) is read off ``img_in.weight``.
    """
    if to not in ROPE_PAIRINGS:
        raise ValueError(f"unknown RoPE pairing {to!r}; choose one of {ROPE_PAIRINGS}")
    if to == ADJACENT:
        return dict(state)
    order = half_split_order(head_dim)
    if inverse:
        order = torch.argsort(order)
    hidden = hidden_size_of(state, "img_in.weight")
    out = {}
    for key, tensor in state.items():
        if _QK_ROWS.match(key):  # rows [q (hidden), k (hidden), v, (mlp)]: reorder q and k
            tensor = _permute_rows(tensor, head_dim, order, 2 * hidden)
        elif _QK_SCALE.match(key):
            tensor = tensor[order]
        out[key] = tensor.contiguous()
    return out


def head_dim_of(state: StateDict) -> int:
    """Head dimension read off a q-norm scale (our keys)."""
    for key, tensor in state.items():
        if _QK_SCALE.match(key):
            return int(tensor.shape[0])
    raise KeyError("state dict has no q/k norm scale (double_blocks.0.img_attn.norm.query_scale): is it an MMDiT?")
