"""Matmul FLOPs of the MMDiT, in closed form: the one counter behind the trainer's MFU and the benchmarks.

A linear of m tokens from k to n features costs 2*m*k*n; attention costs 4*N^2*head_dim per head per layer
(QK^T and PV). Norms, activations, RoPE and elementwise work are not counted (they are not matmuls).
Training = 3x forward (backward is 2x), plus one more forward for every gradient-checkpointed block.
"""

from typing import Mapping, Union

TIMESTEP_FEATURES = 256

_DEFAULTS = dict(
    out_channels=None,
    cond_channels=None,
    patch_size=(1, 2, 2),
    mlp_ratio=4.0,
    guidance_embed=False,
    grad_ckpt_double=0,
    grad_ckpt_single=0,
)


def _arch(cfg_or_model) -> dict:
    arch = getattr(cfg_or_model, "arch", cfg_or_model)
    if not isinstance(arch, Mapping):
        raise TypeError(f"expected an MMDiT or its config dict, got {type(cfg_or_model).__name__}")
    merged = {**_DEFAULTS, **dict(arch)}
    if merged["out_channels"] is None:
        merged["out_channels"] = merged["in_channels"]
    return merged


def linear_flops(tokens: int, in_features: int, out_features: int) -> int:
    return 2 * tokens * in_features * out_features


def mmdit_forward_flops(
    cfg_or_model: Union[Mapping, object],
    num_video_tokens: int,
    num_text_tokens: int,
    batch: int = 1,
    with_cond: bool = None,
) -> dict:
    """Forward matmul FLOPs split into parts: embed, double (per block), single (per block), final, total.

    ``with_cond`` defaults to whether the model has a condition input (cond_channels is set).
    """
    return _forward_parts(_arch(cfg_or_model), num_video_tokens, num_text_tokens, num_text_tokens, 0, batch, with_cond)


def _forward_parts(a, num_video, num_text_queries, num_text_keys, past_video, batch, with_cond) -> dict:
    """``num_video`` video queries and ``num_text_queries`` text queries (0: text rows not run) attending to
    ``num_text_keys + past_video + num_video`` keys."""
    h = a["hidden_size"]
    mlp_hidden = int(h * a["mlp_ratio"])
    pt, ph, pw = a["patch_size"]
    patch = pt * ph * pw
    nv, nt = batch * num_video, batch * num_text_queries
    queries, keys = num_video + num_text_queries, num_text_keys + past_video + num_video
    if with_cond is None:
        with_cond = a["cond_channels"] is not None

    embed = linear_flops(nv, a["in_channels"] * patch, h) + linear_flops(nt, a["text_dim"], h)
    if with_cond:
        embed += linear_flops(nv, a["cond_channels"] * patch, h)
    embed += linear_flops(batch, TIMESTEP_FEATURES, h) + linear_flops(batch, h, h)  # time_in
    embed += linear_flops(batch, a["pooled_dim"], h) + linear_flops(batch, h, h)  # vector_in
    if a["guidance_embed"]:
        embed += linear_flops(batch, TIMESTEP_FEATURES, h) + linear_flops(batch, h, h)

    attn = 4 * batch * queries * keys * h  # all heads: 4 * Nq * Nk * head_dim * heads
    per_stream = lambda m: linear_flops(m, h, 3 * h) + linear_flops(m, h, h) + 2 * linear_flops(m, h, mlp_hidden)
    modulations = 2 if num_text_queries else 1  # the text stream's modulation runs with its rows
    double = per_stream(nv) + per_stream(nt) + modulations * linear_flops(batch, h, 6 * h) + attn
    m = batch * queries
    single = (
        linear_flops(m, h, 3 * h + mlp_hidden)
        + linear_flops(m, h + mlp_hidden, h)
        + linear_flops(batch, h, 3 * h)
        + attn
    )
    final = linear_flops(batch, h, 2 * h) + linear_flops(nv, h, a["out_channels"] * patch)
    total = embed + a["depth_double"] * double + a["depth_single"] * single + final
    return dict(embed=embed, double=double, single=single, final=final, total=total)


def mmdit_train_flops(
    cfg_or_model: Union[Mapping, object],
    num_video_tokens: int,
    num_text_tokens: int,
    batch: int = 1,
    with_cond: bool = None,
) -> int:
    """Matmul FLOPs of one training step (forward + backward + checkpoint recompute) for ``batch`` samples."""
    a = _arch(cfg_or_model)
    fwd = mmdit_forward_flops(a, num_video_tokens, num_text_tokens, batch, with_cond)
    recompute = a["grad_ckpt_double"] * fwd["double"] + a["grad_ckpt_single"] * fwd["single"]
    return 3 * fwd["total"] + recompute


def mmdit_chunk_flops(
    cfg_or_model: Union[Mapping, object],
    num_video_tokens: int,
    num_text_tokens: int,
    past_video_tokens: int = 0,
    batch: int = 1,
    run_text: bool = True,
    extra_key_tokens: int = 0,
    with_cond: bool = None,
) -> int:
    """Forward matmul FLOPs of one streamed chunk pass of a causal MMDiT (``forward_chunk``): the chunk's video tokens
    (and the text tokens when ``run_text``; a text-cache hit runs the video rows only) attend to the text, the
    ``past_video_tokens`` of the KV cache and the chunk (+ ``extra_key_tokens``, e.g. the masked keys of a merged
    refill pass). Attention counts every (query, key) pair the kernel computes, masked or not. With ``run_text`` and
    no past this is ``mmdit_forward_flops(...)["total"]`` of the chunk alone."""
    a = _arch(cfg_or_model)
    text_queries = num_text_tokens if run_text else 0
    past = past_video_tokens + extra_key_tokens
    return _forward_parts(a, num_video_tokens, text_queries, num_text_tokens, past, batch, with_cond)["total"]
