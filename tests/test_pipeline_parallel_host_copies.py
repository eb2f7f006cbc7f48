"""``Lanes(host_copies=...)``: where the chunks' copies to the host are queued. ``shared`` puts them on
the peer-copy streams, where a frames copy waits for its decode and every later activation hand-off waits behind
it; ``own`` (the default) gives them a stream of their own per GPU. Here on the CPU (streams are no-ops): the option's checks, the
order the runtime queues a decode's wait for the previous frames copy in (the exact-once decode's bit-identity with
either: ``tests/test_pipeline_parallel_decode.py``), and the benchmark's variants. The GPU side of the mechanism is
``tests/test_pipeline_parallel_gpu.py::test_a_frames_copy_after_a_decode_holds_back_peer_copies_only_when_shared``."""

import contextlib
import threading

import pytest
import torch
from test_pipeline_parallel import RecordingLanes
from test_pipeline_parallel_decode_stream import two_videos_of_three_chunks

from opensora.inference.pipeline_parallel.runtime import HOST_COPY_MODES, Lanes, run_plan


def test_the_host_copies_option_is_checked_and_defaults_to_a_stream_of_its_own():
    assert HOST_COPY_MODES == ("shared", "own")
    assert Lanes(["cpu", "cpu"]).host_copies == "own"
    assert Lanes(["cpu", "cpu"], host_copies="shared").host_copies == "shared"
    with pytest.raises(ValueError, match="host_copies"):
        Lanes(["cpu", "cpu"], host_copies="side")


class CopyEventLanes(RecordingLanes):
    """CPU lanes whose ``to_host`` returns a named event (``("copied", task)``) as a GPU's would, logging each
    wait with its event and the start of every decode's work, in issue order."""

    def __init__(self, devices, host_copies):
        super().__init__(devices)
        self.host_copies, self.events, self.running = host_copies, [], threading.local()  # a thread per lane

    def to_host(self, x, ready, lane):
        out, _ = super().to_host(x, ready, lane)
        return out, ("copied", str(self.running.task))

    def wait(self, lane, ready):
        self.events.append(("wait", lane, ready))

    @contextlib.contextmanager
    def task(self, task):
        if task.kind == "decode":
            self.events.append(("decode", task.device, ("copied", str(task))))
        self.running.task = task
        with super().task(task):
            yield


@pytest.mark.parametrize("threads", [False, True], ids=["one-thread", "thread-per-lane"])
@pytest.mark.parametrize("host_copies", HOST_COPY_MODES)
def test_with_its_own_host_copy_stream_a_decode_waits_for_the_previous_frames_copy_of_its_gpu(
    host_copies, threads, one_thread
):
    """A decode graph replays into one static output buffer; on the shared copy stream the previous chunk's frames
    copy is ordered before the next decode through the pulls, on a stream of its own it is not: there each decode
    after the first on a GPU waits for that GPU's previous frames copy, before its work, on the stream it runs on.
    Shared: no such wait (the queued operations are as before). Frames unchanged either way."""
    from opensora.inference.pipeline_parallel.streaming_stages import CausalStreamingStages

    model, groups, latent_size, times, kw, refs = two_videos_of_three_chunks()
    lanes = CopyEventLanes(["cpu", "cpu"], host_copies)
    stages = CausalStreamingStages(model, lanes, 2, groups, latent_size, times, decode_lanes=(0, 1), **kw)
    result, _ = run_plan(stages, "aggressive", lanes, threads=threads)
    for g, (latents, frames) in enumerate(refs):
        for c in range(3):
            assert torch.equal(result.latents[(g, c)], latents[c]) and torch.equal(result.frames[(g, c)], frames[c])
    copy_waits = [e for e in lanes.events if e[0] == "wait" and isinstance(e[2], tuple)]
    if host_copies == "shared":
        assert copy_waits == []
        return
    for lane in (0, 1):
        events = [e for e in lanes.events if e[1] == lane and (e[0] == "decode" or e in copy_waits)]
        decodes = [e for e in events if e[0] == "decode"]
        assert len(decodes) == 3  # one video per GPU, 3 chunks
        # decode, then before each later decode a wait for the copy of the one before it
        expected = [decodes[0]]
        for before, after in zip(decodes, decodes[1:]):
            expected += [("wait", lane, before[2]), after]
        assert events == expected, (lane, events)


def test_the_benchmark_takes_one_variant_per_host_copy_stream_and_checks_the_entries(capsys):
    from benchmarks.pipeline_parallel import main
    from benchmarks.pipeline_real_vae import variant_name

    with pytest.raises(SystemExit) as done:
        main(["--host-copies", "shared,nope"])
    assert done.value.code == 2 and "--host-copies takes entries of ('shared', 'own')" in capsys.readouterr().err
    assert variant_name(dict(decode_stream="side", host_copies="shared")) == "side"  # the key the JSON had
    assert variant_name(dict(decode_stream="side", host_copies="own")) == "side/own"
