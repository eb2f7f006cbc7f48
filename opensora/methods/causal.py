"""Policy helpers shared by the causal-student methods (causal ODE init, CausVid, Self-Forcing).

Nothing here runs a network or knows a model family: the chunk size comes from the method's config (and is
checked against the network when the network says what it was built with), random draws that every rank must
agree on are drawn on rank 0 and broadcast, and the DMD real-score guidance is written in the project's one CFG
convention.

CFG convention (``opensora.diffusion.guidance``): ``real = u + s (c - u)`` with ``s`` the *standard* CFG scale
(``u`` = null text, ``c`` = prompt). DMD/CausVid/Self-Forcing papers write the real score as ``c + w (c - u)``;
that is the same thing with ``s = w + 1`` (``dmd_guidance_to_cfg_scale``). Every ``*_guidance_scale`` key of
these methods is ``s``.
"""

from typing import Optional

import torch
import torch.distributed as dist


def dmd_guidance_to_cfg_scale(w: float) -> float:
    """DMD's ``c + w (c - u)`` is standard CFG ``u + s (c - u)`` with ``s = w + 1``."""
    return float(w) + 1.0


def cfg_scale_to_dmd_guidance(s: float) -> float:
    """Inverse of ``dmd_guidance_to_cfg_scale``: ``w = s - 1``."""
    return float(s) - 1.0


def shared_randint(high: int, device: Optional[torch.device] = None) -> int:
    """An integer in ``[0, high)`` that every rank agrees on: drawn from the global torch RNG on every rank
    (so each rank's generator advances identically, which keeps checkpoint/resume exact), then rank 0's value
    is broadcast when a process group is up. ``device``: where the collective runs (CUDA for NCCL)."""
    value = torch.randint(0, int(high), (1,))
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        value = value.to(device)
        dist.broadcast(value, src=0)
    return int(value.item())


def network_chunk_frames(handle) -> Optional[int]:
    """The ``causal_chunk_frames`` a role's network was built with (0: bidirectional), or None when the network
    does not say (then the method's own ``num_frames_per_chunk`` is trusted)."""
    value = getattr(handle.unwrap(), "causal_chunk_frames", None)
    return None if value is None else int(value or 0)


def check_causal_student(method_name: str, handle, num_frames_per_chunk: int) -> int:
    """Validate the chunk size against the student's network; returns it."""
    chunk = int(num_frames_per_chunk)
    if chunk < 1:
        raise ValueError(f"{method_name}: num_frames_per_chunk must be >= 1 latent frame, got {num_frames_per_chunk}")
    built = network_chunk_frames(handle)
    if built is not None and built != chunk:
        raise ValueError(
            f"{method_name}: num_frames_per_chunk={chunk} but the student network was built with "
            f"causal_chunk_frames={built} (0 = bidirectional); set the student's model causal_chunk_frames={chunk}"
        )
    return chunk


def num_chunks(num_frames: int, chunk: int) -> int:
    if num_frames % chunk:
        raise ValueError(f"{num_frames} latent frames do not split into chunks of {chunk}")
    return num_frames // chunk
