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
* ``decode`` (GPU1, or GPU0 for the groups ``Plan.decode_lanes`` puts there)  VAE decode of the chunk's x0 (+ copy
  to pinned host memory); one decoder per group, fed its chunks in order (a causal decoder carries state); on its
  GPU's *decode stream* by default (``Plan.decode_stream``, see below).

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

The decode, for the same reason (measured on 2 H200s with the real-size VAE at 480x832: a ~180 ms chunk decode,
~10x a chunk's passes, on GPU1's compute stream held back every stage1 / update issued after it, GPUs busy
0.67 / 0.65 where the simulator, which let them pass, said 0.98): with ``Plan.decode_stream = "side"`` each GPU
decodes on a decode stream of its own, which waits for the chunk's x0 (an event) and keeps a video's chunks in
order (one stream per GPU, a video's decoder on one GPU); nothing but the next decode and the host copy depends
on a decode, so no compute stream ever waits for one. Kernels of two streams share one GPU, though: ``simulate``
and ``in_order_timeline`` run the decode on a lane of its own per GPU and slow both tasks down while they overlap
(``contention``, see ``simulate``). ``"compute"`` keeps the decode on the compute stream (for A/B timing).
Measured the same way on 2026-11-27: side 1.34x one GPU, compute 1.28x, both still ~0.70 busy. Most of the wait
was elsewhere: the chunks' copies to the host shared the copy streams with the GPU-to-GPU hand-offs
(``Lanes(host_copies=...)``, runtime.py), which this simulator does not model. With a host-copy stream of
its own per GPU (now the default) the side decode measured 1.85x and 0.96 busy on both GPUs.
"""

from __future__ import annotations

import heapq
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

OVERLAP_MODES = ("off", "basic", "aggressive")
KINDS = ("prep", "stage0", "stage1", "update", "decode")
DEVICE_OF_KIND = {"prep": 0, "stage0": 0, "stage1": 1, "update": 1, "decode": 1}
PREP_STREAM = 2  # timing lane of ``prep``: GPU0's prep stream, beside its compute stream (lane 0)
DECODE_STREAMS = (3, 4)  # timing lanes of a side-stream ``decode``: GPU0's and GPU1's decode streams
LANES = (0, 1, PREP_STREAM, *DECODE_STREAMS)
DECODE_STREAM_MODES = ("side", "compute")
HOST_COPY_MODES = ("shared", "own")  # Lanes(host_copies=...): which stream copies chunks to the host
# While a compute-stream task and a decode-stream task overlap on one GPU, each runs at 1 / (1 + contention) of its
# speed alone. 0.5: a guess between independent lanes (0) and no gain from overlap (1), until a run fits it.
DEFAULT_CONTENTION = 0.5
DEFAULT_COSTS = {"prep": 0.05, "stage0": 1.0, "stage1": 1.0, "update": 0.02, "decode": 0.5}


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
        decode: decode every chunk.
        decode_lanes: the GPU that decodes each group's chunks (one entry per group; empty: all on GPU1). A causal
            decoder is stateful (conv caches, running norm statistics), so one video's chunks are decoded in order
            by one decoder on one GPU; different videos may decode on different GPUs.
        decode_stream: ``side`` (each GPU decodes on a decode stream of its own, overlapping its compute stream) or
            ``compute`` (on the compute stream, in front of the tasks issued after it).
    """

    num_groups: int = 1
    num_branches: int = 1
    num_chunks: int = 1
    num_steps: int = 1
    refill: bool = False
    cached: bool = True
    decode: bool = True
    decode_lanes: Tuple[int, ...] = ()
    decode_stream: str = "side"

    def __post_init__(self):
        if self.decode_stream not in DECODE_STREAM_MODES:
            raise ValueError(f"decode_stream must be one of {DECODE_STREAM_MODES}, got {self.decode_stream!r}")
        for name in ("num_groups", "num_branches", "num_chunks", "num_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"Plan.{name} must be >= 1, got {getattr(self, name)}")
        if self.refill and not self.cached:
            raise ValueError("refill writes the KV cache: it needs cached=True")
        lanes = tuple(int(lane) for lane in self.decode_lanes)
        if lanes and (len(lanes) != self.num_groups or any(lane not in (0, 1) for lane in lanes)):
            raise ValueError(f"decode_lanes needs one lane (0 or 1) per group, got {self.decode_lanes}")
        object.__setattr__(self, "decode_lanes", lanes)

    def decode_lane(self, group: int) -> int:
        """The GPU that decodes ``group``'s chunks."""
        return self.decode_lanes[group] if self.decode_lanes else DEVICE_OF_KIND["decode"]

    def decode_task(self, group: int, chunk: int) -> "Task":
        return Task("decode", group, chunk, lane=self.decode_lane(group), side=self.decode_stream == "side")

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
    lane: int = -1  # a decode's GPU (``Plan.decode_lane``); -1: the kind's own (``DEVICE_OF_KIND``)
    side: bool = False  # a decode on its GPU's decode stream (``Plan.decode_stream == "side"``)

    @property
    def device(self) -> int:
        return DEVICE_OF_KIND[self.kind] if self.lane < 0 else self.lane

    @property
    def stream(self) -> int:
        """The timing lane: the device's compute stream, ``PREP_STREAM`` for a prep, the device's
        ``DECODE_STREAMS`` entry for a side-stream decode."""
        if self.kind == "prep":
            return PREP_STREAM
        return DECODE_STREAMS[self.device] if self.side else self.device

    def __str__(self) -> str:
        parts = [self.kind, f"g{self.group}", f"c{self.chunk}"]
        if self.step >= 0:
            parts.append(f"s{self.step}")
        if self.branch >= 0:
            parts.append(f"b{self.branch}")
        if self.lane >= 0:
            parts.append(f"gpu{self.lane}")
        if self.side:
            parts.append("side")
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
                order.append(plan.decode_task(g, c))
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
                dec = plan.decode_task(g, c)
                deps[dec] = [Task("update", g, c, plan.num_steps - 1)]
                if c > 0:
                    deps[dec].append(plan.decode_task(g, c - 1))  # a streaming decoder consumes chunks in order
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
    busy: Tuple[float, float]  # per device: time its compute or decode stream has work (preps not counted)

    @property
    def busy_fraction(self) -> Tuple[float, float]:
        return tuple(b / self.makespan if self.makespan else 0.0 for b in self.busy)


def _busy(start: Mapping[Task, float], finish: Mapping[Task, float]) -> Tuple[float, float]:
    """Per device, the length of the union of its compute and decode tasks' intervals (as ``summarize_timeline``
    merges the measured ones)."""
    busy = [0.0, 0.0]
    for device in (0, 1):
        spans = sorted((start[t], finish[t]) for t in start if t.kind != "prep" and t.device == device)
        end = None
        for s, e in spans:
            if end is None or s > end:
                busy[device] += e - s
                end = e
            elif e > end:
                busy[device] += e - end
                end = e
    return tuple(busy)


def _play(deps, costs, contention: float, pick, on_ready) -> Tuple[Dict[Task, float], Dict[Task, float], List[Task]]:
    """The event loop of ``simulate`` and ``in_order_timeline``. Whenever one of ``LANES`` is free it starts the task
    ``pick(lane)`` gives (None: it stays idle); a task whose dependencies have all finished goes to ``on_ready``.
    While a GPU's compute lane and its decode lane both run a task, each progresses at 1 / (1 + ``contention``) of
    its speed (preps share nothing). Returns start and finish times and the tasks in the order they started."""
    users = defaultdict(list)
    waiting = {t: len(d) for t, d in deps.items()}
    for t, d in deps.items():
        for p in d:
            users[p].append(t)
    for t, n in waiting.items():
        if n == 0:
            on_ready(t)
    start, finish, started = {}, {}, []
    free_at = {lane: 0.0 for lane in LANES}
    running: Dict[Task, List[float]] = {}  # task -> [end at the current rates, rate]
    now = 0.0

    def retime() -> None:  # the rates of the tasks still running, and their ends at those rates
        active = [t for t, (end, _) in running.items() if end > now and t.kind != "prep"]
        per_gpu = defaultdict(int)
        for t in active:
            per_gpu[t.device] += 1
        for t in active:
            end, rate = running[t]
            new = 1.0 / (1.0 + contention * (per_gpu[t.device] - 1))
            if new != rate:
                running[t] = [now + (end - now) * rate / new, new]
                free_at[t.stream] = running[t][0]

    while len(finish) < len(deps):
        began = False
        for lane in LANES:
            t = pick(lane) if free_at[lane] <= now else None
            if t is not None:
                start[t] = now
                started.append(t)
                free_at[lane] = now + costs[t.kind]
                running[t] = [free_at[lane], 1.0]
                began = True
        if began:
            retime()
            continue
        if not running:
            raise ValueError("no stream can go on: a task waits for one issued after it on its stream")
        end = max(now, min(e for e, _ in running.values()))
        now = end
        for t in [t for t, (e, _) in running.items() if e <= end]:  # all that end now, before choosing the next
            del running[t]
            finish[t] = end
            for u in users[t]:
                waiting[u] -= 1
                if waiting[u] == 0:
                    on_ready(u)
        retime()
    return start, finish, started


def simulate(
    plan: Plan,
    mode: str = "basic",
    costs: Optional[Mapping[str, float]] = None,
    prefetch: int = 1,
    serial: Optional[bool] = None,
    contention: float = DEFAULT_CONTENTION,
) -> Simulation:
    """List-schedule the task graph on two devices with per-kind ``costs`` (a stream never idles while one of its
    tasks is ready; ties go to the oldest work; preps run on GPU0's prep stream, beside its compute stream, and
    side-stream decodes on their GPU's decode stream). ``serial`` (default: ``mode == "off"``) runs the natural
    order one task at a time instead. Returns the issue order and the predicted timeline.

    ``contention`` models two streams sharing one GPU: while a compute-stream task and a decode-stream task overlap
    on a GPU, both progress at 1 / (1 + contention) of their speed alone; 0 makes the lanes independent, 1 gives
    overlap no gain (the pair takes as long as one after the other). Two tasks of costs a <= d started together
    thus end at a (1 + c) and d + c a: the overlapped part of the shorter one costs c times itself extra."""
    if contention < 0:
        raise ValueError(f"contention must be >= 0, got {contention}")
    costs = {**DEFAULT_COSTS, **(costs or {})}
    deps = build_graph(plan, mode, prefetch)
    natural = natural_order(plan)
    topo = _topological_index(deps, natural)
    serial = (mode == "off") if serial is None else serial
    start, finish = {}, {}
    if serial:
        now, busy = 0.0, [0.0, 0.0]
        for t in natural:
            start[t], now = now, now + costs[t.kind]
            finish[t] = now
            if t.kind != "prep":
                busy[t.device] += costs[t.kind]
        return Simulation(list(natural), start, finish, now, tuple(busy))
    pending = {lane: [] for lane in LANES}  # ready tasks per stream: (priority, topo, task)

    def pick(lane):
        return heapq.heappop(pending[lane])[2] if pending[lane] else None

    def on_ready(t):
        heapq.heappush(pending[t.stream], (_priority(t), topo[t], t))

    start, finish, order = _play(deps, costs, contention, pick, on_ready)
    return Simulation(order, start, finish, max(finish.values()), _busy(start, finish))


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


def schedule(
    plan: Plan,
    mode: str,
    costs: Optional[Mapping[str, float]] = None,
    prefetch: int = 1,
    contention: float = DEFAULT_CONTENTION,
) -> Simulation:
    """The issue order a run uses, with its predicted timeline. ``aggressive`` issues the stage tasks exactly as
    ``basic`` does and only hoists each chunk's ``prep`` to its earliest allowed point (``hoist_preps``): its own
    list schedule reordered the groups' stage tasks around the earlier preps, and on 2 H200s that order ran slower
    than ``basic``'s in most rows (1.26x vs 1.66x, 1.66x vs 1.98x of one GPU)."""
    if mode == "aggressive":
        order = hoist_preps(plan, simulate(plan, "basic", costs, prefetch, contention=contention).order, prefetch)
        sim = in_order_timeline(plan, order, mode, costs, prefetch, contention)
    else:
        sim = simulate(plan, mode, costs, prefetch, contention=contention)
    check_order(plan, sim.order, mode, prefetch)
    return sim


def hoist_preps(plan: Plan, order: Sequence[Task], prefetch: int = 1) -> List[Task]:
    """``order`` (``basic``'s) with each chunk's ``prep`` moved up to just after the last task ``aggressive`` makes
    it wait for (the previous chunk's prep and the first stage0 of chunk ``c - prefetch``, every branch) and the
    prep issued before it in ``order``; the other tasks keep their relative order.

    So every stream (both compute streams, and the prep stream, whose preps keep ``order``'s sequence) runs the
    same tasks in the same sequence as with ``order``, and each prep waits for tasks that finish no later than
    those it waits for in ``basic`` (stage0 of chunk c - prefetch at step 0 runs before stage0 of c - 1 at its
    last step on GPU0): by induction over the issue order, with independent streams (``contention=0``) no task
    starts later than in ``basic`` (``in_order_timeline``; tests/test_pipeline_parallel.py checks it over plans and
    costs). Where a GPU's decode stream slows its compute stream, an earlier start may meet a decode it missed."""
    deps = build_graph(plan, "aggressive", prefetch)
    out = [t for t in order if t.kind != "prep"]
    previous = None
    for prep in [t for t in order if t.kind == "prep"]:
        after = [out.index(d) for d in deps[prep]] + ([out.index(previous)] if previous is not None else [])
        out.insert(max(after) + 1 if after else 0, prep)
        previous = prep
    return out


def in_order_timeline(
    plan: Plan,
    order: Sequence[Task],
    mode: str,
    costs: Optional[Mapping[str, float]] = None,
    prefetch: int = 1,
    contention: float = DEFAULT_CONTENTION,
) -> Simulation:
    """The timeline of ``order`` issued as the executor issues it: each stream (the two compute streams, GPU0's prep
    stream, the decode streams) runs its tasks in issue order, a task starting once its stream is free and its
    dependencies have finished; a GPU's compute and decode streams share it as ``simulate``'s ``contention`` says.
    Nothing else couples the streams: a prep issues no work and no wait on GPU1 (see the module docstring), so
    hoisting preps (``aggressive``) leaves both compute streams' sequences as they were and, with independent lanes
    (``contention=0``), can only make a stage0 start earlier."""
    costs = {**DEFAULT_COSTS, **(costs or {})}
    deps = build_graph(plan, mode, prefetch)
    queues = {lane: deque(t for t in order if t.stream == lane) for lane in LANES}
    ready = set()

    def pick(lane):
        queue = queues[lane]
        return queue.popleft() if queue and queue[0] in ready else None

    start, finish, _ = _play(deps, costs, contention, pick, ready.add)
    return Simulation(list(order), start, finish, max(finish.values()), _busy(start, finish))
