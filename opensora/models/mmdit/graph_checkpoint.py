"""Checkpointed compiled blocks whose recompute lives inside the compiled graph (``MMDiT(checkpoint_in_graph=True)``,
the default).

The other path (``checkpoint_in_graph=False``) wraps a compiled block in ``torch.utils.checkpoint``: the backward
recomputes the block by calling its compiled forward again from Python, so per block the host runs Dynamo's guards,
the compiled wrapper and the checkpoint hooks a second time, and the recompute's kernels are launched apart from the
backward's. Compiling the checkpoint call itself hands the region to AOTAutograd, whose partitioner puts the
recompute into the block's compiled backward graph: one compiled backward call per block, no Python at recompute
time, and Inductor may fuse recomputed ops into the backward's kernels. What is kept for the backward is what
``torch.utils.checkpoint`` keeps (the block's inputs; the parameters by reference).

CPU (tiny model, tests/test_graph_checkpoint.py): the same gradients as the other path to float tolerance, the same
saved activations, one graph per block kind. H200, 2026-11-27 (benchmarks/padded_text_step.py, variants
``ours-padded-bound-graph-ckpt`` vs ``ours-padded-bound``; the 1B step, padded text, full checkpointing): 160.4 vs
173.3 ms, then 159.9 vs 162.7 ms in a second call (round medians 0.91-0.99x), steadier steps (p90/p10 1.03-1.05 vs
1.11-1.15), warm-up 21 vs 28 s, peak memory 17.40 vs 17.32 GiB; GPU tests (tests/test_text_padding_gpu.py) as close
to the fp32 masked reference as the other path with full and selective checkpointing, and matching eager for the
causal student and LoRA. Hence the default; ``checkpoint_in_graph=False`` keeps checkpointing around the compiled
block. Sequence parallelism never reaches this path: it refuses compiled blocks (``MMDiT.set_sequence_parallel``)."""

from typing import Callable, Dict, Tuple

import torch
from torch.utils.checkpoint import checkpoint


# One function per block kind: Dynamo keeps compiled graphs, and its recompile limit, per code object, so the double
# and single blocks (and their dynamic-shape recompiles) do not share one cache.
def _checkpointed_double(block, *args):
    return checkpoint(block, *args, use_reentrant=False)


def _checkpointed_single(block, *args):
    return checkpoint(block, *args, use_reentrant=False)


_KINDS = {"double": _checkpointed_double, "single": _checkpointed_single}
_COMPILED: Dict[Tuple[str, str], Callable] = {}


def checkpointed_in_graph(kind: str, options: dict) -> Callable:
    """``fn(block, *args)``: ``block(*args)`` under non-reentrant checkpointing, compiled as one graph with the Inductor
    ``options`` (made once per kind and options, process-wide)."""
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {sorted(_KINDS)}, got {kind!r}")
    key = (kind, repr(sorted(options.items())))
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(_KINDS[kind], options=dict(options) or None)
    return _COMPILED[key]
