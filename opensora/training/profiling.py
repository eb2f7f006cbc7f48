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


def idle_gaps(intervals: Iterable[Tuple[float, float, str]], steps: int, largest: int = 8) -> dict:
    """GPU idle time between kernels: ``intervals`` are (start us, end us, kernel name) on any stream; the union of
    busy intervals from the first kernel to the last is subtracted from that span. Returns per-step idle ms, the
    count of gaps over 50 us per step and the ``largest`` gaps with the kernels on either side (where to look)."""
    ordered = sorted(intervals)
    gaps, busy_end, last_name = [], None, None
    for start, end, name in ordered:
        if busy_end is not None and start > busy_end:
            gaps.append((start - busy_end, last_name, name))
        if busy_end is None or end > busy_end:
            busy_end, last_name = end, name
    total_us = sum(g for g, _, _ in gaps)
    span_us = (ordered[-1][1] - ordered[0][0]) if ordered else 0.0
    return dict(
        idle_ms_per_step=round(total_us / steps / 1e3, 3),
        busy_span_ms_per_step=round(span_us / steps / 1e3, 3),
        gaps_over_50us_per_step=sum(1 for g, _, _ in gaps if g > 50) / steps,
        largest_gaps=[
            dict(ms=round(g / 1e3, 3), after=before[:80], before=after[:80])
            for g, before, after in sorted(gaps, key=lambda gap: -gap[0])[:largest]
        ],
    )


def host_op_counts(ops: Iterable[Tuple[str, int, float]], steps: int, top: int = 15) -> dict:
    """``ops``: (CPU op name, calls, self CPU us) over ``steps`` steps -> calls per step of the most frequent ops
    (``aten::*`` and CUDA runtime calls: launches, copies, syncs) and the host's self time per step."""
    ops = list(ops)
    ranked = sorted(ops, key=lambda op: -op[1])[:top]
    runtime = {name: calls for name, calls, _ in ops if name.startswith("cuda") or name.startswith("cu")}
    return dict(
        cpu_self_ms_per_step=round(sum(us for _, _, us in ops) / steps / 1e3, 3),
        kernel_launches_per_step=sum(c for n, c in runtime.items() if "LaunchKernel" in n) / steps,
        syncs_per_step={n: c / steps for n, c in runtime.items() if "Synchronize" in n},
        top_ops_by_calls=[dict(name=n[:80], calls_per_step=c / steps) for n, c, _ in ranked],
    )


def profile_step_summary(prof, steps: int, wall_ms: float) -> dict:
    """A compact summary of a finished ``torch.profiler.profile`` over ``steps`` steps of ``wall_ms`` each:
    ``summarize_kernels`` (categories, top 15 kernels) plus memcpy / memset time, the GPU's idle gaps and the host's
    op counts. Small enough to keep in a results JSON."""
    from torch.autograd import DeviceType

    kernels = cuda_kernels(prof)
    summary = summarize_kernels(kernels, steps, wall_ms, top=15)
    per_step = lambda us: round(us / steps / 1e3, 3)
    summary["memcpy_ms_per_step"] = per_step(sum(us for n, us, _ in kernels if "memcpy" in n.lower()))
    summary["memset_ms_per_step"] = per_step(sum(us for n, us, _ in kernels if "memset" in n.lower()))
    try:  # diagnostics only: a profiler version without these fields must not cost the run its kernel summary
        device_events = [
            (e.time_range.start, e.time_range.end, e.name)
            for e in prof.events()
            if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
        ]
        summary["gpu_idle"] = idle_gaps(device_events, steps)
        averages = prof.key_averages()
        host_ops = [(e.key, e.count, e.self_cpu_time_total) for e in averages if e.device_type == DeviceType.CPU]
        summary["host"] = host_op_counts(host_ops, steps)
    except (AttributeError, TypeError, ValueError) as error:
        summary["extras_error"] = repr(error)
    return summary


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
    if "gpu_idle" in p and "host" in p:  # profile_step_summary's extras
        idle, host = p["gpu_idle"], p["host"]
        rows.append(
            f"  memcpy {p['memcpy_ms_per_step']:.2f} ms, memset {p['memset_ms_per_step']:.2f} ms; GPU idle "
            f"{idle['idle_ms_per_step']:.2f} ms/step in {idle['gaps_over_50us_per_step']:.0f} gaps > 50 us; host "
            f"{host['cpu_self_ms_per_step']:.1f} ms in ops, {host['kernel_launches_per_step']:.0f} launches, "
            f"syncs {host['syncs_per_step']}"
        )
        rows += [
            f"  gap: {g['ms']:.2f} ms after {g['after'][:50]} before {g['before'][:50]}" for g in idle["largest_gaps"]
        ]
        rows += [f"  host op: x{o['calls_per_step']:.0f} {o['name']}" for o in host["top_ops_by_calls"]]
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
        summary = profile_step_summary(self._prof, self.steps, wall_ms)
        summary.update(first_step=self.start + 1, last_step=step_done)
        self._prof = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(summary, indent=1))
            os.replace(tmp, self.path)
        return summary
