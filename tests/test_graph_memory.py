"""``GraphMemory``'s per-device bookkeeping on a CPU, with a fake ``torch.cuda`` of two devices that behaves as the
real one where it matters: a stream belongs to one device and entering it makes that device current; a graph
capture begins on its stream's device; a pool records one capture at a time per device, and a capture that fails
leaves its pool recording (``CUDAGraph.capture_end`` raises before it ends the pool's recording), so a later capture
into that pool fails with "already recording to mempool_id"."""

import contextlib
import itertools

import pytest
import torch

from opensora.models.mmdit import graph_memory
from opensora.models.mmdit.graph_memory import GraphMemory, capture_side_stream, graph_capture_stream, on_capture_device


class FakeStream:
    def __init__(self, device: int, name: str):
        self.device, self.name = device, name

    def wait_stream(self, other) -> None:
        assert other.device == self.device, f"{self.name} (device {self.device}) waits on a stream of {other.device}"

    def __repr__(self):
        return f"<{self.name} on {self.device}>"


class FakeCuda:
    """The parts of ``torch.cuda`` that ``graph_memory`` uses, for 2 devices."""

    def __init__(self):
        self.current = 0
        self.defaults = {d: FakeStream(d, "default") for d in (0, 1)}
        self.streams = dict(self.defaults)  # device -> current stream
        self.recording = {0: set(), 1: set()}  # device -> pools recording (the caching allocator's captures_underway)
        self.ids = itertools.count(1)
        self.made = []
        self.captures = []  # (device at capture, stream, pool given)
        fake = self

        class CUDAGraph:
            def pool(self):
                return self.pool_id

        class graph:
            def __init__(self, cuda_graph, pool=None, stream=None):
                assert stream is not None, "the capture stream must be chosen (torch's default is one per process)"
                self.g, self.pool, self.stream = cuda_graph, pool, stream

            def __enter__(self):
                self.ctx = fake.stream(self.stream)
                self.ctx.__enter__()
                device = fake.current
                self.g.pool_id = self.pool if self.pool is not None else (0, next(fake.ids))
                if self.g.pool_id in fake.recording[device]:
                    raise RuntimeError("beginAllocateToPool: already recording to mempool_id")
                fake.recording[device].add(self.g.pool_id)
                self.device = device
                fake.captures.append((device, self.stream, self.pool))

            def __exit__(self, kind, error, tb):
                if kind is None:  # a failed capture leaves its pool recording, as capture_end does
                    fake.recording[self.device].discard(self.g.pool_id)
                self.ctx.__exit__(kind, error, tb)

        self.CUDAGraph, self.graph = CUDAGraph, graph

    def current_device(self) -> int:
        return self.current

    def Stream(self, device=None, priority=0):
        stream = FakeStream(self.current if device is None else device, f"stream{len(self.made)}")
        self.made.append(stream)
        return stream

    def current_stream(self, device=None):
        return self.streams[self.current if device is None else device]

    @contextlib.contextmanager
    def device(self, device):
        index = device.index if isinstance(device, torch.device) else device
        before, self.current = self.current, index
        try:
            yield
        finally:
            self.current = before

    @contextlib.contextmanager
    def stream(self, stream):
        """As ``torch.cuda.stream``: the stream's device becomes current, and the stream that device's current one."""
        before_device, before_stream = self.current, self.streams[stream.device]
        self.current, self.streams[stream.device] = stream.device, stream
        try:
            yield
        finally:
            self.current, self.streams[stream.device] = before_device, before_stream


@pytest.fixture
def cuda(monkeypatch):
    fake = FakeCuda()
    for name in ("current_device", "Stream", "current_stream", "device", "stream", "CUDAGraph", "graph"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(graph_memory, "_SIDE_STREAMS", {})
    monkeypatch.setattr(graph_memory, "_CAPTURE_STREAMS", {})
    return fake


def recording_body(cuda, seen):
    """A captured body that notes the device and stream its work would run on."""
    return lambda: seen.append((cuda.current, cuda.current_stream()))


def test_a_capture_runs_on_its_own_device_when_another_is_current(cuda):
    """The two-GPU pipeline captures stage 1 on cuda:1: warm-up on cuda:1's side stream, capture on cuda:1's capture
    stream, into a cuda:1 pool; the caller's current device is left as it was."""
    seen = []
    GraphMemory().capture(recording_body(cuda, seen), device=torch.device("cuda", 1))
    side, capture = capture_side_stream(1), graph_capture_stream("passes", 1)
    assert side.device == 1 and capture.device == 1
    assert seen == [(1, side), (1, side), (1, capture)]  # two warm-ups, then the capture
    assert cuda.captures == [(1, capture, None)] and cuda.current == 0
    seen.clear()
    with on_capture_device(torch.device("cuda", 1)):  # what the callers do: the capture's tensors name the device
        GraphMemory().capture(recording_body(cuda, seen))
    assert seen == [(1, side), (1, side), (1, capture)] and cuda.current == 0


def test_streams_and_pools_are_kept_per_device(cuda):
    memory, seen = GraphMemory(), []
    memory.capture(recording_body(cuda, seen), device=0)
    memory.capture(recording_body(cuda, seen), device=1)
    memory.capture(recording_body(cuda, seen), device=0)
    memory.capture(recording_body(cuda, seen), device=1)
    (d0, s0, p0), (d1, s1, p1), (d2, s2, p2), (d3, s3, p3) = cuda.captures
    assert (d0, d1, d2, d3) == (0, 1, 0, 1)
    assert p0 is None and p1 is None  # a device's first capture starts its own pool, never another device's
    assert p2 == memory.pools[0] and p3 == memory.pools[1] and memory.pools[0] != memory.pools[1]
    assert s0 is s2 and s1 is s3 and s0.device == 0 and s1.device == 1
    assert capture_side_stream(0) is not capture_side_stream(1)
    assert graph_capture_stream("passes", 0) is not graph_capture_stream("decode", 0)  # lanes replay concurrently
    assert graph_capture_stream("decode", 1).device == 1


def test_a_failed_capture_gives_its_pool_up(cuda):
    """Without it, every capture after the first failure fails with "already recording to mempool_id" (the cascade
    of the two-GPU test run), and the whole runner falls back to eager passes."""
    memory, seen = GraphMemory(), []
    memory.capture(recording_body(cuda, seen), device=1)
    memory.capture(recording_body(cuda, seen), device=0)
    poisoned, kept = memory.pools[1], memory.pools[0]
    calls = []

    def failing():
        calls.append(cuda.current)
        if len(calls) == 3:  # the warm-ups pass, the capture is invalidated
            raise RuntimeError("operation failed due to a previous error during capture")

    with pytest.raises(RuntimeError, match="previous error"):
        memory.capture(failing, device=1)
    assert poisoned in cuda.recording[1] and 1 not in memory.pools
    memory.capture(recording_body(cuda, seen), device=1)  # a fresh pool: no "already recording"
    assert cuda.captures[-1][2] is None and memory.pools[1] != poisoned
    assert memory.pools[0] == kept  # the other device's pool is untouched


def test_one_device_keeps_one_pool_and_one_stream_per_lane(cuda):
    """The one-GPU streaming generator: every capture on the current device, into one pool, on the same streams."""
    passes, decode, seen = GraphMemory(), GraphMemory(lane="decode"), []
    for _ in range(3):
        passes.capture(recording_body(cuda, seen))
    decode.capture(recording_body(cuda, seen))
    pools = [pool for _, _, pool in cuda.captures]
    assert pools[0] is None and pools[1] == pools[2] == passes.pools[0] and list(passes.pools) == [0]
    streams = {stream for _, stream, _ in cuda.captures}
    assert streams == {graph_capture_stream("passes", 0), graph_capture_stream("decode", 0)}
    assert len(cuda.made) == 3  # one side stream and two capture streams, made once for the process
