"""CUDA graphs of whole model passes for the bidirectional sampler (``VideoSampler.set_cuda_graphs``), GPU only.

Why: a sampling step is one forward of the network over fixed shapes (the CFG branches batched as rows), run 30 or
more times per video with only the latents and the time changing. On a GPU the host queues a few thousand kernels per
pass; where the passes are short (small models, low resolution, few rows) the host's launch rate, not the GPU, sets
the step time, and it moves from host to host. Replayed as a CUDA graph, a pass is one launch.

One graph per pass key: the shapes, dtypes and devices of the pass's tensor inputs, whether the text mask has padding
(the caller says so: ``MMDiT.key_mask`` would otherwise read the mask on the host, which a capture cannot do), the
model, and where its parameters and buffers live (a graph reads the weights at their addresses: weights updated in
place, by an optimizer or ``load_state_dict``, are seen by the next replay; weights re-made by ``model.to`` at new
addresses get a new graph). Replay = copy the inputs into the key's static buffers (``x`` and ``timestep`` always;
text, pooled vector and condition only when they are other tensors than at the last copy), replay, clone the
velocity out of the buffer it was copied into inside the graph (``GraphMemory.output``: one pool and one output
buffer per shape for all graphs, so a graph holds none of its pool alive). The first pass of a key runs the model
twice on a side stream and captures it: slower than eager once, then every step of every later video replays it.

The captured body is the model's own forward on the static inputs, so the result is the eager result up to the
kernels cuBLAS/cuDNN pick inside a capture (tests/test_pass_graphs_gpu.py compares them). A capture that fails leaves
that key eager (``failures`` says why). Off the GPU, with gradients enabled, or when the caller cannot say whether the
text mask is padded, every call is the plain forward.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Optional

import torch

from opensora.models.mmdit.graph_memory import GraphMemory, on_capture_device

from .graphs import PassGraphFamily, StaticInputs, describe_inputs

_FRESH = ("x", "timestep")  # what changes at every step of a video


class PassGraphs(PassGraphFamily):
    """Call it like the network: ``graphs(model, x, timestep=..., text_emb=..., text_mask=..., pooled=..., cond=...,
    text_mask_has_padding=...)`` (the accelerator calling convention of ``VideoSampler._model_fn``). ``graphs`` maps
    a key to (replay, {"out": the shared output buffer}, the CUDA graph)."""

    def __init__(self, memory: Optional[GraphMemory] = None, max_graphs: int = 8):
        super().__init__(memory)
        self.max_graphs = max_graphs  # distinct pass shapes kept; then all are dropped and captured again

    def __call__(self, model, x, timestep, text_emb, text_mask=None, pooled=None, cond=None, **kwargs):
        padding = kwargs.pop("text_mask_has_padding", None)

        def eager():
            self.eager += 1
            return model(
                x,
                timestep=timestep,
                text_emb=text_emb,
                text_mask=text_mask,
                pooled=pooled,
                cond=cond,
                text_mask_has_padding=padding,
                **kwargs,
            )

        if kwargs or not self.usable(x) or torch.is_grad_enabled() or (text_mask is not None and padding is None):
            return eager()
        inputs = dict(x=x, timestep=timestep, text_emb=text_emb, text_mask=text_mask, pooled=pooled, cond=cond)
        # a graph reads the weights at their addresses: weights moved or re-made (``model.to``) need a new capture.
        # Every tensor's address counts (~0.2 ms for the 1B model's ~600 tensors, <1% of its pass): after a round trip
        # the allocator may hand some addresses back and not others.
        weights = tuple(t.data_ptr() for t in itertools.chain(model.parameters(), model.buffers()))
        key = (id(model), weights, describe_inputs(inputs), padding)
        if key in self.failed:
            return eager()
        statics = self.statics.get(key)
        if statics is None:
            if len(self.graphs) >= self.max_graphs:  # a new shape past the limit: start over
                self.statics.clear()
                self.graphs.clear()
                self.memory = GraphMemory(self.memory.lane)
            statics = self.statics[key] = StaticInputs(inputs)
        for name, source in inputs.items():
            if source is not None:
                statics.load(name, source, always=name in _FRESH)
        entry = self.graphs.get(key)
        if entry is None:
            try:
                with on_capture_device(x.device):
                    entry = self._capture(model, statics.inputs, padding)
            except Exception as error:  # noqa: BLE001  (a capture that fails leaves the eager path)
                self.failed.add(key)
                self.statics.pop(key, None)
                self.failures.append(f"{type(error).__name__}: {error}")
                warnings.warn(f"CUDA graph capture of a sampling pass failed, running it eagerly: {error}")
                if x.is_cuda:
                    torch.cuda.synchronize(x.device)
                return eager()
            self.graphs[key] = entry
            self.captures += 1
        replay, holder = entry[0], entry[1]
        replay()
        self.replays += 1
        return holder["out"].clone()

    def _capture(self, model, static: dict, padding: Optional[bool]) -> tuple:
        """(replay, {"out": the shared output buffer}, graph) of one forward on the static inputs."""
        holder: dict = {}

        def body():
            out = model(text_mask_has_padding=padding, **static)
            holder["out"] = self.memory.output("velocity", out)

        replay, graph = self._record(body)
        return replay, holder, graph

    def _record(self, body):
        """Warm ``body`` up and capture it into ``memory``'s pool; (replay, graph). (CPU tests swap this for an eager
        replay to check the buffer plumbing.)"""
        graph = self.memory.capture(body)
        return graph.replay, graph
