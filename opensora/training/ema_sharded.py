"""EMA of the weights sharded like ZeRO's fp32 masters: each rank averages its own piece of every parameter.

Under LowLevelZero with several ranks, rank ``r`` of ``n`` holds the fp32 master of piece ``r`` of each parameter,
flattened and zero-padded to a multiple of ``n`` (ColossalAI's ``_create_master_param_current_rank``). This EMA keeps
the same pieces and folds in those masters after every step, as upstream Open-Sora's ``update_ema`` does with its
sharded EMA:

* every rank does ``1 / n`` of the work (12 bytes a parameter: read the master and the shadow, write the shadow).
  A rank-0 EMA of the whole bf16 weights costs rank 0 18 bytes a parameter (~6 ms of a 1B step on an H200) while
  the other ranks wait for it in the next step's first collective, which is what held 2-GPU ZeRO-2 below 0.97;
* the averaged values are the exact fp32 weights, as with one rank (``EMA`` with ``zero_single_rank.whole_masters``);
* memory: 4 bytes a parameter over all ranks instead of 4 on rank 0 (44 GB at 11B).

The file is the one ``EMA`` writes (whole tensors, the bare model's names): ``save`` gathers the pieces to rank 0,
``load`` cuts each rank's piece out of a whole tensor, so a run resumes on any number of ranks and the converters read
it unchanged. ``save``, ``state_dict``, ``gathered`` and ``copy_to`` are collectives: every rank calls them.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors.torch import save_file

from .ema import EMA


def piece_bounds(numel: int, rank: int, world_size: int) -> tuple[int, int, int]:
    """(piece length, first, end) of piece ``rank`` of ``world_size`` of ``numel`` elements zero-padded to a multiple
    of ``world_size``; ``first == end`` for a piece that is all padding."""
    chunk = -(-numel // world_size)
    return chunk, min(rank * chunk, numel), min((rank + 1) * chunk, numel)


def shard_of(flat: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Piece ``rank`` of ``world_size`` of a 1-D tensor zero-padded to a multiple of ``world_size`` (a new tensor)."""
    chunk, first, end = piece_bounds(flat.numel(), rank, world_size)
    out = torch.zeros(chunk, dtype=flat.dtype, device=flat.device)
    out[: end - first] = flat[first:end]
    return out


class ShardedEMA(EMA):
    """``EMA`` whose shadow is this rank's piece of each trainable weight; ``update`` needs ``values``: the
    optimizer's master pieces ``masters_of(optimizer)``. Arguments as ``EMA`` (``enabled`` aside: every rank keeps
    its pieces), plus this rank and the number of ranks the optimizer shards over."""

    collective = True  # save / state_dict / copy_to involve every rank

    def __init__(self, model: nn.Module, rank: int, world_size: int, **kwargs):
        if kwargs.pop("enabled", True) is False:
            raise ValueError("a sharded EMA lives on every rank; pass sharded=False for one kept on rank 0")
        self.rank, self.world_size = int(rank), int(world_size)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {rank} is not one of {world_size} ranks")
        self.shapes: dict[str, torch.Size] = {}
        self._layout_checked = False
        super().__init__(model, enabled=True, **kwargs)

    def _init_shadow(self, name: str, param: torch.Tensor) -> torch.Tensor:
        self.shapes[name] = param.shape
        flat = param.detach().reshape(-1).to(device=self.device or param.device, dtype=self.dtype)
        return shard_of(flat, self.rank, self.world_size)

    def _value_for(self, name: str, param: torch.Tensor, instead: dict) -> torch.Tensor:
        value = instead.get(id(param))
        if value is None:
            raise RuntimeError(
                f"sharded EMA: no master piece for {name!r}; update() needs values=masters_of(optimizer) "
                "(a LowLevelZero optimizer with master weights)"
            )
        if value.numel() != self.shadow[name].numel():
            raise ValueError(
                f"sharded EMA: the master piece of {name!r} has {value.numel()} elements, not "
                f"{self.shadow[name].numel()}: the optimizer does not shard over {self.world_size} ranks as assumed"
            )
        return value.detach().view(-1)

    def masters_of(self, optimizer) -> dict:
        """{id(working parameter): this rank's fp32 master piece}; checks once that the optimizer shards every
        parameter over this EMA's ranks in this EMA's place."""
        from .zero_single_rank import master_shards

        found = master_shards(optimizer)
        if found is None:
            raise RuntimeError(
                "sharded EMA: the role's optimizer keeps no master pieces (not LowLevelZero, or CPU-offloaded); "
                "set ema=dict(..., sharded=False)"
            )
        masters, layouts = found
        if not self._layout_checked:
            wrong = {layout for layout in layouts if layout != (self.rank, self.world_size)}
            if wrong:
                raise RuntimeError(
                    f"sharded EMA: built for rank {self.rank} of {self.world_size}, but the optimizer shards as "
                    f"(rank, ranks) {sorted(wrong)}; set ema=dict(..., sharded=False)"
                )
            self._layout_checked = True
        return masters

    # ---- whole tensors: collectives ---------------------------------------------------------------------------
    def _comm_device(self, shard: torch.Tensor) -> torch.device:
        if dist.is_initialized() and dist.get_backend() == "nccl" and shard.device.type != "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return shard.device

    @torch.no_grad()
    def gathered(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """Every rank calls it: the whole EMA tensors (shadow dtype) on ``device`` on rank 0, {} on the others.
        One parameter at a time, so the transient memory is one parameter's pieces. If rank 0 fails to keep a
        tensor (host memory), it still takes part in every gather and raises after the last one, so the ranks never
        end up in different collectives."""
        self.fence()
        whole, failure = {}, None
        for name, shard in self.shadow.items():
            if self.world_size == 1:
                pieces = [shard]
            else:
                sent = shard.to(self._comm_device(shard))
                pieces = [torch.empty_like(sent) for _ in range(self.world_size)]
                dist.all_gather(pieces, sent)
            if self.rank == 0 and failure is None:
                try:
                    shape = self.shapes[name]
                    whole[name] = torch.cat(pieces)[: shape.numel()].view(shape).to(device).clone()
                except Exception as exc:  # noqa: BLE001 - re-raised below, after every rank's last gather
                    failure, whole = exc, {}
        if failure is not None:
            raise failure
        return whole

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every rank calls it: weight name -> whole EMA tensor on rank 0 (CPU), {} on the others."""
        return self.gathered()

    @torch.no_grad()
    def copy_to(self, model: nn.Module | None) -> None:
        """Every rank calls it: the EMA weights written into ``model`` on rank 0 (others may pass None)."""
        whole = self.gathered()
        if self.rank == 0 and model is not None:
            self._write_into(model, whole)

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Whole tensors (as ``state_dict`` / the file hold them) -> this rank's pieces; no collective."""
        self._check_keys(state, strict)
        self.fence()
        for name, shard in self.shadow.items():
            if name in state:
                shard.copy_(self._piece(name, state[name]))

    def _piece(self, name: str, value: torch.Tensor) -> torch.Tensor:
        if value.shape != self.shapes[name]:
            raise ValueError(f"EMA weight {name!r} has shape {tuple(value.shape)}, not {tuple(self.shapes[name])}")
        return shard_of(value.reshape(-1), self.rank, self.world_size)

    def save(self, path: str | Path) -> None:
        """Every rank calls it; rank 0 writes the whole tensors (``EMA.save``'s file)."""
        whole = self.gathered()
        if self.rank == 0:
            self.write(path, whole)

    def write(self, path: str | Path, whole: dict[str, torch.Tensor]) -> None:
        """Rank 0: write ``gathered()``'s tensors as ``EMA.save``'s file (no collective; the checkpoint gathers
        before the writes that only some ranks do)."""
        save_file({k: v.contiguous() for k, v in whole.items()}, str(path), metadata=self._metadata())

    def load(self, path: str | Path, strict: bool = True) -> None:
        """Each rank reads only the rows of each tensor its piece lies in; no collective."""
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            names = set(handle.keys())
            self._check_keys(dict.fromkeys(names), strict)
            self.fence()
            with torch.no_grad():
                for name, shard in self.shadow.items():
                    if name in names:
                        shard.copy_(self._read_piece(handle, name))
            self._read_metadata(handle.metadata() or {})

    def _read_piece(self, handle, name: str) -> torch.Tensor:
        """This rank's piece of the file's tensor ``name`` (an open safetensors file), read by the rows holding it."""
        stored = handle.get_slice(name)
        shape = self.shapes[name]
        if tuple(stored.get_shape()) != tuple(shape):
            raise ValueError(f"EMA weight {name!r} has shape {tuple(stored.get_shape())}, not {tuple(shape)}")
        if len(shape) == 0:
            return self._piece(name, handle.get_tensor(name))
        chunk, start, end = piece_bounds(shape.numel(), self.rank, self.world_size)
        piece = torch.zeros(chunk, dtype=self.dtype)  # a piece past the end is all padding
        if start < end:
            row = shape.numel() // shape[0]
            first, last = start // row, -(-end // row)
            values = stored[first:last].reshape(-1)[start - first * row : end - first * row]
            piece[: values.numel()] = values
        return piece
