"""CUDA graphs of the Jano region forward's step levels (``--jano-graphs``), GPU only, off by default.

Why: at the 1B shape a level-1 step computes 460 of 2304 tokens, and the host needs as long to queue its few thousand
kernels as the GPU needs to run them (benchmarks/jano.py measures it): the step is launch-bound, so any host work of
a cache store shows 1:1 in the step time. Replayed as graphs, a step is a handful of launches, and the store's host
work hides behind the GPU.

One set of graphs per *level key*: (level, whether a level-2 step stores its medium entries, input shapes and dtypes,
text padding, the plan's counts (k_active, k_medium, tokens), the store). The token order of the region sets is a
static input, loaded when the plan changes: a new region analysis with the same counts replays the same graphs; new
counts or shapes capture new ones (at most ``max_levels`` keys are kept; then all are dropped and re-captured).

Where the cache is read and written:

* a *capturable* store (``offload.StaticDeviceStore``: caches on the GPU in fixed buffers) is part of the graph: the
  whole level is one graph, and one replay per step;
* an offload manager (``PackedOffloadManager(fixed_slots=True)``) does host work (events, copies on its side
  streams), so the level is cut at layer boundaries into *segments* of at most one staging slot of cache reads and
  of stores. Between segments the host calls the manager's verbs as the eager forward does: ``fetch`` before a
  segment (the compute stream waits on the H2D event of the chunk), ``release`` after it (the slot may be refilled),
  and the segment's stores (``store_async`` + ``flush``: D2H on the store stream). Fixed slots put every entry of a
  step at the same device address every time, which is what the graph read at capture; an entry fetched at another
  address (the ring re-made, a synchronous fallback) re-captures the segment (after ``max_recaptures`` it runs that
  segment eagerly). A segment writes its stores into one of two output slots (``out ring``: two slots of the largest
  segment's stores); before a segment overwrites a slot, the compute stream waits for the D2H copies of its last
  contents (an event on the manager's store stream).

Segments hand their state (hidden states, conditioning vector, RoPE rows, key mask) on through buffers shared by name
and shape (``GraphMemory.output``), two alternating sets, so a segment never writes its own inputs (its warm-up runs
it more than once). Capture uses ``GraphMemory`` as the streaming graphs do (one pool, per-device capture streams,
warm-up on the side stream, outputs cloned out after the replay).

The captured bodies are ``RegionForward``'s own ``prepare`` / ``run_layers`` / ``finish`` on the same values, so a
graph gives the eager result up to the kernels chosen inside a capture; with an eager "capture" (the CPU tests) bit for
bit. A capture that fails leaves that level key eager (``failures`` says why). Off the GPU or with gradients enabled
every call is the eager forward.
"""

from __future__ import annotations

import math
import warnings
import weakref
from typing import Dict, List, Optional

import torch

from opensora.models.mmdit.graph_memory import GraphMemory, on_capture_device

from ..graphs import StaticInputs, describe_inputs
from .plan import ACTIVE, FULL, MEDIUM, REFRESH, RegionPlan, entry_shapes
from .region_forward import RegionForward
from .stores import CacheStore

_ALIGN = 256
_STATE = ("img", "txt", "tokens")  # what changes from layer to layer
_CONSTANTS = ("vec", "mask")  # made before the first layer, read by all


def _host_only(value) -> bool:
    return value is not None and not isinstance(value, torch.Tensor)


class _SegmentStore:
    """The store a segment's body sees: entries the host fetched for it; stores go to the segment's output views."""

    def __init__(self):
        self.fetched: Dict[str, torch.Tensor] = {}
        self.outputs: Dict[str, torch.Tensor] = {}

    def fetch(self, key: str) -> torch.Tensor:
        return self.fetched[key]

    def release(self, key: str) -> None:
        pass

    def store_async(self, tensor: torch.Tensor, key: str) -> None:
        self.outputs[key].copy_(tensor)

    def flush(self) -> None:
        pass


class _Segment:
    """Layers ``lo`` to ``hi - 1`` of a level, the cache entries they read and store, and their graph."""

    def __init__(self, lo: int, hi: int, reads, stores):
        self.lo, self.hi, self.reads, self.stores = lo, hi, tuple(reads), tuple(stores)
        self.store = _SegmentStore()
        self.out_slot: Optional[int] = None
        self.body = None  # the segment's eager code (RegionGraphs._body), made once
        self.replay = None  # set by RegionGraphs._record
        self.graph = None
        self.captured: Dict[str, torch.Tensor] = {}  # the fetched entries the graph read at capture
        self.recaptures = 0
        self.eager = False


class _Level:
    """The graphs of one level key: its static inputs, static plan and segments."""

    def __init__(self, key, statics: StaticInputs, plan: Optional[RegionPlan], segments: List[_Segment], holds):
        self.key, self.statics, self.plan, self.segments = key, statics, plan, segments
        self.holds = holds  # objects whose identity is part of the key (kept alive, so the ids stay unique)
        self.saved: Dict[int, dict] = {}  # parity -> state buffers
        self.constants: dict = {}
        self.meta: dict = {}
        self.out: Optional[torch.Tensor] = None
        self.failed = False


class RegionGraphs:
    """Replays ``RegionForward`` levels as CUDA graphs (module docstring); called like ``RegionForward``."""

    def __init__(self, forward: RegionForward, memory: Optional[GraphMemory] = None, max_levels: int = 16):
        self.forward = forward
        self.model = forward.model
        self.num_layers = forward.num_layers
        self.memory = memory if memory is not None else GraphMemory(lane="jano")
        self.max_levels, self.max_recaptures = max_levels, 2
        self.levels: Dict[tuple, _Level] = {}
        self.failed: set = set()
        self.failures: List[str] = []
        self.captures = self.replays = self.eager = self.recaptures = self.eager_segments = 0
        self._out_ring: Optional[torch.Tensor] = None
        self._out_slot_bytes = 0
        self._out_done: List[object] = [None, None]  # per output slot: event after the D2H copies of its contents
        self._padding = (None, None, None)  # (weak text mask, its version, has padding)

    @staticmethod
    def usable(x: torch.Tensor) -> bool:
        """Whether levels on ``x``'s device can be graphed (CUDA only)."""
        return x.is_cuda and torch.cuda.is_available()

    def __call__(
        self,
        level,
        x,
        timestep,
        text_emb,
        text_mask=None,
        pooled=None,
        cond=None,
        guidance=None,
        text_mask_has_padding=None,
        plan: Optional[RegionPlan] = None,
        store: Optional[CacheStore] = None,
        store_medium: bool = True,
    ) -> torch.Tensor:
        args = (level, x, timestep, text_emb, text_mask, pooled, cond, guidance, text_mask_has_padding)
        capturable = level == FULL or (store is not None and store.capturable)
        segmentable = store is not None and store.staged  # host work between layers: cut at its slots
        if not self.usable(x) or torch.is_grad_enabled() or not (capturable or segmentable):
            self.eager += 1
            return self.forward(*args, plan=plan, store=store, store_medium=store_medium)
        if text_mask is not None and text_mask_has_padding is None:
            text_mask_has_padding = self._has_padding(text_mask)  # a host read: never inside a capture
        inputs = dict(
            x=x,
            timestep=timestep,
            text_emb=text_emb,
            text_mask=text_mask,
            pooled=pooled,
            cond=cond,
            guidance=guidance,
            order=None if plan is None else plan.order,
        )
        described = describe_inputs(inputs)
        counts = None if plan is None else (plan.k_active, plan.k_medium, plan.num_tokens)
        layout = None if store is None else store.layout
        key = (level, bool(store_medium), text_mask_has_padding, described, counts, id(store), id(layout))
        if key in self.failed:
            self.eager += 1
            return self.forward(*args, plan=plan, store=store, store_medium=store_medium)
        entry = self.levels.get(key)
        if entry is None:
            entry = self._new_level(key, level, inputs, plan, store, store_medium, capturable, (store, layout))
        for name, source in inputs.items():
            if source is not None:
                entry.statics.load(name, source, always=name in ("x", "timestep"))
        return self._run(entry, level, store, store_medium, capturable, text_mask_has_padding)

    # ---- building a level ---------------------------------------------------------------------------------
    def _new_level(self, key, level, inputs, plan, store, store_medium, capturable, holds) -> _Level:
        if len(self.levels) >= self.max_levels:
            self.levels.clear()  # new counts or shapes keep coming: start over rather than grow
        statics = StaticInputs(inputs)
        static_plan = None if plan is None else RegionPlan(statics.inputs["order"], plan.k_active, plan.k_medium)
        rows = inputs["x"].shape[0]
        if capturable:
            segments = [_Segment(0, self.num_layers, (), ())]
        else:
            chunk_of = None
            if level in (ACTIVE, MEDIUM):
                try:
                    chunk_of = store.chunk_of(static_plan.entry_keys(self.num_layers, level))
                except KeyError:  # entries not reserved yet: cut by bytes alone (the address check still holds)
                    chunk_of = None
            segments = self.segments(level, static_plan, rows, store.slot_bytes, store_medium, chunk_of, store.slots)
        entry = self.levels[key] = _Level(key, statics, static_plan, segments, holds)
        if not capturable:
            self._place_stores(entry, rows, inputs["x"].device)
        return entry

    def segments(
        self, level, plan: RegionPlan, rows: int, budget: int, store_medium: bool, chunk_of=None, slots: int = 3
    ) -> List[_Segment]:
        """Cut the layers into segments that read at most ``budget`` bytes of cache entries and store at most as
        many (one layer more than that is a segment of its own); the outputs' entries come last (a segment of no
        layers when they do not fit). ``chunk_of``: key -> the prefetch chunk it arrives in; a segment then also
        spans at most ``slots`` chunks, so all of them can sit in the staging ring at once."""
        shapes = entry_shapes(self.model, rows, plan, self.num_layers)
        itemsize = self.model.img_in.weight.element_size()
        nbytes = {key: math.prod(shape) * itemsize for key, shape in shapes.items()}
        chunk_of = chunk_of or {}

        def reads(name):
            return plan.reads(level, name) if level in (ACTIVE, MEDIUM) else []

        def stores(name):
            if level == REFRESH:
                return [k for k in (f"m_{name}", f"s_{name}") if k in shapes]
            if level == MEDIUM and store_medium and f"m_{name}" in shapes:
                return [f"m_{name}"]
            return []

        segments, lo, read_bytes, store_bytes, read_keys, store_keys = [], 0, 0, 0, [], []
        names = [f"kv_{layer}" for layer in range(self.num_layers)] + ["x"]
        for layer, name in enumerate(names):
            r, w = reads(name), stores(name)
            rb, wb = sum(nbytes[k] for k in r), sum(nbytes[k] for k in w)
            chunks = [chunk_of[k] for k in read_keys + r if k in chunk_of]
            span = max(chunks) - min(chunks) + 1 if chunks else 0
            if (read_keys or store_keys) and (read_bytes + rb > budget or store_bytes + wb > budget or span > slots):
                segments.append(_Segment(lo, layer, read_keys, store_keys))
                lo, read_bytes, store_bytes, read_keys, store_keys = layer, 0, 0, [], []
            read_keys, store_keys = read_keys + r, store_keys + w
            read_bytes, store_bytes = read_bytes + rb, store_bytes + wb
        segments.append(_Segment(min(lo, self.num_layers), self.num_layers, read_keys, store_keys))
        return segments

    def _place_stores(self, entry: _Level, rows: int, device) -> None:
        """Give every storing segment views into an output slot (alternating); grow the output ring if needed."""
        shapes = entry_shapes(self.model, rows, entry.plan, self.num_layers)
        dtype = self.model.img_in.weight.dtype
        itemsize = self.model.img_in.weight.element_size()
        layouts, need = [], 0
        for segment in entry.segments:
            offsets, at = {}, 0
            for key in segment.stores:
                offsets[key] = at
                at += -(-math.prod(shapes[key]) * itemsize // _ALIGN) * _ALIGN
            layouts.append(offsets)
            need = max(need, at)
        if need > self._out_slot_bytes:
            # a larger ring: graphs of other keys wrote into the old one, so they are made again when next used
            self.levels = {
                key: other
                for key, other in self.levels.items()
                if other is entry or all(segment.out_slot is None for segment in other.segments)
            }
            self._out_slot_bytes = need
            self._out_ring = torch.empty(2 * need, dtype=torch.uint8, device=device)
            self._out_done = [None, None]
        storing = 0
        for segment, offsets in zip(entry.segments, layouts):
            if not offsets:
                continue
            segment.out_slot = storing % 2
            storing += 1
            base = segment.out_slot * self._out_slot_bytes
            for key, at in offsets.items():
                size = math.prod(shapes[key]) * itemsize
                view = self._out_ring[base + at : base + at + size].view(dtype).view(shapes[key])
                segment.store.outputs[key] = view

    # ---- running a level ----------------------------------------------------------------------------------
    def _body(self, entry: _Level, index: int, level, store, store_medium: bool, capturable: bool, has_padding):
        """The eager code of segment ``index``: from the static inputs (first segment) or the state buffers, to the
        state buffers or the output buffer (last segment)."""
        forward, memory, segment = self.forward, self.memory, entry.segments[index]
        target = store if capturable else segment.store
        last = index == len(entry.segments) - 1

        def body():
            s = entry.statics.inputs
            if index == 0:
                state = forward.prepare(
                    level,
                    s["x"],
                    s["timestep"],
                    s["text_emb"],
                    s["text_mask"],
                    s["pooled"],
                    s["cond"],
                    s["guidance"],
                    has_padding,
                    entry.plan,
                    target,
                )
                entry.meta = dict(n_txt=state["n_txt"], grid=state["grid"])
                if not last:  # later segments read the constants from shared buffers
                    entry.constants = {  # a KeyRanges mask holds host ints only: nothing to keep in a buffer
                        name: state[name] if _host_only(state[name]) else memory.output(f"jano.{name}", state[name])
                        for name in _CONSTANTS
                    }
                    entry.constants["rope"] = tuple(
                        memory.output(f"jano.rope{i}", table) for i, table in enumerate(state["rope"])
                    )
            else:
                state = dict(entry.saved[index % 2], **entry.constants, **entry.meta)
            hooks = forward.hooks(level, entry.plan, target, entry.meta["n_txt"], store_medium)
            forward.run_layers(state, segment.lo, segment.hi, hooks)
            if last:
                entry.out = memory.output("jano.out", forward.finish(state, level, entry.plan, target, store_medium))
            else:
                parity = (index + 1) % 2
                entry.saved[parity] = {
                    name: memory.output(f"jano.state{parity}.{name}", state[name]) for name in _STATE if name in state
                }

        return body

    def _run(self, entry: _Level, level, store, store_medium: bool, capturable: bool, has_padding) -> torch.Tensor:
        backend = None if capturable else store.backend
        for index, segment in enumerate(entry.segments):
            if not capturable:
                segment.store.fetched = {key: store.fetch(key) for key in segment.reads}
                done = None if segment.out_slot is None else self._out_done[segment.out_slot]
                if done is not None:  # the slot's last contents have crossed the bus
                    backend.wait(backend.current_stream(), done)
            if segment.body is None:
                segment.body = self._body(entry, index, level, store, store_medium, capturable, has_padding)
            self._replay(entry, segment, segment.body)
            if not capturable:
                for key in segment.reads:
                    store.release(key)
                if segment.stores:
                    for key in segment.stores:
                        store.store_async(segment.store.outputs[key], key)
                    store.flush()
                    done = self._out_done[segment.out_slot]
                    if done is None:
                        done = self._out_done[segment.out_slot] = backend.new_event()
                    backend.record(done, store.store_stream)
        if not capturable:
            store.flush()
        self.replays += 1
        return entry.out.clone()

    def _replay(self, entry: _Level, segment: _Segment, body) -> None:
        if entry.failed or segment.eager:
            self.eager_segments += 1
            body()
            return
        if segment.replay is not None and not self._same_addresses(segment):
            if segment.recaptures >= self.max_recaptures:
                segment.eager = True
                self.eager_segments += 1
                body()
                return
            segment.recaptures += 1
            self.recaptures += 1
            segment.replay = None
        if segment.replay is None:
            device = entry.statics.inputs["x"].device
            try:
                with on_capture_device(device):
                    self._record(segment, body)
            except Exception as error:  # noqa: BLE001  (a capture that fails leaves the eager path)
                entry.failed = True
                self.failed.add(entry.key)
                self.failures.append(f"{type(error).__name__}: {error}")
                warnings.warn(f"CUDA graph capture failed for a Jano level, running it eagerly: {error}")
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                self.eager_segments += 1
                body()
                return
            segment.captured = dict(segment.store.fetched)
            self.captures += 1
        segment.replay()

    @staticmethod
    def _same_addresses(segment: _Segment) -> bool:
        for key, tensor in segment.store.fetched.items():
            old = segment.captured.get(key)
            if old is tensor:
                continue
            if old is None or old.data_ptr() != tensor.data_ptr() or old.shape != tensor.shape:
                return False
            if old.stride() != tensor.stride():
                return False
        return True

    def _record(self, segment: _Segment, body) -> None:
        """Warm ``body`` up, capture it into the shared pool and make ``segment.replay`` replay it (tests swap this
        for an eager replay to check the plumbing on a CPU)."""
        graph = self.memory.capture(body)
        segment.graph, segment.replay = graph, graph.replay

    def _has_padding(self, text_mask: torch.Tensor) -> bool:
        ref, version, value = self._padding
        if ref is None or ref() is not text_mask or version != text_mask._version:
            value = not bool(text_mask.bool().all())
            self._padding = (weakref.ref(text_mask), text_mask._version, value)
        return value

    def device_bytes(self) -> int:
        """Bytes of the output ring and the shared buffers (the graphs' pool is not counted)."""
        ring = 0 if self._out_ring is None else self._out_ring.numel()
        return ring + self.memory.nbytes

    @property
    def summary(self) -> dict:
        return dict(
            levels=len(self.levels),
            segments=sum(len(entry.segments) for entry in self.levels.values()),
            captures=self.captures,
            replays=self.replays,
            recaptures=self.recaptures,
            eager=self.eager,
            eager_segments=self.eager_segments,
            failures=list(self.failures),
        )
