"""Per-step throughput: samples/s, tokens/s and model FLOP utilisation (MFU) on GPU.

Methods report what a micro-step processed in their ``outputs`` dict (``num_samples``, ``num_tokens``,
``flops``: training FLOPs of the micro-step's samples, from the model's FLOP counter). Rates are global (summed
over data-parallel ranks, assuming equal work per rank); MFU is per GPU against the measured bf16 matmul ceiling.
With sequence parallelism ``ranks_per_sample`` ranks share each sample: they count it once, and each does
1/ranks_per_sample of its FLOPs.
"""

import time
from typing import Mapping

import torch

# Measured bf16 dense matmul ceilings in TFLOP/s (README "Notes for GPU users"); unknown devices report no MFU.
PEAK_TFLOPS = {"H200": 752.0, "H100": 752.0}


def peak_tflops(device: torch.device):
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)


class ThroughputMeter:
    def __init__(self, device: torch.device, world_size: int = 1, ranks_per_sample: int = 1):
        self.device = device
        self.world_size = world_size
        self.ranks_per_sample = ranks_per_sample
        self.peak = peak_tflops(device)
        self._t0 = None
        self._totals = {}

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self._totals = {"num_samples": 0.0, "num_tokens": 0.0, "flops": 0.0}

    def add(self, outputs: Mapping) -> None:
        for key in self._totals:
            self._totals[key] += float(outputs.get(key, 0.0))

    def stop(self) -> dict:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = max(time.perf_counter() - self._t0, 1e-9)
        record = {
            "step_time": seconds,
            "samples_per_s": self._totals["num_samples"] * self.world_size / seconds,
            "tokens_per_s": self._totals["num_tokens"] * self.world_size / seconds,
        }
        if self.peak is not None and self._totals["flops"] > 0:
            record["mfu"] = self._totals["flops"] / self.ranks_per_sample / seconds / (self.peak * 1e12)
        if self.device.type == "cuda":  # this rank's high-water mark since the start of training
            record["peak_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return record
