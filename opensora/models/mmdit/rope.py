"""3D rotary position embedding over (t, h, w) token ids.

Each attention head's channels are split into three groups of ``axes_dims`` channels; group ``i`` rotates
pairs of adjacent channels (2j, 2j+1) by ``pos_i * theta ** (-2j / axes_dims[i])``. Text tokens use id
(0, 0, 0), which is the identity rotation. cos/sin are built once per forward and shared by all blocks.
"""

from typing import List, Sequence, Tuple

import torch


def video_position_ids(t: int, h: int, w: int, device=None) -> torch.Tensor:
    """Integer (t, h, w) ids of a patch grid in the token order of patchify: [t*h*w, 3]."""
    grids = torch.meshgrid(
        torch.arange(t, device=device), torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij"
    )
    return torch.stack(grids, dim=-1).reshape(-1, 3)


def rope_cos_sin(ids: torch.Tensor, axes_dims: Sequence[int], theta: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles for ``ids`` [N, len(axes_dims)]: each [N, sum(axes_dims) // 2], fp32."""
    if ids.shape[-1] != len(axes_dims):
        raise ValueError(f"ids have {ids.shape[-1]} axes but axes_dims has {len(axes_dims)}: {tuple(axes_dims)}")
    angles = []
    for axis, dim in enumerate(axes_dims):
        if dim % 2:
            raise ValueError(f"every RoPE axis needs an even number of channels, got axes_dims={tuple(axes_dims)}")
        inv_freq = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=ids.device) / dim)
        angles.append(ids[:, axis, None].to(torch.float64) * inv_freq[None, :])
    angle = torch.cat(angles, dim=-1)
    return angle.cos().float(), angle.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs of ``x`` [..., N, D] by angles with ``cos``/``sin`` [N, D/2]; fp32 math, x's dtype out.

    Eager: one complex multiply (fp32 upcast, multiply, downcast: 3 passes over ``x`` forward and about as many
    backward). The real-arithmetic form below costs ~9 strided passes in eager mode (measured on H100: RoPE was
    most of the step's elementwise time) but is what Inductor fuses best, so compiled code keeps it.
    """
    if torch.compiler.is_compiling():
        return _apply_rope_real(x, cos, sin)
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(pairs * torch.complex(cos, sin)).flatten(-2).to(x.dtype)


def apply_rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """``apply_rope`` on q and k with the rotation built once (eager: one ``torch.complex`` instead of two; the same
    values, so the same results bit for bit)."""
    if torch.compiler.is_compiling():
        return _apply_rope_real(q, cos, sin), _apply_rope_real(k, cos, sin)
    rotation = torch.complex(cos, sin)
    return tuple(rotate_pairs(x.float().contiguous(), rotation).to(x.dtype) for x in (q, k))


SHIFT_GROUP_BYTES = 64 << 20  # fp32 bytes one stacked rotation of ``shift_time_all`` may cover


def shift_time(x: torch.Tensor, delta: int, axes_dims: Sequence[int], theta: float) -> torch.Tensor:
    """Keys ``x`` [..., N, D] already rotated at time ids ``p`` -> rotated at ``p + delta`` (rotations compose: the
    table of id (delta, 0, 0), whose h/w parts are the identity); fp32 math, x's dtype out."""
    return shift_time_all([x], delta, axes_dims, theta)[0]


def shift_time_all(
    xs: Sequence[torch.Tensor], delta: int, axes_dims: Sequence[int], theta: float
) -> List[torch.Tensor]:
    """``shift_time`` of every tensor in ``xs`` (all on one device), bit for bit: one rotation table, and one rotation
    per run of same-shaped tensors (every block's keys share one shape), stacked up to ``SHIFT_GROUP_BYTES`` of fp32
    work so the transient stays small, so moving a window's keys costs a few kernels instead of a dozen per block. The
    table is made on the device from the Python ``delta`` (a fill, not a host-to-device copy, which would wait for the
    stream: a streamed chunk moves its keys without a host sync)."""
    if not xs:
        return []
    ids = torch.zeros((1, len(axes_dims)), dtype=torch.int64, device=xs[0].device)
    ids[:, 0] = int(delta)
    cos, sin = rope_cos_sin(ids, axes_dims, theta)
    out: List[torch.Tensor] = []
    start = 0
    while start < len(xs):
        first = xs[start]
        room = max(1, SHIFT_GROUP_BYTES // max(4 * first.numel(), 1))
        end = start + 1
        while end < len(xs) and end - start < room and xs[end].shape == first.shape and xs[end].dtype == first.dtype:
            end += 1
        if end - start == 1:
            out.append(apply_rope(first, cos, sin))
        else:
            out.extend(apply_rope(torch.stack(list(xs[start:end])), cos, sin).unbind(0))
        start = end
    return out


def rotate_pairs(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """The eager rotation: contiguous fp32 ``x`` [..., N, D] times the complex ``rotation`` [N, D/2] pair by pair ->
    a new fp32 [..., N, D]. Sequence-parallel sampling (opensora/parallel/sampling_exchange.py) calls it too, on the
    same shapes, which keeps its results bitwise those of this path."""
    return torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * rotation).flatten(-2)


def _apply_rope_real(x, cos, sin):
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)
