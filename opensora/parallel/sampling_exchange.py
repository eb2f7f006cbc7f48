"""Sequence-parallel attention for sampling with fewer layout copies around the all-to-all.

The training path (``tokens_to_heads`` / ``heads_to_tokens`` in sequence_parallel.py) concatenates the text and
video q/k/v, applies RoPE, cuts every tensor into one contiguous chunk per rank, sends, and concatenates what
arrives; the output goes back the same way. Each of those steps is a full pass over the tensor. Here (no
autograd, so any layout will do) every step writes where the next one reads:

* QK-norm's text and video outputs are upcast straight into one fp32 RoPE buffer (the concatenation and the upcast
  are one pass), and RoPE's downcast writes into a send buffer laid out peer-major, [S, B, H/S, N/S, D], so every
  peer's part is contiguous (no chunk copies). v is copied once into the same layout.
* ``"direct"``: the exchange is point-to-point pieces of [N/S, D], one per (row, head), received straight into
  the attention's [B, H/S, N, D] input at the sender's token range (rank-major): no copy after the receive.
  ``"staged"``: one piece per peer and tensor (fewer, larger messages), received into a staging buffer and copied
  into the attention layout once.
* The output goes back as one contiguous piece per (row, peer) of the attention output and is written once into
  [B, N/S, H*D] (old path: a chunk copy before and a concatenation after).
* v's exchange is issued before q/k's RoPE runs and q's before k's (``issue="tensor"``), or every batch row's as
  soon as it is ready (``"row"``: only the last row of k waits for nobody), so they overlap that RoPE work.

Arithmetic is unchanged (the same RoPE expression on the same shapes, the same attention call on the same
contiguous [B, H/S, N, D] inputs, the same [B, N/S, H*D] output for the projections): results are bitwise those of
the training path. ``bytes_moved`` counts what the copies of both paths read and write.
"""

from typing import Sequence, Tuple

import torch
import torch.distributed as dist

EXCHANGES = ("old", "direct", "staged")
ISSUES = ("late", "tensor", "row")


class _PointToPoint:
    """Sends and receives of equal-sized contiguous pieces with every other rank of the group, in flight together
    (one NCCL group); ``wait()`` makes the current stream wait for them."""

    def __init__(self, sp, sends: dict, recvs: dict):
        pairs = [(peer, tag, pair) for peer in sorted(sends) for tag, pair in enumerate(zip(sends[peer], recvs[peer]))]
        if any(pair[0].is_cuda for _, _, pair in pairs):  # NCCL: one group, one kernel
            ops = [
                dist.P2POp(op, tensor, group=sp.group, group_peer=peer, tag=tag)
                for peer, tag, (send, recv) in pairs
                for op, tensor in ((dist.isend, send), (dist.irecv, recv))
            ]
            self.works = dist.batch_isend_irecv(ops) if ops else []
        else:  # gloo (CPU) has no coalescing: plain isend / irecv, matched by tag
            self.works = [
                work
                for peer, tag, (send, recv) in pairs
                for work in (
                    dist.isend(send, group=sp.group, group_dst=peer, tag=tag),
                    dist.irecv(recv, group=sp.group, group_src=peer, tag=tag),
                )
            ]

    def wait(self):
        for work in self.works:
            if work is not None:
                work.wait()


def _rope_into(parts: Sequence[torch.Tensor], rotate_pairs, rotation: torch.Tensor, send: torch.Tensor) -> None:
    """The model's RoPE (``rotate_pairs(x, rotation)`` on contiguous fp32 ``x``) of the token-concatenation of
    ``parts`` (each [B, H, n_i, D], any strides), written into ``send`` [S, B, H/S, N/S, D]. The model's own fp32
    expression on a tensor of the same shape, so the same bits; only where the inputs come from and the output go
    differ."""
    upcast = torch.empty(send.transpose(0, 1).shape, dtype=torch.float32, device=send.device)  # = [B, H, N/S, D]
    _write_tokens(parts, upcast)
    send.transpose(0, 1).copy_(rotate_pairs(upcast.flatten(1, 2), rotation).view(upcast.shape))


def _write_tokens(parts: Sequence[torch.Tensor], dest: torch.Tensor) -> None:
    """Concatenate ``parts`` ([B, H, n_i, D]) along the tokens into ``dest`` [B, S, H/S, N/S, D] (a view: the
    heads split by destination rank), in one pass."""
    start = 0
    for part in parts:
        dest[:, :, :, start : start + part.shape[2]].copy_(part.unflatten(1, dest.shape[1:3]))
        start += part.shape[2]


def _peer_major(parts: Sequence[torch.Tensor], size: int) -> torch.Tensor:
    """An empty send buffer [S, B, H/S, N/S, D] for the concatenation of ``parts``."""
    b, h, _, d = parts[0].shape
    n = sum(p.shape[2] for p in parts)
    return parts[0].new_empty(size, b, h // size, n, d)


class _HeadsExchange:
    """One of q / k / v: this rank's tokens of all heads (``send``, peer-major) -> all tokens of this rank's heads
    (``heads``, [B, H/S, N, D] contiguous, rank-major tokens)."""

    def __init__(self, send: torch.Tensor, sp, mode: str, heads: torch.Tensor):
        size, b, h_local, n_local, d = send.shape
        self.heads = heads
        by_rank = heads.view(b, h_local, size, n_local, d)
        peers = [r for r in range(size) if r != sp.rank]
        self.stage = None
        if mode == "direct":  # one piece per (row, head), received where attention reads it
            sends = {r: list(send[r].flatten(0, 1)) for r in peers}
            recvs = {r: list(by_rank[:, :, r].flatten(0, 1)) for r in peers}
        else:  # one piece per peer, received into a staging buffer
            self.stage = {r: torch.empty_like(send[r]) for r in peers}
            sends = {r: [send[r]] for r in peers}
            recvs = {r: [self.stage[r]] for r in peers}
        self.transfer = _PointToPoint(sp, sends, recvs)
        by_rank[:, :, sp.rank].copy_(send[sp.rank])  # my own tokens of my heads, while the transfer runs
        self.by_rank = by_rank

    def finish(self) -> None:
        self.transfer.wait()
        for r, staged in (self.stage or {}).items():
            self.by_rank[:, :, r].copy_(staged)


def _tokens_back(out: torch.Tensor, sp) -> torch.Tensor:
    """Attention output [B, N, (H/S)*D] (all tokens, my heads) -> [B, N/S, H*D] (my tokens, all heads), written once:
    each (row, peer) token range of a dense output is already a contiguous piece."""
    out = out.contiguous()  # a no-op for cuDNN / flash outputs
    b, n, c_local = out.shape
    size, n_local = sp.size, n // sp.size
    result = out.new_empty(b, n_local, size, c_local)
    peers = [r for r in range(size) if r != sp.rank]
    stage = {r: out.new_empty(b, n_local, c_local) for r in peers}
    sends = {r: list(out[:, r * n_local : (r + 1) * n_local].unbind(0)) for r in peers}
    transfer = _PointToPoint(sp, sends, {r: list(stage[r].unbind(0)) for r in peers})
    mine = slice(sp.rank * n_local, (sp.rank + 1) * n_local)
    result[:, :, sp.rank].copy_(out[:, mine])
    transfer.wait()
    for r in peers:
        result[:, :, r].copy_(stage[r])
    return result.flatten(2)


def exchanged_attention(streams: Sequence[Tuple], rope, rotate_pairs, attend, sp, mode: str, issue: str = "tensor"):
    """Joint attention of the streams' tokens (text first) for sampling under sequence parallelism.

    ``streams``: one (q, k, v) per stream, each [B, H, n_stream/S, D] after QK-norm, any strides; ``rope``: this
    rank's (cos, sin) rows; ``rotate_pairs(x, rotation)``: the model's eager RoPE of a contiguous fp32 ``x`` by the
    complex ``rotation`` (passed in: this package sits below the model's); ``attend(q, k, v)`` on [B, H/S, N, D] -> [B, N, (H/S)*D]. Returns [B, N/S, H*D], the
    same bits as ``heads_to_tokens(attend(*tokens_to_heads(*rope(cat(streams)))))``. ``issue``: when each exchange
    starts: ``"late"`` all after the last RoPE, ``"tensor"`` each of v, q, k as soon as it is ready, ``"row"`` each
    batch row of each (RoPE is elementwise, so row by row it gives the same bits)."""
    if mode not in EXCHANGES[1:]:
        raise ValueError(f"unknown sampling exchange {mode!r}; choose one of {EXCHANGES}")
    if issue not in ISSUES:
        raise ValueError(f"unknown exchange issue {issue!r}; choose one of {ISSUES}")
    q_parts, k_parts, v_parts = ([s[i] for s in streams] for i in range(3))
    batch, heads = q_parts[0].shape[:2]
    if heads % sp.size:
        raise ValueError(
            f"sequence parallelism over {sp.size} ranks needs the head count divisible by it, got {heads} heads"
        )
    rotation = torch.complex(*rope)
    rows = [slice(b, b + 1) for b in range(batch)] if issue == "row" else [slice(None)]
    pending, exchanges, outputs = [], [], []
    for parts, rotate in ((v_parts, False), (q_parts, True), (k_parts, True)):  # v needs no RoPE: it goes first
        send = _peer_major(parts, sp.size)
        out = send.new_empty(batch, heads // sp.size, sp.size * send.shape[3], send.shape[4])
        outputs.append(out)
        for row in rows:
            row_send = send[:, row]
            row_parts = [part[row] for part in parts]
            if rotate:
                _rope_into(row_parts, rotate_pairs, rotation, row_send)
            else:
                _write_tokens(row_parts, row_send.transpose(0, 1))
            pending.append((row_send, out[row]))
            if issue != "late":  # in flight while the next RoPE runs
                exchanges.append(_HeadsExchange(row_send, sp, mode, out[row]))
    if issue == "late":
        exchanges = [_HeadsExchange(row_send, sp, mode, heads_out) for row_send, heads_out in pending]
    for exchange in exchanges:
        exchange.finish()
    v, q, k = outputs
    return _tokens_back(attend(q, k, v), sp)


def bytes_moved(batch: int, heads: int, tokens: int, head_dim: int, size: int, streams: int) -> dict:
    """Bytes read + written per rank by the passes around one attention's exchange (bf16 activations, fp32 RoPE):
    the old path, "direct" and "staged". ``tokens``: the joint length N; ``streams``: 2 for a double block (text and
    video q/k/v computed apart), 1 for a single block. QK-norm and the attention itself are the same in all and left
    out; so are the bytes NCCL moves."""
    elements = batch * heads * (tokens // size) * head_dim  # this rank's q: all heads, its tokens
    bf16, fp32 = 2 * elements, 4 * elements
    copy, own = 2 * bf16, 2 * bf16 // size  # one pass over a tensor; over this rank's own part of it
    rope = (bf16 + fp32) + 2 * fp32 + (fp32 + bf16)  # upcast, complex multiply, downcast
    old = dict(
        concatenate_streams_qkv=3 * copy if streams == 2 else 0,
        rope_qk=2 * rope,
        chunks_before_send_qkv=3 * copy,
        concatenate_after_receive_qkv=3 * copy,
        chunks_before_send_output=copy,
        concatenate_after_receive_output=copy,
    )
    direct = dict(
        rope_qk=2 * rope,  # the upcast reads the streams where they are, the downcast writes the send buffer
        v_into_send_buffer=copy,
        own_part_qkv=3 * own,
        output_into_place=copy,
    )
    staged = dict(direct, staging_to_attention_layout_qkv=3 * (copy - own))
    paths = dict(old=old, direct=direct, staged=staged)
    return {name: dict(parts, total=sum(parts.values())) for name, parts in paths.items()}
