"""Sequence parallelism (all-to-all, "Ulysses" style): the groups, the collectives, and the model interface.

The trainer builds the groups (``build_sequence_groups``) and hands this rank's to every network that declares it
can split its sequence (``SequenceParallelModel``); the network calls the collectives below around attention.

The ranks of one sequence-parallel group work on the same sample. Each holds a contiguous 1/S slice of the text
tokens and a 1/S slice of the video tokens, and runs every linear layer on its slice only. Attention needs all
tokens, so around it an all-to-all trades the token split for a head split (each rank attends over every token
with H/S heads) and a second one trades it back. The joint sequence the attention sees is therefore rank-major,
(text_0, video_0, text_1, video_1, ...); RoPE angles and the key mask are permuted the same way, and attention
does not depend on the order of its tokens.

At the end the video tokens are gathered, so the loss is computed on the whole sample, identically on every rank
of the group. The gather's backward hands each rank S times its own slice of the gradient: summed over ranks, the
gradient of every replicated parameter is then S times the single-process one, and the world-wide gradient
averaging of DDP / ZeRO (over data-parallel x sequence-parallel ranks) divides it back. No plugin changes are
needed.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class SequenceGroup:
    """One sequence-parallel group: the process group, its size and this rank's index in it. ``overlap_rows``: when
    sampling with several batch rows, overlap the exchanges with attention row by row (``attention_row_by_row``). Off
    by default: on 2 H200s (NVLink) the NCCL kernels slowed the concurrent attention more than the overlap hid
    (2.45-2.46 vs 2.40-2.42 s per 1B long-video loop); it may pay where the link is slower. ``sampling_exchange``:
    how sampling (no autograd) moves q/k/v and the output, see sampling_exchange.py ("old": the training path);
    ``exchange_issue``: when those exchanges start ("late", "tensor", "row", see ``exchanged_attention``). The
    results are the same bits in every mode. Default "staged": on 2 H200s (1B, 33.8k tokens, 4 steps with CFG,
    medians of 4 interleaved loops) it took 2.375 s against 2.383 s for "direct", 2.377 s for "direct" + "row" and
    2.413 s for "old" (one GPU 4.444 s: 1.87x / 1.86x / 1.87x / 1.84x)."""

    group: Optional[dist.ProcessGroup]
    size: int
    rank: int
    overlap_rows: bool = False
    sampling_exchange: str = "staged"
    exchange_issue: str = "tensor"

    def local_slice(self, length: int, what: str) -> slice:
        if length % self.size:
            raise ValueError(
                f"sequence parallelism over {self.size} ranks needs {what} divisible by {self.size}, got {length}"
            )
        chunk = length // self.size
        return slice(self.rank * chunk, (self.rank + 1) * chunk)


class SequenceParallelModel:
    """Interface of a network that can split each sample's tokens over the ranks of a ``SequenceGroup``.

    All ranks of the group get the same inputs and each returns the whole output, so callers (the trainer, the
    methods) do not change; only the gradient scaling described in the module doc differs.
    """

    def set_sequence_parallel(self, sp: Optional[SequenceGroup]) -> None:
        """Split every sample's tokens over the ranks of ``sp`` from the next forward on; ``None`` turns it off."""
        raise NotImplementedError


def build_sequence_groups(size: int, overlap_rows: bool = False, **options) -> SequenceGroup:
    """Split the world into consecutive groups of ``size`` ranks; return this rank's. Every rank must call it.
    ``options``: the other ``SequenceGroup`` fields (``sampling_exchange``, ``exchange_issue``)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if size < 1 or world % size:
        raise ValueError(f"sequence_parallel_size={size} must divide the world size {world}")
    mine = None
    for start in range(0, world, size):
        group = dist.new_group(list(range(start, start + size)))  # collective: all ranks create every group
        if start <= rank < start + size:
            mine = group
    return SequenceGroup(group=mine, size=size, rank=rank % size, overlap_rows=overlap_rows, **options)


class _Exchange:
    """All-to-alls in flight, one per tensor: scatter its ``scatter_dim`` over the group, concatenate what arrives
    along ``gather_dim`` (rank-major). ``async_op`` returns at once; ``finish()`` makes the current stream wait (the
    host does not). One collective per tensor over contiguous chunks measured faster on 2 H200s than packing q, k, v
    into one strided send buffer for a single ``all_to_all_single`` (2.404 vs 2.424 s per 1B long-video loop)."""

    def __init__(self, tensors, sp: SequenceGroup, scatter_dim: int, gather_dim: int, async_op: bool = False):
        self.gather_dim, self.received, self.works = gather_dim, [], []
        for t in tensors:
            send = [chunk.contiguous() for chunk in t.chunk(sp.size, dim=scatter_dim)]
            recv = [torch.empty_like(send[0]) for _ in range(sp.size)]
            self.works.extend(_all_to_all_list(recv, send, sp, async_op))
            self.received.append(recv)

    def finish(self):
        for work in self.works:
            if work is not None:
                work.wait()
        return tuple(torch.cat(recv, dim=self.gather_dim) for recv in self.received)


_BACKENDS_WITHOUT_ALL_TO_ALL = set()  # gloo before torch 2.12 raises "Backend gloo does not support alltoall"


def _all_to_all_list(recv, send, sp: SequenceGroup, async_op: bool) -> list:
    """``dist.all_to_all``, or the same exchange as point-to-point sends where the backend has no all-to-all
    (CPU runs on older torch). Returns the works to wait for (``[None]`` when synchronous)."""
    backend = dist.get_backend(sp.group)
    if backend not in _BACKENDS_WITHOUT_ALL_TO_ALL:
        try:
            return [dist.all_to_all(recv, send, group=sp.group, async_op=async_op)]
        except RuntimeError as error:  # raised on every rank alike, before anything is sent
            if "does not support alltoall" not in str(error):
                raise
            _BACKENDS_WITHOUT_ALL_TO_ALL.add(backend)
    ranks = dist.get_process_group_ranks(sp.group)
    recv[sp.rank].copy_(send[sp.rank])
    ops = [
        op
        for peer in range(sp.size)
        if peer != sp.rank
        for op in (
            dist.P2POp(dist.isend, send[peer], ranks[peer], group=sp.group),
            dist.P2POp(dist.irecv, recv[peer], ranks[peer], group=sp.group),
        )
    ]
    works = dist.batch_isend_irecv(ops) if ops else []
    if not async_op:
        for work in works:
            work.wait()
        return [None]
    return works


def _all_to_all(tensors, sp: SequenceGroup, scatter_dim: int, gather_dim: int):
    return _Exchange(tensors, sp, scatter_dim, gather_dim).finish()


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, sp, scatter_dim, gather_dim, *tensors):
        ctx.sp, ctx.dims = sp, (scatter_dim, gather_dim)
        return _all_to_all(tensors, sp, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, *grads):
        scatter_dim, gather_dim = ctx.dims
        return (None, None, None, *_all_to_all(grads, ctx.sp, gather_dim, scatter_dim))


def tokens_to_heads(*tensors: torch.Tensor, sp: SequenceGroup):
    """Each [B, H, N/S, D] (all heads, my tokens) -> [B, H/S, N, D] (my heads, all tokens in rank-major order); the
    tensors (same shape: q, k, v) share one all-to-all. Returns a tuple."""
    if tensors[0].shape[1] % sp.size:
        raise ValueError(
            f"sequence parallelism over {sp.size} ranks needs the head count divisible by it, "
            f"got {tensors[0].shape[1]} heads"
        )
    return _AllToAll.apply(sp, 1, 2, *tensors)


def heads_to_tokens(x: torch.Tensor, sp: SequenceGroup) -> torch.Tensor:
    """[B, N, (H/S)*D] (attention output: all tokens, my heads) -> [B, N/S, H*D] (my tokens, all heads)."""
    return _AllToAll.apply(sp, 1, 2, x)[0]


def attention_row_by_row(q, k, v, sp: SequenceGroup, attend) -> torch.Tensor:
    """``heads_to_tokens(attend(*tokens_to_heads(q, k, v)))`` for sampling (no autograd), with the exchanges overlapped
    with attention: every batch row's q/k/v exchange is issued up front, and row b's output goes back while row b+1
    is attended, so of the exchanges only the first row's inputs and the last row's output stay exposed (the CFG
    branches are two rows). ``attend(q, k, v, row)`` attends one row. Each row's math is that of the batched path."""
    if q.shape[1] % sp.size:
        tokens_to_heads(q, k, v, sp=sp)  # raises the head-count error
    inbound = [_Exchange((q[r : r + 1], k[r : r + 1], v[r : r + 1]), sp, 1, 2, async_op=True) for r in range(len(q))]
    outbound = [_Exchange((attend(*x.finish(), row),), sp, 1, 2, async_op=True) for row, x in enumerate(inbound)]
    return torch.cat([x.finish()[0] for x in outbound])


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 1; backward keeps this rank's slice, times S (see the module doc)."""

    @staticmethod
    def forward(ctx, x, sp):
        ctx.sp = sp
        x = x.contiguous()  # collectives need dense buffers, and empty_like keeps a strided input's layout
        parts = [torch.empty_like(x) for _ in range(sp.size)]
        dist.all_gather(parts, x, group=sp.group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        sp = ctx.sp
        return grad.chunk(sp.size, dim=1)[sp.rank] * sp.size, None


def gather_tokens(x: torch.Tensor, sp: SequenceGroup) -> torch.Tensor:
    return _GatherTokens.apply(x, sp)
