"""Scaled dot-product attention with the kernel chosen on purpose.

PyTorch's SDPA picks a kernel by itself, and on Hopper the fastest one (cuDNN, about 2x flash at our shapes)
is not always the one it picks; it has also crashed in other projects' layouts. So every call names the
backends it may use. ``"auto"`` resolves once per device: cuDNN first on sm90+ without a mask, flash next,
then mem-efficient, then math; with a mask flash is left out (it takes none). On CPU ``"auto"`` lets PyTorch
choose. The GPU test in tests/test_mmdit.py checks every backend against math for the layouts we use.
Inside ``torch.compile`` (``MMDiT(compile_blocks=True)``) the same code is traced into the graph (default), or runs
inside a custom op that the compiled graph cannot look into (``COMPILED_ATTENTION``, at the end).
"""

from contextlib import nullcontext
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .bias_channel_attention import BiasChannelRows
from .device_capability import device_major
from .flex_attention import FlexRows
from .packed_attention import PackedRows
from .zero_key_attention import ZeroKeyRows, zero_key_kernel

BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
# "fa4": FlashAttention 4 (fa4_kernel.py) where the zero-key path runs (padded prompts, the training default);
# every other call, and any machine where FA4 cannot run, takes the "auto" order below
ATTENTION_BACKENDS = ("auto",) + tuple(BACKENDS) + ("fa4",)


def check_backend(backend: str) -> str:
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend '{backend}'; choose one of {ATTENTION_BACKENDS}")
    return backend


def auto_backends(device: torch.device, has_mask: bool) -> Optional[list]:
    """Backends, best first, that ``"auto"`` allows on ``device``; ``None`` means PyTorch's own choice."""
    if device.type != "cuda":
        return None
    major = device_major(device)
    order = []
    if major >= 9:
        order.append(SDPBackend.CUDNN_ATTENTION)
    if not has_mask:
        order.append(SDPBackend.FLASH_ATTENTION)
    order += [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return order


def backend_context(backend: str, device: torch.device, has_mask: bool):
    check_backend(backend)
    if backend in ("auto", "fa4"):
        order = auto_backends(device, has_mask)
        if order is None:
            return nullcontext()
        # set_priority makes the list order binding, not just the allowed set.
        return sdpa_kernel(order, set_priority=True)
    return sdpa_kernel([BACKENDS[backend]])


class _DenseGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous.

    Consumers such as ``cat((attn_out, mlp_out), -1)`` (single-stream blocks) hand SDPA's backward a strided
    grad_out. Measured on H100/torch 2.11: when cuDNN attention runs in two such layouts (double blocks dense,
    single blocks strided) in one graph, its backward returns NaN grads or hits an illegal memory access (the
    same crash seen in diffusers' Flux); a dense grad_out in every layer fixes it. tests/test_mmdit.py covers it.
    The cause: PyTorch caches cuDNN's backward graph by the q / k / v layout alone and keeps the grad_out strides it
    was built with (``zero_key_attention.cudnn_grad_layout``, which hands the zero-key path's backward this layout).
    """

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor] = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention over ``q, k, v`` of shape [B, heads, N, head_dim]; returns [B, N, heads * head_dim].

    ``mask`` is boolean (True = may attend), broadcastable to [B, heads, Nq, Nk], or ``None`` for full
    attention (what lets flash/cuDNN run). Eager calls run SDPA directly; inside ``torch.compile`` the call
    goes through the opaque ``opensora::attention`` op, so a compiled block stays one graph (see below).
    """
    if q.dim() != 4:
        raise ValueError(f"attention expects q/k/v as [B, heads, N, head_dim], got q of shape {tuple(q.shape)}")
    if isinstance(mask, (KeyRanges, PackedRows, FlexRows)):
        return mask.attend(q, k, v, backend)
    if isinstance(mask, BiasChannelRows):  # the key mask in extra channels: an unmasked SDPA call at head_dim's scale
        head_dim = q.shape[-1]
        return _dense_sdpa(*mask.augment(q, k, v), None, backend, scale=head_dim**-0.5, channels=head_dim)
    if isinstance(mask, ZeroKeyRows):  # padded keys zeroed, an unmasked kernel, its output corrected
        q, k, v = _same_dtype(q, k, v)
        kernel = zero_key_kernel(q, backend)
        if kernel is None:  # fp32 on CUDA, the efficient / math backends: the dense mask
            return _dense_sdpa(q, k, v, mask.key_mask, backend)
        return _dense_grad(_merge_heads(mask.attend_heads(q, k, v, kernel)))
    if torch.compiler.is_compiling() and COMPILED_ATTENTION["mode"] == "op":
        q, k, v = _same_dtype(q, k, v)
        return torch.ops.opensora.attention(q, k, v, mask, check_backend(backend))
    return _dense_sdpa(q, k, v, mask, backend)


# How attention enters a compiled block (process-wide; ``MMDiT.set_compile_blocks(attention=...)`` sets it):
# "traced" (default): the eager code (SDPA under the chosen backends, a dense grad_out) traced into the graph, so
# the backward reads the forward's saved logsumexp and nothing is recomputed; "op": the opaque custom op below (its
# backward recomputes the attention forward: one extra forward per block). Measured on an H100 (1B step, batch 1,
# no checkpointing, benchmarks/README.md): traced 170-171 ms, op 191-193 ms, eager 202-204 ms. Traced SDPA was
# once blamed for a NaN loss with cuDNN; that was Inductor's mix-order reduction (model.compile_block_options).
COMPILED_ATTENTION = {"mode": "traced"}
COMPILED_ATTENTION_MODES = ("op", "traced")


class RowGroups(tuple):
    """Per-row-group keys/values: ``((start, stop, k, v), ...)`` where the query rows ``[start, stop)`` of the batch
    attend to ``k, v`` [stop - start, heads, Nk, head_dim] with no mask; the groups cover the batch in order. A
    ``kv_hook`` (layers.py) returns one when groups of rows see different key sets (``causal_refill``'s merged pass):
    one mask-free SDPA call per group instead of one masked call over the union of the keys."""

    def attend(self, q: torch.Tensor, backend: str = "auto") -> torch.Tensor:
        """[B, heads, Nq, head_dim] queries -> [B, Nq, heads * head_dim], the groups' outputs in row order."""
        return torch.cat([attention(q[start:stop], k, v.contiguous(), None, backend) for start, stop, k, v in self])


class KeyRanges:
    """A key mask given as ranges: batch row ``b`` attends to the keys ``[start, stop)`` of each pair in
    ``rows[b]`` (in order) and to no other key. What a padded prompt needs (text_padding.py: the row's valid text
    tokens and the video tokens), without a dense boolean mask that would rule out the flash / cuDNN kernels.

    ``attend`` runs one mask-free SDPA call per row on that row's keys/values (copied out of the joint sequence):
    the same result as SDPA with the equivalent boolean mask. ``queries_at_keys`` (self-attention, sorted
    non-overlapping ranges): only the queries at the row's key positions are computed, the others output zeros
    (padded tokens whose outputs nobody reads); a row's call then has one shape, ``[n, n]`` with ``n`` its token
    count, so the kernels' per-shape set-up (cuDNN builds an execution plan per new shape, ~0.1 s) is paid once per
    prompt length, not once per (batch text length, prompt length) pair.

    Inside ``torch.compile`` the range bounds are host ints: Dynamo specialises on the first batch's values and,
    when they change, recompiles once with them symbolic (automatic dynamic shapes), so a stream of batches costs a
    couple of graphs, not one per batch."""

    def __init__(self, rows, queries_at_keys: bool = False):
        self.rows = tuple(tuple((int(start), int(stop)) for start, stop in ranges) for ranges in rows)
        self.queries_at_keys = bool(queries_at_keys)
        if self.queries_at_keys:
            for ranges in self.rows:
                bounds = [b for pair in ranges for b in pair]
                if bounds != sorted(bounds):
                    raise ValueError(f"queries_at_keys needs sorted, non-overlapping ranges, got {ranges}")

    def __len__(self) -> int:
        return len(self.rows)

    def dense(self, num_keys: int, device=None) -> torch.Tensor:
        """The equivalent boolean key mask [B, 1, 1, num_keys] (True = may attend)."""
        mask = torch.zeros(len(self.rows), num_keys, dtype=torch.bool, device=device)
        for row, ranges in enumerate(self.rows):
            for start, stop in ranges:
                mask[row, start:stop] = True
        return mask[:, None, None, :]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "auto") -> torch.Tensor:
        """[B, heads, N, head_dim] q/k/v -> [B, N, heads * head_dim], each row over its own keys only."""
        if len(self.rows) != q.shape[0]:
            raise ValueError(f"KeyRanges has {len(self.rows)} rows for a batch of {q.shape[0]}")
        outputs = []
        for row, ranges in enumerate(self.rows):
            gather = lambda t: torch.cat([t[row : row + 1, :, start:stop] for start, stop in ranges], 2)  # noqa: E731
            keys, values = gather(k), gather(v)
            if not self.queries_at_keys:
                outputs.append(attention(q[row : row + 1], keys, values, None, backend))
                continue
            out = attention(gather(q), keys, values, None, backend)
            # Scatter back into zeros, one slice write per range: no zero-filled pieces of odd sizes to concatenate
            # (the backward is the matching slices of the gradient).
            full, done = out.new_zeros(1, q.shape[2], out.shape[2]), 0
            for start, stop in ranges:
                full = full.slice_scatter(out[:, done : done + stop - start], dim=1, start=start, end=stop)
                done += stop - start
            outputs.append(full)
        return torch.cat(outputs)


def _same_dtype(q, k, v):
    """What SDPA's autocast rule does for us in eager mode: one dtype for q, k, v (the custom op has no rule)."""
    if torch.is_autocast_enabled(q.device.type):
        dtype = torch.get_autocast_dtype(q.device.type)
    elif q.dtype == k.dtype == v.dtype:
        return q, k, v
    else:
        raise ValueError(f"attention got q/k/v of different dtypes {q.dtype}/{k.dtype}/{v.dtype}")
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _sdpa_heads_first(q, k, v, mask, backend, scale=None):
    """SDPA on dense copies of q, k, v under the chosen backend: [B, heads, N, head_dim]."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    with backend_context(backend, q.device, mask is not None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _merge_heads(out):
    batch, heads, tokens, head_dim = out.shape
    return out.transpose(1, 2).reshape(batch, tokens, heads * head_dim)


def _dense_sdpa(q, k, v, mask, backend, scale=None, channels=None):
    """Eager SDPA on dense [B, heads, N, head_dim] inputs with a dense grad_out (see ``_DenseGrad``); ``channels``
    keeps the output's first channels of each head (``BiasChannelRows``' extra ones are dropped)."""
    out = _sdpa_heads_first(q, k, v, mask, backend, scale)
    return _dense_grad(_merge_heads(out if channels is None else out[..., :channels]))


def _dense_grad(out):
    return _DenseGrad.apply(out) if out.requires_grad else out


# --- Attention as one opaque op for compiled blocks ------------------------------------------------------------
#
# History (H100, torch 2.11): with SDPA traced into a compiled block, Inductor chose the strides of SDPA's
# inputs and grad_out itself and the 1B MMDiT trained to NaN with cuDNN attention; with SDPA kept eager through
# ``torch.compiler.disable`` each block split in two graphs, and at batch 1 the backward of the second graph
# returned the gradient of a [1, 1, H] modulation chunk as [H] ("CompiledFunctionBackward returned an invalid
# gradient"). As a custom op, attention is a single node Dynamo/Inductor cannot look into: the block is one graph
# (no tensors cross a graph break), and the op's own code fixes the layouts, the backend, and a dense grad_out
# exactly as the eager path does. The backward recomputes the attention forward under the same backend and
# differentiates it (one extra attention forward per block in the backward pass; the version-specific
# per-backend backward ops with a saved logsumexp would avoid that).


@torch.library.custom_op("opensora::attention", mutates_args=())
def _attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], backend: str
) -> torch.Tensor:
    return _merge_heads(_sdpa_heads_first(q, k, v, mask, backend)).contiguous()


@_attention_op.register_fake
def _(q, k, v, mask, backend):
    batch, heads, tokens, _ = q.shape
    return q.new_empty(batch, tokens, heads * v.shape[-1])


def _autograd_reenabled():
    """Undo, for this scope, the exclusion of the autograd dispatch keys under which a custom op's kernel runs
    (``torch.func.vjp`` would do it too, but fails when a TorchDispatchMode such as FlopCounterMode is active)."""
    C = torch._C
    exclude = C._dispatch_tls_local_exclude_set()
    for key in (C.DispatchKey.AutogradCPU, C.DispatchKey.AutogradCUDA):
        exclude = exclude.remove(key)
    return C._ForceDispatchKeyGuard(C._dispatch_tls_local_include_set(), exclude)


@torch.library.custom_op("opensora::attention_backward", mutates_args=())
def _attention_backward_op(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], backend: str
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, heads, tokens = q.shape[0], q.shape[1], q.shape[2]
    # grad_out in the layout the eager path gives SDPA: a transposed view of a dense [B, N, heads, head_dim].
    grad_out = grad.contiguous().view(batch, tokens, heads, v.shape[-1]).transpose(1, 2)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with _autograd_reenabled(), torch.enable_grad():
        out = _sdpa_heads_first(*leaves, mask, backend)
        grads = torch.autograd.grad(out, leaves, grad_out)
    return tuple(g.contiguous() for g in grads)


@_attention_backward_op.register_fake
def _(grad, q, k, v, mask, backend):
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


def _attention_setup_context(ctx, inputs, output):
    q, k, v, mask, backend = inputs
    ctx.save_for_backward(q, k, v, mask)
    ctx.backend = backend


def _attention_backward(ctx, grad):
    q, k, v, mask = ctx.saved_tensors
    dq, dk, dv = torch.ops.opensora.attention_backward(grad, q, k, v, mask, ctx.backend)
    return dq, dk, dv, None, None


_attention_op.register_autograd(_attention_backward, setup_context=_attention_setup_context)
