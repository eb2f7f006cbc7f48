"""The benchmark scripts run (CPU smoke shapes) and their profile summary sorts real kernel names correctly."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from opensora.training.profiling import StepProfiler, format_profile, kernel_category, summarize_kernels

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "name, category",
    [
        # names as the PyTorch profiler reports them on H100 (cuDNN / flash attention, cuBLAS, fused AdamW)
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0", "attention"),
        (
            "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, 128, "
            "8, 2, 4, 2, false, false, cutlass::bfloat16_t, Flash_kernel_traits<128, 64, 128, 8, cutlass::bfloat16_t>"
            " > >(...)",
            "attention",
        ),
        ("nvjet_tst_192x192_64x4_2x1_v_bz_coopA_TNT", "matmul"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1", "matmul"),
        ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>(...)", "optimizer"),
        (
            "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float>>>(...)",
            "norm/reduction",
        ),
        ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl<...>>(int, ...)", "elementwise"),
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>(...)",
            "elementwise",
        ),
        ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>(...)", "copy/layout"),
        ("Memcpy DtoD (Device -> Device)", "copy/layout"),
        ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
        ("some_unknown_kernel", "other"),
    ],
)
def test_kernel_category(name, category):
    assert kernel_category(name) == category


def test_summarize_kernels_per_step_totals():
    kernels = [
        ("nvjet_a", 3000.0, 6),
        ("flash_fwd_kernel", 1500.0, 3),
        ("vectorized_elementwise_kernel", 600.0, 30),
        ("ncclDevKernel_AllGather_RING_LL", 900.0, 3),
    ]
    summary = summarize_kernels(kernels, steps=3, wall_ms=2.0)
    assert summary["ms_by_category"] == {"matmul": 1.0, "attention": 0.5, "communication": 0.3, "elementwise": 0.2}
    assert summary["kernel_ms_per_step"] == pytest.approx(2.0)
    # NCCL kernels may overlap compute: the exposed time is wall minus compute kernels only
    assert summary["compute_ms_per_step"] == pytest.approx(1.7)
    assert summary["exposed_ms_per_step"] == pytest.approx(0.3)
    assert summary["communication_ms_per_step"] == pytest.approx(0.3)
    assert summary["launches_per_step"] == 14
    assert [k["name"] for k in summary["top_kernels"]][:2] == ["nvjet_a", "flash_fwd_kernel"]
    assert "profile:" in format_profile(summary)


def test_step_profiler_is_a_no_op_on_cpu_and_checks_its_config(tmp_path):
    profiler = StepProfiler(dict(start=1, steps=2), tmp_path, rank=0, device=torch.device("cpu"))
    for step in range(4):
        profiler.begin(step)
        profiler.end(step + 1)
    assert not profiler.enabled and not (tmp_path / "profile").exists()
    with pytest.raises(ValueError, match="start"):
        StepProfiler(dict(steps=2), tmp_path, rank=0, device=torch.device("cpu"))


def test_train_step_benchmark_tiny_runs_both_models(tmp_path):
    out = tmp_path / "step.json"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.train_step",
        "--tiny",
        "--warmup",
        "1",
        "--iters",
        "2",
        "--runs",
        "ours-eager@none;diffusers@none;ours-eager@full;trainer@full;ours-eager-master@full;trainer-colossal@full",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    runs = {(r["variant"], r["ckpt"]): r for r in report["runs"]}
    assert set(runs) == {
        ("ours-eager", "none"),
        ("diffusers", "none"),
        ("ours-eager", "full"),
        ("trainer", "full"),
        ("ours-eager-master", "full"),
        ("trainer-colossal", "full"),
    }
    assert "error" not in runs.pop(("trainer-colossal", "full"))
    trainer = runs.pop(("trainer", "full"))
    # the real Trainer ran at the tiny shape on in-memory latents: timed steps after warm-up and the sync audit
    assert "error" not in trainer, trainer
    assert len(trainer["times_ms"]) == 2 and len(trainer["data_wait_ms"]) == 2 and trainer["p90_over_p10"] >= 1
    assert trainer["params"] == runs[("ours-eager", "full")]["params"]
    for r in runs.values():
        assert "error" not in r, r
        assert r["step_ms"] > 0 and len(r["times_ms"]) == 2 and r["model_flops"] > 0
    # same shape, same FLOP count for both models: the MFU comparison is apples to apples
    assert runs[("ours-eager", "none")]["model_flops"] == runs[("diffusers", "none")]["model_flops"]
    assert runs[("ours-eager", "none")]["params"] == runs[("diffusers", "none")]["params"]


def test_the_padded_text_trainer_config_runs_at_the_tiny_shape(tmp_path):
    """configs/diffusion/train/mmdit_1b_padded_text_shape.py (the trainer at padded_text_step's shape, prompts of
    20-120 valid tokens) under ``train_step --tiny``: its prompt lengths are fitted into the tiny text, so the real
    Trainer builds and times it on CPU."""
    out = tmp_path / "padded.json"
    config = "configs/diffusion/train/mmdit_1b_padded_text_shape.py"
    cmd = [sys.executable, "-m", "benchmarks.train_step", "--tiny", "--warmup", "1", "--iters", "2", "--audit-steps"]
    cmd += ["1", "--runs", "trainer@full", "--trainer-config", config, "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (run,) = json.loads(out.read_text())["runs"]
    assert "error" not in run, run
    assert run["config"] == config and len(run["times_ms"]) == 2 and run["params"] > 0


def test_train_scaling_script_runs_the_trainer_at_one_and_two_processes(tmp_path):
    """The scaling benchmark on CPU (gloo, demo config): both process counts train and the report is filled; with
    --shared-base the second variant (ColossalAI's own multi-rank ZeRO step) runs at 2 processes only, is measured
    against the first one's 1-process run, and trains to the same losses and grad norms as the default step."""
    out = tmp_path / "scaling"
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    cmd = [
        "bash",
        str(ROOT / "benchmarks" / "train_scaling.sh"),
        "--tiny",
        "--plugins",
        "zero2 zero2-cai",
        "--shared-base",
        "--gpus",
        "1 2",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    runs = tmp_path / "scaling_tiny"
    report = json.loads((runs / "scaling.json").read_text())
    assert report["device"] == "cpu" and report["shared_base"] is True
    rows = {(r["plugin"], r["gpus"]): r for r in report["rows"]}
    assert set(rows) == {("zero2", 1), ("zero2", 2), ("zero2-cai", 1), ("zero2-cai", 2)}, report
    assert all("error" not in r for r in rows.values()), report
    assert not (runs / "zero2-cai_1gpu").exists()  # the shared 1-process run is zero2's
    assert rows[("zero2-cai", 1)]["tokens_per_s_per_gpu"] == rows[("zero2", 1)]["tokens_per_s_per_gpu"]
    for (plugin, n), r in rows.items():
        assert (r["scaling_efficiency"] == 1.0) if n == 1 else (r["scaling_efficiency"] > 0)
        assert r["tokens_per_s_per_gpu"] > 0 and r["steps"] == 5  # 8 steps, the first 3 skipped as warm-up

    def records(name):
        metrics = [json.loads(line) for line in (runs / name / "metrics.jsonl").open()]
        return [(m["step"], m["loss"], m.get("grad_norm")) for m in metrics]

    assert [step for step, _, _ in records("zero2_1gpu")] == list(range(1, 9))
    assert records("zero2_2gpu") == records("zero2-cai_2gpu")  # the default multi-rank step: ColossalAI's bits


def test_cuda_kernels_skips_cpu_events_and_user_annotations():
    """Annotations (optimizer step, NCCL op ranges) carry the device time of the kernels inside them."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from opensora.training.profiling import cuda_kernels

    def event(key, device, us, annotation=False):
        return SimpleNamespace(
            key=key, device_type=device, self_device_time_total=us, count=1, is_user_annotation=annotation
        )

    events = [
        event("aten::mm", DeviceType.CPU, 0),
        event("nvjet_tst_1", DeviceType.CUDA, 500.0),
        event("Optimizer.step#AdamW.step", DeviceType.CUDA, 80.0, annotation=True),
        event("multi_tensor_apply_kernel", DeviceType.CUDA, 79.0),
        event("nccl:all_reduce", DeviceType.CUDA, 40.0, annotation=True),
        event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", DeviceType.CUDA, 40.0),
    ]
    prof = SimpleNamespace(key_averages=lambda: events)
    names = [k[0] for k in cuda_kernels(prof)]
    assert names == ["nvjet_tst_1", "multi_tensor_apply_kernel", "ncclDevKernel_AllReduce_Sum_f32_RING_LL"]
    summary = summarize_kernels(cuda_kernels(prof), steps=1, wall_ms=1.0)
    assert summary["communication_ms_per_step"] == pytest.approx(0.04)
    assert summary["ms_by_category"]["optimizer"] == pytest.approx(0.08)


def test_train_scaling_script_runs_sequence_parallel(tmp_path):
    out = tmp_path / "sp"
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    cmd = [
        "bash",
        str(ROOT / "benchmarks" / "train_scaling.sh"),
        "--tiny",
        "--plugins",
        "zero2",
        "--gpus",
        "2",
        "--sp",
        "2",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    (row,) = json.loads((tmp_path / "sp_tiny" / "scaling.json").read_text())["rows"]
    assert "error" not in row and row["tokens_per_s_per_gpu"] > 0, row
    log = (tmp_path / "sp_tiny" / "zero2_2gpu.log").read_text()
    assert "sequence parallel: 2 ranks per sample" in log


def test_master_weight_adamw_steps_fp32_masters_and_rounds_them_into_the_model():
    """The bare step's master-weight optimizer = torch AdamW on fp32 copies fed the bf16 gradients cast to fp32,
    with the model holding the masters rounded to bf16 after every step."""
    from benchmarks.train_step import MasterWeightAdamW

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 3)).to(torch.bfloat16)
    reference = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    ref_opt = torch.optim.AdamW(reference, lr=1e-5)
    step = MasterWeightAdamW(model, fused=False)
    for k in range(3):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
        model(x).float().square().mean().backward()
        for ref, p in zip(reference, model.parameters()):
            ref.grad = p.grad.float()
        ref_opt.step()
        step()
        model.zero_grad(set_to_none=True)
        for ref, master, p in zip(reference, step.masters, model.parameters()):
            assert torch.equal(master, ref.detach())
            assert torch.equal(p.detach(), ref.detach().to(torch.bfloat16))


def test_idle_gaps_and_host_op_counts():
    from opensora.training.profiling import host_op_counts, idle_gaps

    # two streams: [0, 10] and [5, 20] overlap, then idle 20 -> 30, then [30, 31], idle 31 -> 131, [131, 140]
    kernels = [(5.0, 20.0, "b"), (0.0, 10.0, "a"), (30.0, 31.0, "c"), (131.0, 140.0, "d")]
    gaps = idle_gaps(kernels, steps=2)
    assert gaps["idle_ms_per_step"] == pytest.approx((10 + 100) / 2 / 1e3)
    assert gaps["busy_span_ms_per_step"] == pytest.approx(140 / 2 / 1e3)
    assert gaps["gaps_over_50us_per_step"] == 0.5
    assert gaps["largest_gaps"][0] == dict(ms=0.1, after="c", before="d")
    assert gaps["largest_gaps"][1]["after"] == "b"  # the kernel that ended last, not the one that started last
    ops = [("aten::copy_", 40, 100.0), ("cudaLaunchKernel", 60, 300.0), ("cudaStreamSynchronize", 2, 50.0)]
    host = host_op_counts(ops, steps=2, top=2)
    assert host["kernel_launches_per_step"] == 30
    assert host["syncs_per_step"] == {"cudaStreamSynchronize": 1}
    assert host["cpu_self_ms_per_step"] == pytest.approx(0.225)
    assert [o["name"] for o in host["top_ops_by_calls"]] == ["cudaLaunchKernel", "aten::copy_"]


def test_max_tokens_smoke_on_cpu(tmp_path):
    """benchmarks.max_tokens --tiny: every mode searched (capped on CPU, no OOM there), rows written."""
    out = tmp_path / "max_tokens.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.max_tokens", "--tiny", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["none", "selective", "full"]
    for row in rows:
        assert row["capped"] and row["max_frames"] == 4 and row["step_s"] > 0 and not row["timed_out"]
    # checkpointing more blocks: the selective mode sits between none and full
    assert [(r["grad_ckpt_double"], r["grad_ckpt_single"]) for r in rows] == [(0, 0), (0, 1), (1, 2)]


BENCHMARK_MODULES = sorted(
    p.stem
    for p in (ROOT / "benchmarks").glob("*.py")
    if p.stem
    not in (
        "__init__",
        "common",
        "long_streaming_switch",
        "offload_stores",
        "pipeline_real_vae",
    )
)  # helper modules: no CLI


@pytest.mark.parametrize("name", BENCHMARK_MODULES)
def test_every_benchmark_module_imports_as_a_package_module_and_prints_its_help(name, monkeypatch, capsys):
    """`python -m benchmarks.NAME --help` without running anything: the module imports (its shared helpers come from
    benchmarks.common, not from another script through sys.path) and builds its command line."""
    import importlib

    module = importlib.import_module(f"benchmarks.{name}")
    monkeypatch.setattr(sys, "argv", [f"benchmarks.{name}", "--help"])
    with pytest.raises(SystemExit) as done:
        module.main()
    assert done.value.code == 0
    assert "usage:" in capsys.readouterr().out
    assert "sys.path" not in (ROOT / "benchmarks" / f"{name}.py").read_text()


def expand_braces(text):
    """``a_{x,y}.json`` -> ``[a_x.json, a_y.json]`` (the shorthand the reports use for a run's .json and .txt)."""
    start = text.find("{")
    if start < 0:
        return [text]
    end = text.index("}", start)
    return [
        name
        for choice in text[start + 1 : end].split(",")
        for name in expand_braces(text[:start] + choice + text[end + 1 :])
    ]


def test_results_hold_exactly_the_files_the_reports_cite_and_the_readme_links_resolve():
    import re

    bench = ROOT / "benchmarks"
    readme = (bench / "README.md").read_text()
    texts = [readme] + [p.read_text() for p in sorted((bench / "reports").glob("*.md"))]
    cited = set()
    for text in texts:
        for token in re.findall(r"`results/([^`\s]+)`", text):
            for name in expand_braces(token):
                assert (bench / "results" / name).exists(), f"cited but missing: results/{name}"
                cited.add(name.split("/")[0])
    stored = {p.name for p in (bench / "results").iterdir()}
    assert stored - cited == set(), f"in results/ but cited by no report: {sorted(stored - cited)}"
    links = re.findall(r"\]\((reports/[^)]+)\)", readme)
    assert links and all((bench / link).is_file() for link in links)
    named = {name for text in texts for name in re.findall(r"[\w.-]+_\d{4}-\d{2}\.md", text)}
    assert {name for name in named if not (bench / "reports" / name).is_file()} == set()
    assert len(readme.splitlines()) <= 150


def test_host_work_times_this_checkout_beside_other_versions(tmp_path):
    """``--against-ema`` / ``--against-zero`` load other versions of those modules (here copies of this checkout's)
    and interleave them with this checkout's, part by part."""
    from benchmarks import host_work

    copies = {}
    for name in ("ema", "zero_single_rank"):
        copies[name] = tmp_path / f"{name}_copy.py"
        copies[name].write_text((ROOT / f"opensora/training/{name}.py").read_text())
    argv = ["--iters", "2", "--rounds", "2", "--against-ema", str(copies["ema"])]
    result = host_work.main(argv + ["--against-zero", str(copies["zero_single_rank"])])
    assert result["tensors"] == 336  # the 1B preset's trainable tensors
    assert set(result["parts"]) == {"ema", "zero_cast", "zero_write_back"}
    assert set(result["parts"]["ema"]) == {"this checkout", str(copies["ema"])}
    assert set(result["parts"]["zero_cast"]) == {"this checkout", str(copies["zero_single_rank"])}
    for versions in result["parts"].values():
        assert all(len(v["rounds_ms"]) == 2 and min(v["rounds_ms"]) > 0 for v in versions.values())


def test_flash_attention4_harness_with_a_math_stand_in(tmp_path, monkeypatch):
    """The FA4 benchmark's harness on the CPU: an FA4 stand-in made of math attention (dense and varlen over packed
    rows) must score as exact as math SDPA, its varlen row by row against each row's valid tokens alone; a missing
    package skips the FA4 rows with the reason. The real kernels only run on a GPU machine."""
    from benchmarks import flash_attention4 as bench

    class MathFA4:
        __version__ = "math stand-in"

        @staticmethod
        def flash_attn_func(q, k, v):
            return bench.math_reference()(q, k, v), None

        @staticmethod
        def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
            pieces = []
            for lo, hi in zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist()):
                pieces.append(bench.math_reference()(q[None, lo:hi], k[None, lo:hi], v[None, lo:hi])[0])
            return torch.cat(pieces), None

    monkeypatch.setattr(bench, "fa4_module", lambda: (MathFA4, None))
    result = bench.main(["--tiny", "--out", str(tmp_path / "fa4.json")])
    assert {row["variant"] for row in result["rows"]} == {"sdpa-math", "fa4", "fa4-varlen"}
    assert all(row.get("ran") for row in result["rows"]), result["rows"]
    for name in ("sdpa-math", "fa4"):
        assert max(result["errors"][name].values()) < 1e-5, result["errors"]
    assert result["errors"]["fa4-varlen"]["out"] < 1e-5
    # a varlen that attends over the padded text too is caught by the row-by-row check
    right_pack = bench.pack
    monkeypatch.setattr(bench, "pack", lambda x, mask: right_pack(x, torch.ones_like(mask)))
    errors = bench.main(["--tiny", "--out", str(tmp_path / "wrong.json")])["errors"]["fa4-varlen"]
    assert "failed" in errors or errors["out"] > 1e-3, errors
    monkeypatch.setattr(bench, "fa4_module", lambda: (None, "ModuleNotFoundError: No module named 'flash_attn'"))
    rows = bench.main(["--tiny", "--out", str(tmp_path / "missing.json")])["rows"]
    skipped = {row["variant"]: row["reason"] for row in rows if row.get("skipped")}
    assert skipped == dict.fromkeys(("fa4", "fa4-varlen"), "ModuleNotFoundError: No module named 'flash_attn'")


def test_padded_text_step_times_the_trainer_step_beside_its_fa4_variant(tmp_path, monkeypatch):
    """benchmarks.padded_text_step --tiny with the math FA4 stand-in of test_fa4_kernel.py: the fa4 variant runs the
    trainer's step through FA4's entry points and is timed beside the default, with their ratio."""
    from test_fa4_kernel import MathFA4

    from benchmarks import padded_text_step
    from opensora.models.mmdit import fa4_kernel

    MathFA4.calls = []
    monkeypatch.setitem(fa4_kernel._STATE, "module", MathFA4)
    monkeypatch.setattr(fa4_kernel, "supports", lambda q: True)
    names = "ours-padded-bound-graph-ckpt,ours-padded-bound-graph-ckpt-fa4"
    argv = ["--tiny", "--no-diffusers", "--warmup", "1", "--iters", "1", "--rounds", "1", "--variants", names]
    assert padded_text_step.main(argv + ["--out", str(tmp_path / "step.json")]) == 0
    report = json.loads((tmp_path / "step.json").read_text())
    assert [row["variant"] for row in report["rows"]] == names.split(",")
    assert "ours-padded-bound-graph-ckpt-fa4 / ours-padded-bound-graph-ckpt" in report["ratios"]
    assert MathFA4.calls.count("fwd") >= 2 and "bwd" in MathFA4.calls  # warm-up and the timed step took FA4


def test_model_backend_parity_tiny_writes_errors_against_fp32(tmp_path):
    from benchmarks import model_backend_parity

    rows = model_backend_parity.main(["--tiny", "--out", str(tmp_path / "parity.json")])["rows"]
    assert [(r["padded"], r["backend"]) for r in rows] == [(False, "auto"), (True, "auto")]
    # bf16 autocast against fp32: a few percent, finite; an exact match would mean the comparison ran in fp32
    assert all(0 < r["out"] < 0.1 and r["out_finite"] and r["grad_finite"] for r in rows)
