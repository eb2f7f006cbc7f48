"""Two-GPU pipeline overlap for streaming (and bidirectional) sampling, bit-identical to one GPU (FlashVSR-style).

The MMDiT's blocks are split at ``split``: GPU0 ("stage 0") holds the input embedders and blocks[0..split], GPU1
("stage 1") holds blocks[split+1..], the final layer, the sampler update and the VAE decode. Each GPU keeps the KV
caches of its own blocks. One process drives both GPUs: every GPU runs its tasks in the schedule's order on its
compute stream (issued by its own host thread, see ``run``), activations cross on side streams with events, so no
host thread waits on a GPU and the two GPUs overlap wherever the dependencies allow.

The work of a run is a graph of tasks over (group, branch, chunk, step):

* ``prep``   (GPU0, "stage A")  chunk context: noise, RoPE tables, timestep/conditioning vectors, made on GPU0's
  *prep stream* (a side stream: it overlaps stage0 instead of queuing in front of it) and touching nothing of
  GPU1 (what GPU1 needs of it is pulled by GPU1's first task that reads it);
* ``stage0`` (GPU0)  patchify + embed + blocks[:split] of one branch at one step (its caches for those blocks);
* ``stage1`` (GPU1)  blocks[split:] + final layer of the same forward;
* ``update`` (GPU1)  CFG combine of the group's branches + sampler step (or the chunk's x0 at its last step);
* ``decode`` (GPU1)  VAE decode of the chunk's x0 (+ copy to pinned host memory).

A *group* is one independent work unit (a prompt / micro-batch of prompts, with its own caches); its *branches*
are the CFG passes (cond, uncond) when they run as separate micro-batches, each with its own caches (the streaming
sampler's default layout puts both passes as rows of one batch: one branch); steps ``0..S-1`` denoise, step ``S`` is the cache
refill (the chunk's final x0 re-run at context noise 0 with ``store_kv``, Self-Forcing style) when refill is on,
for every chunk but the last (nothing reads its cache; ``StreamingGenerator`` skips it too);
without refill the last denoising step writes the cache (FlashVSR's one-step case). Bidirectional sampling is
the same graph with one chunk and no cache.

Dependencies (``build_graph``): stage0(c, 0) needs prep(c) and the cache write of chunk c-1 in blocks[:split]
(stage0 of c-1's writer step); stage1 needs its stage0 (activation copy) and, at step 0, the cache write of c-1
in blocks[split:]; step k > 0 (and the refill) needs update(k-1); update needs every branch's stage1; decode needs
the chunk's x0 and the previous chunk's decode. So per (group, branch) every block's cache is written window by
window, and within a forward block by block, exactly as on one GPU: the output cannot change, only when it is
computed. Same shapes, same kernels: the result is bit-identical to the single-GPU run with the same micro-batches.

How much overlaps is set by the dependencies, not by the scheduler. One video with refill: stage0 of chunk t+1
needs stage0 of t's refill, which needs t's final x0 (stage1 of its last step), so only the refill's stage1 and
the decode of t overlap stage0 of t+1: at best ~4/3x with one step + refill, less with more steps. Without refill
(the cache written by the denoising pass) or with 2+ independent groups in flight (GPipe-style micro-batches),
the two stages overlap fully and ~2x is reachable. ``simulate`` predicts this for any plan and cost model.

Modes (``--pp-overlap``): ``off`` issues the plain sequential order and makes every task wait for the previous one
(model parallelism, no overlap); ``basic`` issues in the order of a list-scheduling simulation (2 stages: GPU1
finishes stage1 + decode of window t-1 while GPU0 runs stage0 of window t), with each chunk's prep issued just
before its first stage0; ``aggressive`` also prepares the context of the next window ahead (a queue of window
contexts: prep of chunk t+1 may run as soon as chunk t started stage0), so stage0 never waits for it (3 stages).

Why a prep must not touch GPU1 (measured on 2 H200s, 2026-11-23: ``aggressive`` 5-8% slower than ``basic`` with the
same stage order): CUDA streams are FIFO queues, so a wait on GPU1's compute stream issued by a prep holds back every
GPU1 task issued after it, whether it depends on the prep or not. The prep used to pull the chunk's RoPE tables
onto GPU1 (a copy waiting for an event recorded on GPU0 at the prep's position, which GPU1's stream then waited
for): hoisted to just after chunk t's first stage0, that made GPU1's tasks issued next (chunk t-1's refill stage1,
the other group's update) wait until GPU0 had finished that stage0. Now the prep runs on its own stream of GPU0 and
GPU1's streams see exactly ``basic``'s operations in ``basic``'s order in both modes; ``in_order_timeline`` and
``simulate`` time preps on that side stream.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import sys
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

OVERLAP_MODES = ("off", "basic", "aggressive")
KINDS = ("prep", "stage0", "stage1", "update", "decode")
DEVICE_OF_KIND = {"prep": 0, "stage0": 0, "stage1": 1, "update": 1, "decode": 1}
PREP_STREAM = 2  # timing lane of ``prep``: GPU0's prep stream, beside its compute stream (lane 0)
DEFAULT_COSTS = {"prep": 0.05, "stage0": 1.0, "stage1": 1.0, "update": 0.02, "decode": 0.5}
HOST_SLAB_BYTES = 16 << 20  # pinned host memory per allocation of ``Lanes.to_host``


# ----------------------------------------------------------------------------------------------------------
# 1. Tasks, dependency graph, schedules (pure Python)
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """What one run computes.

    Args:
        num_groups: independent work units in flight (own noise, own caches), e.g. prompts or micro-batches.
        num_branches: CFG passes per group (1: no guidance; 2: cond + uncond), each with its own caches.
        num_chunks: windows per group (1 for bidirectional sampling).
        num_steps: denoising steps per chunk.
        refill: re-run each chunk's final x0 at context noise 0 to write the caches (one extra forward per chunk;
            not for the last chunk, whose cache no chunk reads: ``StreamingGenerator`` skips it too).
        cached: the model keeps KV caches across chunks (streaming); False for bidirectional sampling.
        decode: decode every chunk on GPU1.
    """

    num_groups: int = 1
    num_branches: int = 1
    num_chunks: int = 1
    num_steps: int = 1
    refill: bool = False
    cached: bool = True
    decode: bool = True

    def __post_init__(self):
        for name in ("num_groups", "num_branches", "num_chunks", "num_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"Plan.{name} must be >= 1, got {getattr(self, name)}")
        if self.refill and not self.cached:
            raise ValueError("refill writes the KV cache: it needs cached=True")

    @property
    def forwards_per_chunk(self) -> int:
        """Forwards of a chunk that is refilled (every chunk but the last one when ``refill``)."""
        return self.num_steps + (1 if self.refill else 0)

    def forwards(self, chunk: int) -> int:
        """Forwards of ``chunk``: its steps, plus the refill unless it is the last chunk."""
        return self.num_steps + (1 if self.refill and chunk < self.num_chunks - 1 else 0)

    @property
    def total_forwards(self) -> int:
        """Forwards of one (group, branch) over all chunks."""
        return sum(self.forwards(c) for c in range(self.num_chunks))

    def writes_kv(self, chunk: int) -> bool:
        """Whether ``chunk`` stores its keys/values (not the last chunk with refill: it has no refill pass)."""
        return self.writer_step is not None and self.writer_step < self.forwards(chunk)

    @property
    def writer_step(self) -> Optional[int]:
        """The step whose forward stores the chunk's keys/values (None without a cache)."""
        if not self.cached:
            return None
        return self.num_steps if self.refill else self.num_steps - 1

    def store_kv(self, step: int) -> bool:
        return step == self.writer_step


@dataclass(frozen=True, order=True)
class Task:
    kind: str
    group: int
    chunk: int
    step: int = -1  # -1: prep and decode
    branch: int = -1  # -1: prep, update and decode

    @property
    def device(self) -> int:
        return DEVICE_OF_KIND[self.kind]

    @property
    def stream(self) -> int:
        """The timing lane: the device's compute stream, or ``PREP_STREAM`` for a prep."""
        return PREP_STREAM if self.kind == "prep" else self.device

    def __str__(self) -> str:
        parts = [self.kind, f"g{self.group}", f"c{self.chunk}"]
        if self.step >= 0:
            parts.append(f"s{self.step}")
        if self.branch >= 0:
            parts.append(f"b{self.branch}")
        return ".".join(parts)


def natural_order(plan: Plan) -> List[Task]:
    """The single-GPU order: group by group, chunk by chunk, step by step, branch by branch."""
    order = []
    for g in range(plan.num_groups):
        for c in range(plan.num_chunks):
            order.append(Task("prep", g, c))
            for k in range(plan.forwards(c)):
                for b in range(plan.num_branches):
                    order += [Task("stage0", g, c, k, b), Task("stage1", g, c, k, b)]
                if k < plan.num_steps:
                    order.append(Task("update", g, c, k))
            if plan.decode:
                order.append(Task("decode", g, c))
    return order


def build_graph(plan: Plan, mode: str = "basic", prefetch: int = 1) -> Dict[Task, List[Task]]:
    """Task -> the tasks it waits for. Data and cache dependencies are the same in every mode; ``mode`` only sets
    when a chunk's ``prep`` may run (``basic``: after the previous chunk's last stage0, i.e. just in time;
    ``aggressive``: ``prefetch`` chunks ahead, once that chunk started stage0; ``off``: as basic)."""
    if mode not in OVERLAP_MODES:
        raise ValueError(f"unknown overlap mode '{mode}'; choose one of {OVERLAP_MODES}")
    deps: Dict[Task, List[Task]] = {}
    w = plan.writer_step
    for g in range(plan.num_groups):
        for c in range(plan.num_chunks):
            prep = Task("prep", g, c)
            deps[prep] = []
            if c > 0:
                deps[prep].append(Task("prep", g, c - 1))  # host RNG draws in chunk order
                if mode == "aggressive":
                    ahead = c - max(1, prefetch)
                    if ahead >= 0:
                        deps[prep] += [Task("stage0", g, ahead, 0, b) for b in range(plan.num_branches)]
                else:
                    last_k = plan.forwards(c - 1) - 1
                    deps[prep] += [Task("stage0", g, c - 1, last_k, b) for b in range(plan.num_branches)]
            for k in range(plan.forwards(c)):
                for b in range(plan.num_branches):
                    s0, s1 = Task("stage0", g, c, k, b), Task("stage1", g, c, k, b)
                    deps[s0] = [prep] if k == 0 else [Task("update", g, c, k - 1)]
                    deps[s1] = [s0]
                    if k == 0 and c > 0 and w is not None:
                        deps[s0].append(Task("stage0", g, c - 1, w, b))  # blocks[:split] hold chunk c-1
                        deps[s1].append(Task("stage1", g, c - 1, w, b))  # blocks[split:] hold chunk c-1
                if k < plan.num_steps:
                    deps[Task("update", g, c, k)] = [Task("stage1", g, c, k, b) for b in range(plan.num_branches)]
            if plan.decode:
                dec = Task("decode", g, c)
                deps[dec] = [Task("update", g, c, plan.num_steps - 1)]
                if c > 0:
                    deps[dec].append(Task("decode", g, c - 1))  # a streaming decoder consumes chunks in order
    return deps


def _topological_index(deps: Mapping[Task, Sequence[Task]], order: Sequence[Task]) -> Dict[Task, int]:
    """Position of every task in a topological order that follows ``order`` where it can (Kahn, stable)."""
    rank = {t: i for i, t in enumerate(order)}
    indegree = {t: len(d) for t, d in deps.items()}
    users = defaultdict(list)
    for t, d in deps.items():
        for p in d:
            users[p].append(t)
    ready = [(rank[t], t) for t, n in indegree.items() if n == 0]
    heapq.heapify(ready)
    index = {}
    while ready:
        _, t = heapq.heappop(ready)
        index[t] = len(index)
        for u in users[t]:
            indegree[u] -= 1
            if indegree[u] == 0:
                heapq.heappush(ready, (rank[u], u))
    if len(index) != len(deps):
        raise ValueError("the task graph has a cycle")
    return index


def _priority(task: Task) -> tuple:
    """Oldest work first (chunk, then step), then group and branch: GPipe's fill-drain order per step."""
    step_rank = {"prep": -1, "decode": 10**6}.get(task.kind, task.step)
    return (task.chunk, step_rank, task.group, task.branch, KINDS.index(task.kind))


@dataclass
class Simulation:
    order: List[Task]  # host issue order (a topological order)
    start: Dict[Task, float]
    finish: Dict[Task, float]
    makespan: float
    busy: Tuple[float, float]  # busy time per device

    @property
    def busy_fraction(self) -> Tuple[float, float]:
        return tuple(b / self.makespan if self.makespan else 0.0 for b in self.busy)


def simulate(
    plan: Plan,
    mode: str = "basic",
    costs: Optional[Mapping[str, float]] = None,
    prefetch: int = 1,
    serial: Optional[bool] = None,
) -> Simulation:
    """List-schedule the task graph on two devices with per-kind ``costs`` (a device never idles while one of its
    tasks is ready; ties go to the oldest work; preps run on GPU0's prep stream, beside its compute stream).
    ``serial`` (default: ``mode == "off"``) runs the natural order one task at a time instead. Returns the issue
    order and the predicted timeline (``busy``: the two compute streams)."""
    costs = {**DEFAULT_COSTS, **(costs or {})}
    deps = build_graph(plan, mode, prefetch)
    natural = natural_order(plan)
    topo = _topological_index(deps, natural)
    serial = (mode == "off") if serial is None else serial
    start, finish = {}, {}
    busy = [0.0, 0.0]
    if serial:
        now = 0.0
        for t in natural:
            start[t], now = now, now + costs[t.kind]
            finish[t] = now
            if t.stream != PREP_STREAM:
                busy[t.device] += costs[t.kind]
        return Simulation(list(natural), start, finish, now, tuple(busy))
    users = defaultdict(list)
    waiting = {t: len(d) for t, d in deps.items()}
    for t, d in deps.items():
        for p in d:
            users[p].append(t)
    ready_at: Dict[Task, float] = {t: 0.0 for t, n in waiting.items() if n == 0}
    lanes = (0, 1, PREP_STREAM)
    free_at = [0.0] * len(lanes)
    running: List[Tuple[float, int, Task]] = []  # (finish, topo, task)
    started_as: Dict[Task, int] = {}  # the sequence tasks started in (zero-cost tasks share a start time)
    pending = {lane: [] for lane in lanes}  # ready tasks per stream: (priority, topo, task)
    for t in ready_at:
        heapq.heappush(pending[t.stream], (_priority(t), topo[t], t))
    now = 0.0
    while len(finish) < len(deps):
        started = False
        for lane in lanes:
            if free_at[lane] <= now and pending[lane]:
                _, _, t = heapq.heappop(pending[lane])
                s = max(now, ready_at[t])
                start[t] = s
                started_as[t] = len(started_as)
                free_at[lane] = s + costs[t.kind]
                if lane != PREP_STREAM:
                    busy[lane] += costs[t.kind]
                heapq.heappush(running, (free_at[lane], topo[t], t))
                started = True
        if started:
            continue
        end = running[0][0]
        now = max(now, end)
        while running and running[0][0] <= end:  # every task that ends now, before choosing the next ones
            _, _, t = heapq.heappop(running)
            finish[t] = end
            for u in users[t]:
                waiting[u] -= 1
                if waiting[u] == 0:
                    ready_at[u] = end
                    heapq.heappush(pending[u.stream], (_priority(u), topo[u], u))
    order = sorted(deps, key=lambda t: (start[t], started_as[t]))
    return Simulation(order, start, finish, max(finish.values()), tuple(busy))


def check_order(plan: Plan, order: Sequence[Task], mode: str = "basic", prefetch: int = 1) -> None:
    """Raise if ``order`` is not a valid issue order: every task once, after all its dependencies (a CUDA event
    must be recorded before another stream waits on it), and every (group, branch)'s KV writes window-major."""
    deps = build_graph(plan, mode, prefetch)
    if sorted(order) != sorted(deps):
        raise AssertionError("the order does not hold every task exactly once")
    seen = set()
    for t in order:
        missing = [p for p in deps[t] if p not in seen]
        if missing:
            raise AssertionError(f"{t} is issued before its dependencies {[str(p) for p in missing]}")
        seen.add(t)
    writes = defaultdict(list)  # (kind, group, branch) -> chunks in write order
    for t in order:
        if t.kind in ("stage0", "stage1") and plan.store_kv(t.step):
            writes[(t.kind, t.group, t.branch)].append(t.chunk)
    for key, chunks in writes.items():
        if chunks != sorted(chunks) or len(chunks) != sum(map(plan.writes_kv, range(plan.num_chunks))):
            raise AssertionError(f"KV writes of {key} are not window-major: {chunks}")


def schedule(plan: Plan, mode: str, costs: Optional[Mapping[str, float]] = None, prefetch: int = 1) -> Simulation:
    """The issue order a run uses, with its predicted timeline. ``aggressive`` issues the stage tasks exactly as
    ``basic`` does and only hoists each chunk's ``prep`` to its earliest allowed point (``hoist_preps``): its own
    list schedule reordered the groups' stage tasks around the earlier preps, and on 2 H200s that order ran slower
    than ``basic``'s in most rows (1.26x vs 1.66x, 1.66x vs 1.98x of one GPU)."""
    if mode == "aggressive":
        order = hoist_preps(plan, simulate(plan, "basic", costs, prefetch).order, prefetch)
        sim = in_order_timeline(plan, order, mode, costs, prefetch)
    else:
        sim = simulate(plan, mode, costs, prefetch)
    check_order(plan, sim.order, mode, prefetch)
    return sim


def hoist_preps(plan: Plan, order: Sequence[Task], prefetch: int = 1) -> List[Task]:
    """``order`` (``basic``'s) with each chunk's ``prep`` moved up to just after the last task ``aggressive`` makes
    it wait for (the previous chunk's prep and the first stage0 of chunk ``c - prefetch``, every branch) and the
    prep issued before it in ``order``; the other tasks keep their relative order.

    So every stream (both compute streams, and the prep stream, whose preps keep ``order``'s sequence) runs the
    same tasks in the same sequence as with ``order``, and each prep waits for tasks that finish no later than
    those it waits for in ``basic`` (stage0 of chunk c - prefetch at step 0 runs before stage0 of c - 1 at its
    last step on GPU0): by induction over the issue order, no task starts later than in ``basic``
    (``in_order_timeline``; tests/test_pipeline_parallel.py checks it over plans and costs)."""
    deps = build_graph(plan, "aggressive", prefetch)
    out = [t for t in order if t.kind != "prep"]
    previous = None
    for prep in [t for t in order if t.kind == "prep"]:
        after = [out.index(d) for d in deps[prep]] + ([out.index(previous)] if previous is not None else [])
        out.insert(max(after) + 1 if after else 0, prep)
        previous = prep
    return out


def in_order_timeline(
    plan: Plan, order: Sequence[Task], mode: str, costs: Optional[Mapping[str, float]] = None, prefetch: int = 1
) -> Simulation:
    """The timeline of ``order`` issued as the executor issues it: each stream (the two compute streams and GPU0's
    prep stream) runs its tasks in issue order, a task starting once its stream is free and its dependencies have
    finished. Nothing else couples the streams: a prep issues no work and no wait on GPU1 (see the module
    docstring), so hoisting preps (``aggressive``) leaves both compute streams' sequences as they were and can only
    make a stage0 start earlier."""
    costs = {**DEFAULT_COSTS, **(costs or {})}
    deps = build_graph(plan, mode, prefetch)
    start, finish, free_at, busy = {}, {}, [0.0, 0.0, 0.0], [0.0, 0.0]
    for t in order:
        start[t] = max([free_at[t.stream]] + [finish[d] for d in deps[t]])
        finish[t] = free_at[t.stream] = start[t] + costs[t.kind]
        if t.stream != PREP_STREAM:
            busy[t.stream] += costs[t.kind]
    return Simulation(list(order), start, finish, max(finish.values()), tuple(busy))


# ----------------------------------------------------------------------------------------------------------
# 2. Devices: compute streams, cross-device copies on side streams, profiling
# ----------------------------------------------------------------------------------------------------------
def _tree_map(fn, tree):
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, (list, tuple)):
        return type(tree)(_tree_map(fn, x) for x in tree)
    if isinstance(tree, dict):
        return {k: _tree_map(fn, v) for k, v in tree.items()}
    return tree


class Lanes:
    """The two devices of a pipeline (may be the same device, or both CPU for tests).

    Compute runs on each device's current stream. ``pull`` brings a value produced on another device (ready when
    ``ready`` fires) onto another lane: a peer copy on side streams that waits on the producer's event only (not
    on later work of the producer's GPU), with the consumer's compute stream waiting on the copy. The destination
    tensor is ``record_stream``-ed onto the consumer stream, the source onto the side stream that reads it, so
    neither's memory is reused while the copy may still touch it. ``to_host`` copies into pinned memory on a
    side stream and keeps the source alive until the copy's event completes.
    """

    def __init__(self, devices: Sequence[Any], profile: bool = False):
        if len(devices) != 2:
            raise ValueError(f"a two-stage pipeline needs 2 devices, got {list(devices)}")
        self.devices = tuple(torch.device(d) for d in devices)
        for i, d in enumerate(self.devices):
            if d.type == "cuda" and d.index is None:
                self.devices = (
                    self.devices[:i] + (torch.device("cuda", torch.cuda.current_device()),) + self.devices[i + 1 :]
                )
        self.cuda = all(d.type == "cuda" for d in self.devices)
        if not self.cuda and any(d.type == "cuda" for d in self.devices):
            raise ValueError(f"mixing CPU and CUDA pipeline devices is not supported: {self.devices}")
        self.copy_streams = {d: torch.cuda.Stream(d) for d in set(self.devices)} if self.cuda else {}
        self.prep_streams = {d: torch.cuda.Stream(d) for d in set(self.devices)} if self.cuda else {}
        self.keepalive: deque = deque()
        self.profile = profile
        self.records: List[Tuple[Task, int, Any, Any, float]] = []  # (task, lane, start, end, host_issue_s)
        self.origin: Dict[int, Any] = {}
        self.copy_bytes = 0
        self._host_slab: Optional[torch.Tensor] = None  # pinned bytes ``to_host`` carves its outputs from
        self._host_used = 0

    def stream(self, lane: int):
        return torch.cuda.current_stream(self.devices[lane]) if self.cuda else None

    def event(self, lane: int, timing: bool = False):
        """An event recorded now on ``lane``'s compute stream (None on CPU)."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event(enable_timing=timing)
        ev.record(self.stream(lane))
        return ev

    def device_context(self, lane: int):
        return torch.cuda.device(self.devices[lane]) if self.cuda else contextlib.nullcontext()

    def prep_stream(self, lane: int):
        """Context making ``lane``'s prep stream (a side stream of its device) the current stream: what a ``prep``
        queues there overlaps the compute stream's work instead of waiting behind it and delaying what follows."""
        if not self.cuda:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.prep_streams[self.devices[lane]])

    def wait(self, lane: int, ready) -> None:
        """``lane``'s current stream waits for ``ready`` (an event; None: nothing to wait for, as on the CPU)."""
        if self.cuda and ready is not None:
            self.stream(lane).wait_event(ready)

    def hand_over(self, tree, lane: int) -> None:
        """The CUDA tensors of ``tree`` on ``lane``'s device, made on another stream of it (the prep stream), will be
        read by the lane's compute stream: ``record_stream`` them, so the allocator does not hand their memory to
        the prep stream again while the compute stream may still read it."""
        if not self.cuda:
            return
        stream, device = self.stream(lane), self.devices[lane]

        def keep(t: torch.Tensor):
            if t.device == device:
                t.record_stream(stream)
            return t

        _tree_map(keep, tree)

    def pull(self, value, ready, lane: int):
        dst = self.devices[lane]

        def move(x: torch.Tensor):
            if x.device == dst:
                return x
            if not self.cuda:
                return x.to(dst)
            # A cross-device copy_ runs on the *source* device's current stream with a barrier against the
            # destination's current stream: make both the side streams, or the copy would queue behind (and
            # the consumer wait for) whatever the source GPU's compute stream was given after the producer.
            src_stream, dst_stream = self.copy_streams[x.device], self.copy_streams[dst]
            if ready is not None:
                src_stream.wait_event(ready)
            with torch.cuda.stream(src_stream), torch.cuda.stream(dst_stream):
                y = torch.empty_like(x, device=dst)
                y.copy_(x, non_blocking=True)
            done = torch.cuda.Event()
            done.record(dst_stream)  # the copy's barrier made dst_stream wait for it
            self.stream(lane).wait_event(done)
            y.record_stream(self.stream(lane))  # allocated on dst_stream, read by the consumer's compute stream
            x.record_stream(src_stream)  # read by src_stream: not reused before the copy is done
            self.copy_bytes += x.numel() * x.element_size()
            return y

        return _tree_map(move, value)

    def to_host(self, x: torch.Tensor, ready, lane: int):
        """Non-blocking copy into pinned host memory; returns (host tensor, event); read it after the event."""
        if not self.cuda:
            return x.to("cpu"), None
        copy_stream = self.copy_streams[self.devices[lane]]
        if ready is not None:
            copy_stream.wait_event(ready)
        out = self._pinned(x.shape, x.dtype)
        with torch.cuda.stream(copy_stream):
            out.copy_(x, non_blocking=True)
        done = torch.cuda.Event()
        done.record(copy_stream)
        self.keepalive.append((done, x))
        return out, done

    def _pinned(self, shape, dtype) -> torch.Tensor:
        """An empty pinned host tensor, a view of a slab of at least ``HOST_SLAB_BYTES``: a run's outputs (x0 and
        frames of every chunk) take one or two page-locked allocations instead of one each (24 for 2 items x 6
        chunks; ~0.4 ms of host time each, and CUDA lists a page-locked allocation among the operations that may
        serialise streams). A slab lives as long as any output viewing it."""
        numel = 1
        for n in shape:
            numel *= int(n)
        itemsize = dtype.itemsize
        nbytes = -(-numel * itemsize // 512) * 512  # every view 512-byte aligned
        if self._host_slab is None or self._host_used + nbytes > self._host_slab.numel():
            self._host_slab = torch.empty(max(nbytes, HOST_SLAB_BYTES), dtype=torch.uint8, pin_memory=True)
            self._host_used = 0
        view = self._host_slab[self._host_used : self._host_used + numel * itemsize]
        self._host_used += nbytes
        return view.view(dtype).view(tuple(shape))

    def release(self) -> None:
        """Drop the sources of finished copies (never blocks)."""
        while self.keepalive and self.keepalive[0][0].query():
            self.keepalive.popleft()

    def synchronize(self) -> None:
        if self.cuda:
            for d in set(self.devices):
                torch.cuda.synchronize(d)
        self.keepalive.clear()

    # --- profiling: CUDA events per task on its lane's stream, NVTX ranges around the host issue --------------
    def begin(self) -> None:
        self.records.clear()
        if self.cuda:
            self.synchronize()
            self.origin = {lane: self.event(lane, timing=True) for lane in (0, 1)}
        else:
            self.origin = {0: time.perf_counter(), 1: time.perf_counter()}

    @contextlib.contextmanager
    def task(self, task: Task):
        lane = task.device
        if not self.profile:
            yield
            return
        if self.cuda:
            torch.cuda.nvtx.range_push(str(task))
            start = self.event(lane, timing=True)
            t0 = time.perf_counter()
            yield
            end = self.event(lane, timing=True)
            torch.cuda.nvtx.range_pop()
        else:
            t0 = start = time.perf_counter()
            yield
            end = time.perf_counter()
        self.records.append((task, lane, start, end, time.perf_counter() - t0))

    def timeline(self) -> List[dict]:
        """Per task: lane, start and end in ms since the run began (per-device clocks, aligned at a full sync)."""
        self.synchronize()
        rows = []
        for task, lane, start, end, host in self.records:
            if self.cuda:
                s, e = self.origin[lane].elapsed_time(start), self.origin[lane].elapsed_time(end)
            else:
                s, e = (start - self.origin[lane]) * 1e3, (end - self.origin[lane]) * 1e3
            rows.append(
                dict(
                    task=str(task),
                    kind=task.kind,
                    group=task.group,
                    chunk=task.chunk,
                    step=task.step,
                    branch=task.branch,
                    lane=lane,
                    start_ms=s,
                    end_ms=e,
                    host_ms=host * 1e3,
                )
            )
        return rows


def summarize_timeline(rows: Sequence[dict]) -> dict:
    """Busy time, idle time and busy fraction per GPU (intervals merged), and time per stage per chunk."""
    if not rows:
        return {}
    span = max(r["end_ms"] for r in rows) - min(r["start_ms"] for r in rows)
    lanes = {}
    for lane in (0, 1):
        intervals = sorted((r["start_ms"], r["end_ms"]) for r in rows if r["lane"] == lane)
        busy, cur_s, cur_e = 0.0, None, None
        for s, e in intervals:
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    busy += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        if cur_e is not None:
            busy += cur_e - cur_s
        lanes[f"gpu{lane}"] = dict(busy_ms=busy, idle_ms=span - busy, busy_fraction=busy / span if span else 0.0)
    per_chunk = defaultdict(lambda: defaultdict(float))
    for r in rows:
        per_chunk[r["chunk"]][r["kind"]] += r["end_ms"] - r["start_ms"]
    per_kind = defaultdict(float)
    for r in rows:
        per_kind[r["kind"]] += r["end_ms"] - r["start_ms"]
    return dict(
        span_ms=span,
        lanes=lanes,
        ms_per_kind=dict(per_kind),
        ms_per_chunk={c: dict(v) for c, v in sorted(per_chunk.items())},
        host_issue_ms=sum(r["host_ms"] for r in rows),
    )


# ----------------------------------------------------------------------------------------------------------
# 3. The executor: issue the tasks of a schedule against a ``stages`` object
# ----------------------------------------------------------------------------------------------------------
class Stages:
    """What the executor calls (all on the lane of the task kind; see the module docstring).

    ``prepare(group, chunk) -> ctx`` (ctx["x"]: the chunk's initial latent on lane 0; called with lane 0's prep
    stream current, and it must queue nothing on lane 1: a value lane 1 needs is pulled by the first lane-1 task
    that reads it, see the module docstring); ``stage0(ctx, branch, step,
    x, store_kv) -> activations`` (lane 0); ``stage1(ctx, branch, step, activations, store_kv) -> model output``
    (lane 1); ``update(ctx, step, outputs, x) -> next x`` (lane 1; at the last step the chunk's x0);
    ``decode(ctx, x0) -> frames`` (lane 1).
    """

    plan: Plan

    def prepare(self, group: int, chunk: int) -> dict: ...
    def stage0(self, ctx, branch: int, step: int, x, store_kv: bool): ...
    def stage1(self, ctx, branch: int, step: int, activations, store_kv: bool): ...
    def update(self, ctx, step: int, outputs: List[torch.Tensor], x: torch.Tensor) -> torch.Tensor: ...
    def decode(self, ctx, x0: torch.Tensor) -> torch.Tensor: ...


class _Value:
    """A tensor (tree) produced on one lane, with the event that makes it ready and its copies on other lanes.
    ``side``: made on a side stream (a prep's), so a consumer on the producer's own device waits for ``ready`` too
    (a consumer on the other device waits through ``pull``)."""

    __slots__ = ("copies", "ready", "lane", "side")

    def __init__(self, value, lane, ready, side: bool = False):
        self.copies, self.lane, self.ready, self.side = {lane: value}, lane, ready, side

    def on(self, lanes: Lanes, lane: int):
        if self.side and lanes.devices[lane] == lanes.devices[self.lane]:
            lanes.wait(lane, self.ready)
        if lane not in self.copies:
            self.copies[lane] = lanes.pull(self.copies[self.lane], self.ready, lane)
        return self.copies[lane]


@dataclass
class RunResult:
    latents: Dict[Tuple[int, int], torch.Tensor]  # (group, chunk) -> x0 on the host
    frames: Dict[Tuple[int, int], torch.Tensor]  # (group, chunk) -> decoded frames on the host
    seconds: float
    timeline: List[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)

    def video(self, group: int) -> torch.Tensor:
        chunks = sorted(c for g, c in self.frames if g == group)
        return torch.cat([self.frames[(group, c)] for c in chunks], dim=self.time_dim)

    time_dim: int = 1


def run(stages, order: Sequence[Task], lanes: Lanes, serial: bool = False, threads: Optional[bool] = None) -> RunResult:
    """Issue ``order`` (a valid order for ``stages.plan``) and wait for the end. ``serial`` makes every task wait
    for the one issued before it (``--pp-overlap off``).

    ``threads`` (default: on for two different CUDA devices, off for CUDA-graphed stages): one host thread per lane issues that lane's tasks in
    the order's sequence (as torchgpipe does), waiting only for the *issue* of its cross-lane dependencies (the
    GPU-side wait is the CUDA event). PyTorch drops the GIL inside each op's dispatch and launch, so the two
    threads' launch overheads overlap: with one host thread a model whose per-forward launch time is comparable
    to its GPU time cannot overlap two GPUs. Off: one thread issues the whole order; with CUDA-graphed stages
    (``CausalStreamingStages(cuda_graphs=...)``: a pass is a few launches) that thread is never the bottleneck,
    and the loop holds no host sync (events order the GPUs; copies to the host are read after the final sync).
    """
    plan: Plan = stages.plan
    graphed = getattr(stages, "graphs", None) is not None
    if threads is None:
        threads = lanes.cuda and lanes.devices[0] != lanes.devices[1] and not graphed
    if threads and graphed and lanes.cuda:
        raise ValueError("CUDA-graphed stages must be issued from one host thread (threads=False)")
    deps = build_graph(plan)  # data/cache dependencies are the same in every mode
    values: Dict[tuple, _Value] = {}
    ctxs: Dict[Tuple[int, int], dict] = {}
    outputs: Dict[tuple, Any] = {}
    latents, frames = {}, {}
    tasks_of_chunk = defaultdict(int)
    for t in order:
        tasks_of_chunk[(t.group, t.chunk)] += 1
    issued_count = defaultdict(int)
    lock = threading.Lock()
    issued = {t: threading.Event() for t in order}
    position = {t: i for i, t in enumerate(order)}
    end_events: Dict[Task, Any] = {}
    failure: List[BaseException] = []

    def compute(task: Task, inputs) -> None:
        g, c, k, b = task.group, task.chunk, task.step, task.branch
        if task.kind == "prep":  # on lane 0's prep stream (``execute``)
            ctx = stages.prepare(g, c)
            ctxs[(g, c)] = ctx
            values[("x", g, c, 0)] = _Value(ctx["x"], 0, lanes.event(0), side=True)
        elif task.kind == "stage0":
            act = stages.stage0(ctxs[(g, c)], b, k, inputs, plan.store_kv(k))
            values[("act", g, c, k, b)] = _Value(act, 0, lanes.event(0))
        elif task.kind == "stage1":
            out = stages.stage1(ctxs[(g, c)], b, k, inputs, plan.store_kv(k))
            if k < plan.num_steps:  # the refill's output is never read
                outputs[(g, c, k, b)] = out
        elif task.kind == "update":
            outs = [outputs.pop((g, c, k, i)) for i in range(plan.num_branches)]
            x_next = stages.update(ctxs[(g, c)], k, outs, inputs)
            values[("x", g, c, k + 1)] = _Value(x_next, 1, lanes.event(1))
            if k == plan.num_steps - 1:
                latents[(g, c)] = lanes.to_host(x_next, values[("x", g, c, k + 1)].ready, 1)
        elif task.kind == "decode":
            video = stages.decode(ctxs[(g, c)], inputs)
            frames[(g, c)] = lanes.to_host(video, lanes.event(1), 1)
        else:  # pragma: no cover
            raise ValueError(task.kind)

    def execute(task: Task) -> None:
        lane, g, c, k, b = task.device, task.group, task.chunk, task.step, task.branch
        before = order[position[task] - 1] if serial and position[task] > 0 else None
        if before is not None:
            issued[before].wait()
        # a prep runs on its lane's prep stream (see the module docstring), everything else on the compute stream
        with lanes.device_context(lane), torch.no_grad():
            with lanes.prep_stream(lane) if task.kind == "prep" else contextlib.nullcontext():
                if before is not None and (before.device != lane or before.stream != task.stream):
                    lanes.wait(lane, end_events[before])  # serial: after the task issued before it, on any stream
                # inputs from the other GPU first: the stream waits for them before the task's timing starts
                inputs = None
                if task.kind == "stage0":
                    inputs = values[("x", g, c, k)].on(lanes, 0)
                elif task.kind == "stage1":
                    inputs = values.pop(("act", g, c, k, b)).on(lanes, 1)
                elif task.kind == "update":
                    inputs = values[("x", g, c, k)].on(lanes, 1)
                elif task.kind == "decode":
                    inputs = values[("x", g, c, plan.num_steps)].on(lanes, 1)
                with lanes.task(task):
                    compute(task, inputs)
                del inputs
                if serial:
                    end_events[task] = lanes.event(lane)  # on the stream the task ran on
            if task.kind == "prep":
                lanes.hand_over(ctxs[(g, c)], lane)
        with lock:
            issued_count[(g, c)] += 1
            if issued_count[(g, c)] == tasks_of_chunk[(g, c)]:  # every task of the chunk issued: free its values
                for key in [key for key in values if key[1] == g and key[2] == c]:
                    del values[key]
                ctxs.pop((g, c), None)
            lanes.release()
        issued[task].set()

    def issue(tasks: Sequence[Task], cross_lane: bool) -> None:
        try:
            for task in tasks:
                if failure:
                    return
                if cross_lane:
                    for dep in deps[task]:
                        if dep.device != task.device:
                            issued[dep].wait()
                execute(task)
        except BaseException as error:  # noqa: BLE001 - re-raised by the caller; unblock the other lane
            failure.append(error)
            for event in issued.values():
                event.set()

    lanes.begin()
    t0 = time.perf_counter()
    if threads:
        workers = [
            threading.Thread(
                target=issue, args=([t for t in order if t.device == lane], True), name=f"pp-lane{lane}", daemon=True
            )
            for lane in (0, 1)
        ]
        interval = sys.getswitchinterval()
        sys.setswitchinterval(min(interval, 5e-4))  # hand the GIL over often: each thread feeds a GPU
        try:
            for w in workers:
                w.start()
            for w in workers:
                w.join()
        finally:
            sys.setswitchinterval(interval)
    else:
        issue(order, False)
    if failure:
        lanes.synchronize()
        raise failure[0]
    timeline = lanes.timeline() if lanes.profile else []
    lanes.synchronize()
    seconds = time.perf_counter() - t0
    return RunResult(
        latents={key: v[0] for key, v in latents.items()},
        frames={key: v[0] for key, v in frames.items()},
        seconds=seconds,
        timeline=timeline,
        summary=summarize_timeline(timeline),
    )


def run_plan(
    stages,
    mode: str,
    lanes: Lanes,
    costs: Optional[Mapping[str, float]] = None,
    prefetch: int = 1,
    threads: Optional[bool] = None,
) -> Tuple[RunResult, Simulation]:
    """Schedule ``stages.plan`` for ``mode`` and run it."""
    sim = schedule(stages.plan, mode, costs, prefetch)
    return run(stages, sim.order, lanes, serial=(mode == "off"), threads=threads), sim


# ----------------------------------------------------------------------------------------------------------
# 4. Choosing the split
# ----------------------------------------------------------------------------------------------------------
def stage_costs(
    block_ms: Sequence[float],
    split: int,
    embed_ms: float,
    final_ms: float,
    update_ms: float,
    decode_ms: float,
    prep_ms: float,
) -> dict:
    """Per-kind costs for a split where GPU0 holds blocks[0..split] (inclusive)."""
    return dict(
        prep=prep_ms,
        stage0=embed_ms + sum(block_ms[: split + 1]),
        stage1=sum(block_ms[split + 1 :]) + final_ms,
        update=update_ms,
        decode=decode_ms,
    )


def choose_split(
    plan: Plan,
    mode: str,
    block_ms: Sequence[float],
    embed_ms: float,
    final_ms: float,
    update_ms: float = 0.0,
    decode_ms: float = 0.0,
    prep_ms: float = 0.0,
) -> Tuple[int, List[dict]]:
    """The split (index of GPU0's last block) with the smallest simulated time for ``plan`` under ``mode``, from
    measured per-block times; ties go to the most balanced split. Returns (split, one row per candidate)."""
    n = len(block_ms)
    if n < 2:
        raise ValueError("pipeline parallelism needs at least 2 blocks")
    rows = []
    for split in range(n - 1):
        costs = stage_costs(block_ms, split, embed_ms, final_ms, update_ms, decode_ms, prep_ms)
        sim = schedule(plan, mode if mode != "off" else "basic", costs)
        forwards = plan.total_forwards / plan.num_chunks  # per chunk, on average (the last one has no refill)
        gpu0 = forwards * costs["stage0"] + costs["prep"]
        gpu1 = forwards * costs["stage1"] + plan.num_steps * costs["update"] + costs["decode"]
        rows.append(
            dict(
                split=split,
                stage0_ms=costs["stage0"],
                stage1_ms=costs["stage1"],
                gpu0_ms_per_chunk=gpu0,
                gpu1_ms_per_chunk=gpu1,
                simulated_ms=sim.makespan,
            )
        )
    best = min(rows, key=lambda r: (round(r["simulated_ms"], 6), abs(r["gpu0_ms_per_chunk"] - r["gpu1_ms_per_chunk"])))
    return best["split"], rows


def tasks_per_kind(plan: Plan) -> Dict[str, int]:
    """How many tasks of each kind a run of ``plan`` issues."""
    items = plan.num_groups * plan.num_chunks
    return dict(
        prep=items,
        stage0=plan.num_groups * plan.num_branches * plan.total_forwards,
        stage1=plan.num_groups * plan.num_branches * plan.total_forwards,
        update=items * plan.num_steps,
        decode=items if plan.decode else 0,
    )


def measured_task_ms(plan: Plan, ms_per_kind: Mapping[str, float]) -> Dict[str, float]:
    """Mean GPU time per task of each kind from a profiled run (``RunResult.summary["ms_per_kind"]``; take it from
    ``off``, whose tasks do not overlap)."""
    counts = tasks_per_kind(plan)
    return {kind: ms_per_kind.get(kind, 0.0) / n for kind, n in counts.items() if n}


def calibrate_block_ms(
    block_ms: Sequence[float],
    num_double: int,
    split: int,
    embed_ms: float,
    final_ms: float,
    stage0_ms: float,
    stage1_ms: float,
) -> List[float]:
    """Per-block times (one graph per block, ``measure_stage_times``) rescaled so that the two stages at ``split``
    cost what whole passes were measured to cost (``stage0_ms`` / ``stage1_ms`` per pass, e.g. from
    ``measured_task_ms``): one factor for the double blocks (the first ``num_double``), one for the single blocks,
    solved from the two stages (embedding and final layer kept). Per-block graphs do not add up to a stage's pass:
    on 2 H200s (1B, split 10) they said 4.49 / 4.31 ms and the passes took 3.72 / 4.07 ms, the double blocks
    ~21% over and the single ones ~6%, so ``auto`` put one block too many on GPU1. Falls back to one factor for
    all blocks where the two equations do not determine two positive factors."""
    blocks = [float(b) for b in block_ms]
    on0 = [i <= split for i in range(len(blocks))]
    d0 = sum(b for i, b in enumerate(blocks) if i < num_double and on0[i])
    s0 = sum(b for i, b in enumerate(blocks) if i >= num_double and on0[i])
    d1 = sum(b for i, b in enumerate(blocks) if i < num_double and not on0[i])
    s1 = sum(b for i, b in enumerate(blocks) if i >= num_double and not on0[i])
    r0, r1 = stage0_ms - embed_ms, stage1_ms - final_ms
    det = d0 * s1 - s0 * d1
    double = single = None
    if abs(det) > 1e-12 * max(1.0, (d0 + s0) * (d1 + s1)):
        double, single = (r0 * s1 - s0 * r1) / det, (d0 * r1 - r0 * d1) / det
    if double is None or double <= 0 or single <= 0:
        total = sum(blocks)
        double = single = (r0 + r1) / total if total else 1.0
    return [b * (double if i < num_double else single) for i, b in enumerate(blocks)]


def calibrated_split(
    plan: Plan,
    mode: str,
    stage_times: Mapping,
    num_double: int,
    measured: Mapping[str, float],
) -> Tuple[int, List[dict], dict]:
    """``--pp-split auto`` from whole-pass measurements: the per-block probe times ``stage_times``
    (``measure_stage_times``: ``embed_ms``, ``block_ms``, ``final_ms``, ``decode_ms``) rescaled with
    ``calibrate_block_ms`` so that the stages at ``measured["split"]`` cost ``measured["stage0"]`` /
    ``measured["stage1"]`` ms per pass, then ``choose_split`` on those. ``measured`` comes from a profiled ``off``
    run (``measured_task_ms``: also ``prep`` / ``update`` / ``decode`` per task, used as their costs) or from a few
    timed passes (``stages.measure_stage_passes``: the decode then costs the probe's ``decode_ms``, prep
    and update 0, as ``choose_split`` has them by default). ``num_double``: the model's double blocks (the first
    ones). Returns (split, ``choose_split``'s candidates on the calibrated times, details: ``probe_split`` (the
    choice from the uncalibrated probe), ``block_ms`` (calibrated), ``costs`` (per-kind costs at the chosen split,
    the run's issue order), ``measured``)."""
    embed_ms, final_ms = float(stage_times["embed_ms"]), float(stage_times["final_ms"])
    probe = [float(b) for b in stage_times["block_ms"]]
    blocks = calibrate_block_ms(
        probe, num_double, int(measured["split"]), embed_ms, final_ms, measured["stage0"], measured["stage1"]
    )
    extra = dict(
        update_ms=float(measured.get("update", 0.0)),
        decode_ms=float(measured.get("decode", stage_times.get("decode_ms", 0.0))),
        prep_ms=float(measured.get("prep", 0.0)),
    )
    split, rows = choose_split(plan, mode, blocks, embed_ms, final_ms, **extra)
    probe_split, _ = choose_split(
        plan, mode, probe, embed_ms, final_ms, decode_ms=float(stage_times.get("decode_ms", 0.0))
    )
    costs = stage_costs(blocks, split, embed_ms, final_ms, extra["update_ms"], extra["decode_ms"], extra["prep_ms"])
    details = dict(probe_split=probe_split, block_ms=blocks, costs=costs, measured=dict(measured))
    return split, rows, details


def parse_split(value, num_blocks: int) -> Optional[int]:
    """``--pp-split``: ``auto`` (None) or the index of GPU0's last block, 0 <= N < num_blocks - 1."""
    if value is None or str(value) == "auto":
        return None
    split = int(value)
    if not 0 <= split < num_blocks - 1:
        raise ValueError(
            f"--pp-split {split} must lie in [0, {num_blocks - 2}] (index of GPU0's last block; "
            f"the model has {num_blocks} blocks)"
        )
    return split


def parse_devices(value) -> List[str]:
    devices = [d.strip() for d in (value.split(",") if isinstance(value, str) else value) if str(d).strip()]
    if len(devices) != 2:
        raise ValueError(f"--pp-devices needs exactly two devices (e.g. cuda:0,cuda:1), got {value!r}")
    return devices


def dump_json(path, payload) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)
