"""What every family of CUDA graphs the sampler replays shares (the whole-pass graphs of ``pass_graphs``, the chunk
passes of ``streaming.chunk_graphs``, the Jano levels of ``cache.region_graphs``): static input buffers that copy a
source only when it changed, the part of a graph's key its buffers depend on, and the family's counters. The capture
itself (one memory pool, side-stream warm-up, shared output buffers) is ``models.mmdit.graph_memory``'s."""

from __future__ import annotations

import weakref
from typing import Dict, List, Optional

import torch

from opensora.models.mmdit.graph_memory import GraphMemory


def clone(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.detach().clone()


def clone_tree(out):
    """A graph output (a tensor, or a stage's dict of tensors / None) cloned out of the graph's buffers."""
    if isinstance(out, dict):
        return {name: clone(t) for name, t in out.items()}
    return clone(out)


def describe_inputs(inputs) -> tuple:
    """(name, (shape, dtype, device) or None) of every input: the part of a graph's key its static buffers depend on."""
    return tuple((name, None if t is None else (tuple(t.shape), t.dtype, t.device)) for name, t in inputs.items())


class StaticInputs:
    """The static input buffers of one pass shape, and which source tensors they last received (held weakly: a
    shape's buffers must not keep the last chunk's mask or RoPE tables alive until that shape runs again)."""

    def __init__(self, inputs: Dict[str, Optional[torch.Tensor]]):
        self.inputs = {name: clone(t) for name, t in inputs.items()}
        self.sources: Dict[str, tuple] = {}  # name -> (weak reference to the source, its version at the copy)

    def load(self, name: str, source: Optional[torch.Tensor], always: bool = False) -> None:
        dst = self.inputs[name]
        if dst is None or (not always and self.holds(name, source)):
            return
        dst.copy_(source)
        self.sources[name] = (weakref.ref(source), source._version)

    def holds(self, name: str, source: torch.Tensor) -> bool:
        """Whether the buffer of ``name`` already holds ``source`` (the very tensor last copied, unmodified since)."""
        last = self.sources.get(name)
        return last is not None and last[0]() is source and source._version == last[1]


class PassGraphFamily:
    """What every family of whole-pass graphs keeps (``ChunkGraphs``, ``pass_graphs.PassGraphs``): one memory, static
    inputs and a graph per key, the keys whose capture failed, and the counters ``summary`` reports."""

    def __init__(self, memory: Optional[GraphMemory] = None):
        self.memory = memory if memory is not None else GraphMemory()  # pool, output and cached-video buffers
        self.statics: Dict[tuple, StaticInputs] = {}
        self.graphs: Dict[tuple, object] = {}
        self.failed: set = set()
        self.failures: List[str] = []
        self.captures = self.replays = self.eager = 0

    @staticmethod
    def usable(x: torch.Tensor) -> bool:
        """Whether passes on ``x``'s device can be graphed (CUDA only)."""
        return x.is_cuda and torch.cuda.is_available()

    @property
    def summary(self) -> dict:
        return dict(
            graphs=len(self.graphs),
            captures=self.captures,
            replays=self.replays,
            eager=self.eager,
            failures=list(self.failures),
        )
