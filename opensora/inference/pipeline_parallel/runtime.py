"""The two-GPU pipeline's runtime: ``Lanes`` (the two devices' compute streams, side streams for the cross-device
copies, events, profiling) and ``run``, which issues the tasks of a schedule (schedule.py) against a ``Stages``
object (stages.py, streaming_stages.py), one host thread per device."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..streaming.decode_ahead import decode_stream
from .schedule import DEFAULT_CONTENTION, HOST_COPY_MODES, Plan, Simulation, Task, build_graph, schedule

HOST_SLAB_BYTES = 16 << 20  # pinned host memory per allocation of ``Lanes.to_host``


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
    side stream and keeps the source alive until the copy's event completes. Side streams of a device: its prep
    stream (``prep_stream``) and its decode stream (``decode_stream``, one per device for the process).

    ``host_copies``: the stream ``to_host`` copies on. ``"shared"``: the device's copy stream, which every ``pull``
    from or to the device also uses. That stream then waits for the event of the value copied out (a chunk's frames:
    the end of its decode), and a peer copy waits for everything queued on the source's and the destination's
    copy streams (PyTorch's cross-device barrier), so every activation hand-off issued after a decode waits until
    the decode is done, on both GPUs. ``"own"`` (the default): a host-copy stream per device that no pull touches;
    measured on 2x H200 (480x832, real VAE) at 1.85x one GPU in two calls against 1.38-1.80x shared (decode on
    the side stream), and 1.72x against 1.40x (decode on the compute stream).
    """

    def __init__(self, devices: Sequence[Any], profile: bool = False, host_copies: str = "own"):
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
        if host_copies not in HOST_COPY_MODES:
            raise ValueError(f"host_copies must be one of {HOST_COPY_MODES}, got {host_copies!r}")
        self.host_copies = host_copies
        self.host_streams = self.copy_streams
        if self.cuda and host_copies == "own":
            self.host_streams = {d: torch.cuda.Stream(d) for d in set(self.devices)}
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

    def decode_stream(self, lane: int):
        """Context making ``lane``'s decode stream current: a chunk decode (~10x a chunk's passes with the real VAE)
        queued there overlaps the compute stream instead of holding back every pass issued after it. It is the
        process's decode stream of the device (``streaming.generator.decode_stream``, the one-GPU sampler's): a
        decoder kept across runs keeps its state tensors on one stream, and its high priority keeps it out of the
        normal-priority pool that every ``Lanes`` draws its copy and prep streams from (a pool stream handed out
        again as a copy stream would queue activation copies behind a decode)."""
        if not self.cuda:
            return contextlib.nullcontext()
        return torch.cuda.stream(decode_stream(self.devices[lane]))

    def side_stream(self, task: Task):
        """The stream context ``task`` runs in: its lane's prep or decode stream (``Task.stream``), else none."""
        if task.kind == "prep":
            return self.prep_stream(task.device)
        if task.side:
            return self.decode_stream(task.device)
        return contextlib.nullcontext()

    def wait(self, lane: int, ready) -> None:
        """``lane``'s current stream waits for ``ready`` (an event; None: nothing to wait for, as on the CPU)."""
        if self.cuda and ready is not None:
            self.stream(lane).wait_event(ready)

    def hand_over(self, tree, lane: int) -> None:
        """The CUDA tensors of ``tree`` on ``lane``'s device, made on another stream of it, will be read by the lane's
        current stream (the compute stream reading a prep's, a decode stream reading an x0): ``record_stream`` them,
        so the allocator does not hand their memory to the maker's stream again while the reader may still read it."""
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
        copy_stream = self.host_streams[self.devices[lane]]
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
                    stream=task.stream,
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


class Stages:
    """What the executor calls (all on the lane of the task kind; see the module docstring).

    ``prepare(group, chunk) -> ctx`` (ctx["x"]: the chunk's initial latent on lane 0; called with lane 0's prep
    stream current, and it must queue nothing on lane 1: a value lane 1 needs is pulled by the first lane-1 task
    that reads it, see the module docstring); ``stage0(ctx, branch, step,
    x, store_kv) -> activations`` (lane 0); ``stage1(ctx, branch, step, activations, store_kv) -> model output``
    (lane 1); ``update(ctx, step, outputs, x) -> next x`` (lane 1; at the last step the chunk's x0);
    ``decode(ctx, x0) -> frames`` (on ``plan.decode_lane(group)``; with that lane's decode stream current when
    ``plan.decode_stream == "side"``).
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

    def on_side_stream(self, lanes: Lanes, lane: int):
        """The value for a consumer on a side stream of ``lane`` (a decode on its decode stream), made on a compute
        stream: the copies kept for the compute streams are ready only there (the copy of x0 that a refill's stage0
        pulled), so it waits for ``ready`` itself and pulls a copy of its own from another device."""
        if lanes.devices[lane] != lanes.devices[self.lane]:
            return lanes.pull(self.copies[self.lane], self.ready, lane)
        lanes.wait(lane, self.ready)
        lanes.hand_over(self.copies[self.lane], lane)
        return self.copies[self.lane]

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
    frames_copied: Dict[int, Any] = {}  # lane -> event after its last decode's copy to the host (host_copies="own")

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
            frames[(g, c)] = lanes.to_host(video, lanes.event(task.device), task.device)
            if lanes.host_copies == "own":
                frames_copied[task.device] = frames[(g, c)][1]
        else:  # pragma: no cover
            raise ValueError(task.kind)

    def execute(task: Task) -> None:
        lane, g, c, k, b = task.device, task.group, task.chunk, task.step, task.branch
        before = order[position[task] - 1] if serial and position[task] > 0 else None
        if before is not None:
            issued[before].wait()
        # a prep runs on its lane's prep stream, a side-stream decode on its decode stream (see the module docstring),
        # everything else on the compute stream
        with lanes.device_context(lane), torch.no_grad():
            with lanes.side_stream(task):
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
                    x0 = values[("x", g, c, plan.num_steps)]
                    inputs = x0.on_side_stream(lanes, lane) if task.side else x0.on(lanes, lane)
                    # a decode graph replays into a static output buffer: not before the host copy of the previous
                    # one read it (on the shared copy stream the pulls it waits for already queue behind that copy)
                    if frames_copied.get(lane) is not None:
                        lanes.wait(lane, frames_copied[lane])
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
    contention: float = DEFAULT_CONTENTION,
) -> Tuple[RunResult, Simulation]:
    """Schedule ``stages.plan`` for ``mode`` (``contention``: see ``schedule.simulate``) and run it."""
    sim = schedule(stages.plan, mode, costs, prefetch, contention)
    return run(stages, sim.order, lanes, serial=(mode == "off"), threads=threads), sim
