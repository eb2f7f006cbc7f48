"""Where a training step's GPU time goes: kernel time by category from the PyTorch profiler.

Shared by ``benchmarks/train_step.py`` (one model step) and the trainer (config key ``profile_steps =
dict(start=S, steps=N)``: profiles optimizer steps S+1 .. S+N on every rank and writes
``{outputs}/profile/rank{r}.json``). Categories come from kernel names; communication kernels (NCCL) run on their
own streams and may overlap compute, so ``compute_ms`` (all other kernels, which run one after another on the
compute stream) is what the step's wall time is compared with: ``exposed_ms = wall - compute`` is the time the
compute stream waited (communication not hidden, input, host gaps).
"""

import json
import os
from pathlib import Path
from typing import Iterable, Optional, Tuple

import torch

# Kernel name fragments -> category, checked in this order (flash kernels carry "cutlass" in their names, so
# attention comes before matmul).
KERNEL_CATEGORIES = (
    ("communication", ("nccl",)),
    ("attention", ("flash", "fmha", "sdpa", "attention", "attn")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "matmul", "wgmma")),
    ("optimizer", ("multi_tensor_apply", "adam")),
    ("norm/reduction", ("reduce", "norm", "welford", "softmax")),
    ("copy/layout", ("copy", "memcpy", "memset", "cat", "transpose", "index", "fill")),
    ("elementwise", ("elementwise", "vectorized", "triton", "unrolled")),
)


def kernel_category(name: str) -> str:
    low = name.lower()
    for category, fragments in KERNEL_CATEGORIES:
        if any(f in low for f in fragments):
            return category
    return "other"


def summarize_kernels(kernels: Iterable[Tuple[str, float, int]], steps: int, wall_ms: float, top: int = 12) -> dict:
    """``kernels``: (name, total GPU microseconds, calls) over ``steps`` profiled steps of ``wall_ms`` each ->
    per-step ms by category, compute and exposed time (see the module doc), launches and the top kernels."""
    kernels = list(kernels)
    per_step = lambda us: us / steps / 1e3
    by_category = {}
    for name, us, _ in kernels:
        category = kernel_category(name)
        by_category[category] = by_category.get(category, 0.0) + per_step(us)
    compute = sum(ms for category, ms in by_category.items() if category != "communication")
    ranked = sorted(kernels, key=lambda k: -k[1])[:top]
    return dict(
        steps=steps,
        wall_ms_per_step=wall_ms,
        kernel_ms_per_step=sum(by_category.values()),
        compute_ms_per_step=compute,
        exposed_ms_per_step=max(wall_ms - compute, 0.0),
        communication_ms_per_step=by_category.get("communication", 0.0),
        ms_by_category={k: round(v, 2) for k, v in sorted(by_category.items(), key=lambda kv: -kv[1])},
        launches_per_step=sum(k[2] for k in kernels) / steps,
        top_kernels=[
            dict(
                name=n[:140], ms_per_step=round(per_step(us), 2), calls_per_step=c / steps, category=kernel_category(n)
            )
            for n, us, c in ranked
        ],
    )


def cuda_kernels(prof) -> list:
    """(name, total device us, calls) of the GPU kernels a finished ``torch.profiler.profile`` recorded.

    User annotations (``Optimizer.step#AdamW.step``, ``nccl:all_reduce``, ``record_function`` ranges) also carry
    device time, spanning the kernels they enclose: counting them too would count those kernels twice."""
    from torch.autograd import DeviceType

    return [
        (e.key, e.self_device_time_total, e.count)
        for e in prof.key_averages()
        if e.device_type == DeviceType.CUDA
        and e.self_device_time_total > 0
        and not getattr(e, "is_user_annotation", False)
    ]


def format_profile(p: dict) -> str:
    head = (
        f"profile: {p['wall_ms_per_step']:.1f} ms/step wall, {p['compute_ms_per_step']:.1f} ms compute kernels, "
        f"{p['exposed_ms_per_step']:.1f} ms exposed, {p['communication_ms_per_step']:.1f} ms communication, "
        f"{p['launches_per_step']:.0f} launches/step"
    )
    rows = [f"  {c:16s} {ms:8.2f} ms" for c, ms in p["ms_by_category"].items()]
    rows += [
        f"  top: {k['ms_per_step']:7.2f} ms x{k['calls_per_step']:.0f} [{k['category']}] {k['name'][:90]}"
        for k in p["top_kernels"]
    ]
    return "\n".join([head] + rows)


class StepProfiler:
    """Profiles optimizer steps ``start + 1 .. start + steps`` of a training loop (GPU only; a no-op on CPU or
    when not configured). The loop calls ``begin(step)`` before and ``end(step)`` after each optimizer step,
    ``step`` being the number of steps done before it; the last ``end`` returns the summary and, with ``outputs``,
    writes it to ``{outputs}/profile/rank{rank}.json``."""

    def __init__(self, spec: Optional[dict], outputs: Optional[Path], rank: int, device: torch.device):
        self.enabled = bool(spec) and device.type == "cuda"
        if spec and not {"start", "steps"} <= set(spec):
            raise ValueError(f"profile_steps needs keys 'start' and 'steps', got {dict(spec)}")
        self.start = int(spec["start"]) if spec else 0
        self.steps = int(spec["steps"]) if spec else 0
        self.path = Path(outputs) / "profile" / f"rank{rank}.json" if outputs is not None else None
        self._prof = self._events = None

    def begin(self, step: int) -> None:
        if not self.enabled or step != self.start:
            return
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        self._prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        self._prof.__enter__()
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        self._events[0].record()

    def end(self, step_done: int) -> Optional[dict]:
        if self._prof is None or step_done != self.start + self.steps:
            return None
        self._events[1].record()
        torch.cuda.synchronize()
        self._prof.__exit__(None, None, None)
        wall_ms = self._events[0].elapsed_time(self._events[1]) / self.steps
        summary = summarize_kernels(cuda_kernels(self._prof), self.steps, wall_ms)
        summary.update(first_step=self.start + 1, last_step=step_done)
        self._prof = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(summary, indent=1))
            os.replace(tmp, self.path)
        return summary
