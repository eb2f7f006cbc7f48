"""Per-step throughput: samples/s, tokens/s and model FLOP utilisation (MFU) on GPU, without host syncs.

Methods report what a micro-step processed in their ``outputs`` dict (``num_samples``, ``num_tokens``,
``flops``: training FLOPs of the micro-step's samples, from the model's FLOP counter). Rates are global (summed
over data-parallel ranks, assuming equal work per rank); MFU is per GPU against the measured bf16 matmul ceiling.
With sequence parallelism ``ranks_per_sample`` ranks share each sample: they count it once, and each does
1/ranks_per_sample of its FLOPs.

On a GPU a step is timed by CUDA events on the compute stream: from the end of the previous step (or the start of
the first) to the end of this one, so input stalls and host gaps between steps count, and nothing waits for the
GPU when the step ends. ``stop()`` returns a ``StepTiming`` that is read later (``record()``), typically one step
late, when its end event has long completed.
"""

import time
from typing import Mapping, Optional

import torch

# Measured bf16 dense matmul ceilings in TFLOP/s (README "Notes for GPU users"); unknown devices report no MFU.
PEAK_TFLOPS = {"H200": 752.0, "H100": 752.0}


def peak_tflops(device: torch.device):
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)


class StepTiming:
    """One step's counts and its start/end marks (CUDA events or host clock readings), turned into a record on
    demand."""

    def __init__(self, meter: "ThroughputMeter", start, end, totals: dict):
        self.meter, self.start, self.end, self.totals = meter, start, end, totals

    def seconds(self) -> float:
        if isinstance(self.end, torch.cuda.Event):
            self.end.synchronize()  # long done when read one step late
            return max(self.start.elapsed_time(self.end) / 1e3, 1e-9)
        return max(self.end - self.start, 1e-9)

    def record(self) -> dict:
        meter, totals, seconds = self.meter, self.totals, self.seconds()
        record = {
            "step_time": seconds,
            "samples_per_s": totals["num_samples"] * meter.world_size / seconds,
            "tokens_per_s": totals["num_tokens"] * meter.world_size / seconds,
        }
        if meter.peak is not None and totals["flops"] > 0:
            record["mfu"] = totals["flops"] / meter.ranks_per_sample / seconds / (meter.peak * 1e12)
        if meter.device.type == "cuda":  # this rank's high-water mark since the start of training
            record["peak_memory_gib"] = torch.cuda.max_memory_allocated(meter.device) / 2**30
        return record


class ThroughputMeter:
    def __init__(self, device: torch.device, world_size: int = 1, ranks_per_sample: int = 1):
        self.device = device
        self.world_size = world_size
        self.ranks_per_sample = ranks_per_sample
        self.peak = peak_tflops(device)
        self._start = None
        self._last_end: Optional[object] = None  # the previous step's end mark: consecutive steps tile the time
        self._totals = {}

    def _mark(self):
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return time.perf_counter()

    def start(self) -> None:
        self._start = self._last_end if self._last_end is not None else self._mark()
        self._totals = {"num_samples": 0.0, "num_tokens": 0.0, "flops": 0.0}

    def add(self, outputs: Mapping) -> None:
        for key in self._totals:
            self._totals[key] += float(outputs.get(key, 0.0))

    def stop(self) -> StepTiming:
        end = self._mark()
        self._last_end = end
        return StepTiming(self, self._start, end, dict(self._totals))

    def restart(self) -> None:
        """Forget the previous step's end (after a pause that is not training: a checkpoint save, validation)."""
        self._last_end = None
