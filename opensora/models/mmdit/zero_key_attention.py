"""Padded prompts on the unmasked head-128 kernel: padded keys set to zero, their share taken out of the softmax after.

Why: a boolean key mask keeps SDPA on cuDNN but slows its kernels: at the 1B real configuration on an H200 the
padded step's attention took 43.0 ms a step against 27.7 ms unpadded; with zero keys it takes 25.9 ms
(benchmarks/reports/padded_text_h200_2026-11.md).

How: the padded text keys and values of each row are replaced by zeros, and the kernel runs without a mask. A zero
key scores exactly 0 against every query, so each query's softmax sum holds its valid keys' sum ``Z`` plus
``n_pad * exp(0)``, where ``n_pad`` is its row's padded key count; a zero value adds nothing to the output. The
kernel returns ``lse = log(Z + n_pad)``. So, per query, with ``r = n_pad * exp(-lse)``:

* output = kernel output / (1 - r), the masked output exactly;
* ``lse_valid = lse + log1p(-r)``, the masked computation's log-sum-exp.

The backward calls the kernel's own backward op with the corrected output and ``lse_valid``: it recomputes the
probabilities as ``exp(score - lse_valid)``, which are the masked ones for valid keys. A zero key adds nothing to
the query gradient. The padded keys' and values' gradients are wrong, but nothing reads them: the zeroing
(``torch.where``) sends zeros back there. So the output and every gradient equal the masked computation's up to
rounding. Every query attends over its row's valid keys, padded text queries too (the dense key mask's semantics).

The one loss of precision: when a query's valid keys hold a tiny share of the sum next to the zero keys (``r`` near
1), ``1 - r`` cancels. fp32 ``lse`` leaves about 7 - log10(1 / (1 - r)) digits, more than bf16's 3 while the
valid keys hold more than 1e-4 of the sum. Every row keeps its video keys, so that would need a query whose scores
over all of them average far below zero. ``r`` is capped below 1 so that case gives a large finite output, never
inf or NaN.

Kernels: cuDNN on sm90+ and flash elsewhere on CUDA (bf16 / fp16, head size <= 128 for cuDNN, <= 256 for flash),
FlashAttention 4 when the backend is "fa4" (fa4_kernel.py; sm90+, falls back to the others where it cannot run),
PyTorch's flash kernel for the CPU (what the CPU tests use). Other cases (fp32 on CUDA, the "efficient" / "math"
backends) take the dense mask through attention.py's SDPA path, under the chosen backend.
"""

import warnings
from typing import Optional, Sequence, Tuple

import torch

from . import fa4_kernel
from .device_capability import device_major
from .row_lengths import DeviceRowLengths

MAX_PADDED_SHARE = 1.0 - 2.0**-20  # the cap on r (module docstring): keeps 1 - r > 0 in fp32
aten = torch.ops.aten
_UNUSED = {}  # device -> the zero int64 scalar the backward ops take for their unused random state


def zero_key_kernel(q: torch.Tensor, backend: str) -> Optional[str]:
    """The kernel the zero-key path runs for ``q`` [B, heads, N, head_dim] under ``backend``, or ``None`` (then the
    dense mask): "cpu", "cudnn", "flash" or "fa4"."""
    if backend == "fa4":
        if fa4_kernel.supports(q):
            return "fa4"
        if q.device.type == "cuda" and not fa4_kernel.available():
            fa4_kernel.warn_fallback("the SDPA kernels")
        backend = "auto"
    head_dim = q.shape[-1]
    if q.device.type == "cpu":
        return "cpu" if backend in ("auto", "flash") else None
    if q.device.type != "cuda" or q.dtype not in (torch.bfloat16, torch.float16) or head_dim % 8:
        return None
    cudnn_ok = device_major(q.device) >= 9 and head_dim <= 128
    if backend in ("auto", "cudnn") and cudnn_ok:
        return "cudnn"
    if backend in ("auto", "flash") and head_dim <= 256:
        return "flash"
    return None


def _kernel_forward(kernel: str, q, k, v):
    """(output [B, heads, N, D], logsumexp in the kernel's shape: [B, heads, N] or cuDNN's [B, heads, N, 1])."""
    if kernel == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
    if kernel == "fa4":
        return fa4_kernel.forward(q, k, v)
    if kernel == "cudnn":
        return aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)[:2]
    return aten._scaled_dot_product_flash_attention(q, k, v)[:2]


def cudnn_grad_layout(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` [B, heads, N, D] as a view of a dense [B, N, heads, D]: the layout in which every cuDNN attention
    backward of this project gets its output gradient (SDPA's own, behind ``attention._merge_heads``, and this one).

    Why one layout: PyTorch caches cuDNN's backward graph keyed by the q / k / v shapes and strides only, and the
    graph keeps the output-gradient strides of the call that built it. A later call at the same q / k / v layout
    whose gradient has other strides is read with the cached ones: wrong gradients, no error. On an H200 (torch
    2.11) a tiny MMDiT gave 0.63 relative error in a weight gradient on this path after an unpadded SDPA pass at the
    same shape had built the graph, and the right one in a fresh process (benchmarks/cudnn_backward_layout.py).
    No copy when ``grad`` already has this layout (what ``_merge_heads``' backward hands back)."""
    return grad.transpose(1, 2).contiguous().transpose(1, 2)


def _kernel_backward(kernel: str, grad, q, k, v, out, lse):
    """The kernel's backward from a [B, heads, N] log-sum-exp, ``grad`` in any layout (each kernel gets the one it
    needs). No dropout, so the random-state arguments are unused; they get zero scalars (some versions read their
    pointers anyway)."""
    grad = cudnn_grad_layout(grad) if kernel == "cudnn" else grad.contiguous()
    if kernel == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, False)
    if kernel == "fa4":
        return fa4_kernel.backward(grad, q, k, v, out, lse)
    unused = _UNUSED.get(q.device)
    if unused is None:
        unused = _UNUSED.setdefault(q.device, torch.zeros((), dtype=torch.int64, device=q.device))
    tokens_q, tokens_k = q.shape[2], k.shape[2]
    if kernel == "cudnn":
        return aten._scaled_dot_product_cudnn_attention_backward(
            grad, q, k, v, out, lse.unsqueeze(-1), unused, unused, None, None, None, tokens_q, tokens_k, 0.0, False
        )
    return aten._scaled_dot_product_flash_attention_backward(
        grad, q, k, v, out, lse, None, None, tokens_q, tokens_k, 0.0, False, unused, unused
    )


def remove_zero_keys(out: torch.Tensor, lse: torch.Tensor, num_padded: torch.Tensor):
    """The kernel's output [B, heads, N, D] and log-sum-exp (lse's shape, [B, heads, N] in its leading dims) over a
    row's keys plus ``num_padded[b]`` zero keys (with zero values) -> the output (``out``'s dtype, contiguous) and the
    log-sum-exp [B, heads, N] (fp32) over the row's keys alone (module docstring). Pure; fp32 math."""
    batch, heads, tokens = out.shape[:3]
    lse = lse.float().reshape(batch, heads, tokens)
    share = (num_padded.float()[:, None, None] * torch.exp(-lse)).clamp(max=MAX_PADDED_SHARE)
    corrected = (out.float() / (1.0 - share)[..., None]).to(out.dtype).contiguous()
    return corrected, (lse + torch.log1p(-share)).contiguous()


_FUSED = {}  # device type -> remove_zero_keys compiled into one or two kernels (made on first use)


def fused_remove_zero_keys(out: torch.Tensor, lse: torch.Tensor, num_padded: torch.Tensor):
    """``remove_zero_keys`` through ``torch.compile`` on CUDA: its ~12 elementwise kernels (about 250 MB of traffic a
    call at the 1B real configuration) become one or two, inside the opaque op where the block's compile cannot fuse
    them. The CPU, or a compile failure (warned once), runs it eagerly."""
    if out.device.type != "cuda":
        return remove_zero_keys(out, lse, num_padded)
    if "cuda" not in _FUSED:
        _FUSED["cuda"] = torch.compile(remove_zero_keys, dynamic=False)
    try:
        return _FUSED["cuda"](out, lse, num_padded)
    except Exception as error:  # noqa: BLE001 - any compile failure: the eager function gives the same result
        warnings.warn(f"zero-key attention: compiling the output correction failed ({error}); running it eagerly")
        _FUSED["cuda"] = remove_zero_keys
        return remove_zero_keys(out, lse, num_padded)


# Forward and backward are custom ops: opaque to torch.compile, so inside compiled blocks the kernels get exactly the
# layouts this code gives them (q, k, v, out and grad_out dense [B, heads, N, D]) and autograd sees one node, whose
# backward is the kernel's backward with the corrected pair. (As an autograd.Function traced into compiled blocks, the
# gradients came out wrong on an H200 and the cuDNN backward ran twice per call; eager was right.)
@torch.library.custom_op("opensora::zero_key_attention", mutates_args=())
def _zero_key_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_padded: torch.Tensor, kernel: str
) -> Tuple[torch.Tensor, torch.Tensor]:
    return fused_remove_zero_keys(*_kernel_forward(kernel, q, k, v), num_padded)


@_zero_key_attention_op.register_fake
def _(q, k, v, num_padded, kernel):
    batch, heads, tokens, _ = q.shape
    return q.new_empty(batch, heads, tokens, v.shape[-1]), q.new_empty(batch, heads, tokens, dtype=torch.float32)


@torch.library.custom_op("opensora::zero_key_attention_backward", mutates_args=())
def _zero_key_attention_backward_op(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    kernel: str,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = _kernel_backward(kernel, grad, q, k, v, out, lse)
    return tuple(g.contiguous() for g in grads)


@_zero_key_attention_backward_op.register_fake
def _(grad, q, k, v, out, lse, kernel):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, _, kernel = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.kernel = kernel


def _backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.opensora.zero_key_attention_backward(grad_out, q, k, v, out, lse, ctx.kernel)
    return dq, dk, dv, None, None


_zero_key_attention_op.register_autograd(_backward, setup_context=_setup_context)


class ZeroKeyRows(DeviceRowLengths):
    """The key mask of a joint [text, video] batch whose row ``b`` has ``lengths[b]`` valid text tokens first, as
    the keep mask of the zeroing and each row's padded key count, built once per forward and shared by every block
    (``attend_heads``)."""

    def __init__(self, lengths: Sequence[int], num_text: int, num_video: int, device):
        super().__init__(lengths, num_text, num_video, device)
        self._keep_keys(self.dense(self.num_text + self.num_video, device))

    @classmethod
    def from_key_mask(cls, key_mask: torch.Tensor, num_text: int) -> "ZeroKeyRows":
        """The same from a device key mask [B, 1, 1, T + N] (``MMDiT.key_mask``; any valid text pattern, not only a
        prefix), with no host read: what a pass whose text was cut to a host-known bound uses
        (``text_padding.trim_text_to_bound``). ``lengths`` then holds the valid counts."""
        rows = cls.__new__(cls)
        rows.num_text, rows.num_video = int(num_text), key_mask.shape[-1] - int(num_text)
        rows.lengths = rows._keep_keys(key_mask)
        return rows

    def _keep_keys(self, key_mask: torch.Tensor) -> torch.Tensor:
        """Keep mask and padded counts from the key mask; returns each row's valid text count [B] (device)."""
        self.key_mask = key_mask  # [B, 1, 1, T + N]: the dense fallback's mask
        self.keep = key_mask[:, :, 0, :, None]  # [B, 1, T + N, 1]: broadcasts over heads and channels
        valid = key_mask[:, 0, 0, : self.num_text].sum(-1)
        self.num_padded = (self.num_text - valid).float()  # [B]
        return valid

    def attend_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: str) -> torch.Tensor:
        """[B, heads, T + N, head_dim] q/k/v (one dtype) -> [B, heads, T + N, head_dim], each query over its row's
        valid keys, on ``kernel`` (``zero_key_kernel``; where none serves, attention.py uses ``key_mask``)."""
        self.check(q, k)
        zero = q.new_zeros(())
        k, v = torch.where(self.keep, k, zero), torch.where(self.keep, v, zero)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        return torch.ops.opensora.zero_key_attention(q, k, v, self.num_padded, kernel)[0]
