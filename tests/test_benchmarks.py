"""The benchmark scripts run (CPU smoke shapes) and their profile summary sorts real kernel names correctly."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_train_step():
    spec = importlib.util.spec_from_file_location("train_step_bench", ROOT / "benchmarks" / "train_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "name, category",
    [
        # names as the PyTorch profiler reports them on H100 (cuDNN / flash attention, cuBLAS, fused AdamW)
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0", "attention"),
        ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, 128, "
         "8, 2, 4, 2, false, false, cutlass::bfloat16_t, Flash_kernel_traits<128, 64, 128, 8, cutlass::bfloat16_t>"
         " > >(...)", "attention"),
        ("nvjet_tst_192x192_64x4_2x1_v_bz_coopA_TNT", "matmul"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1", "matmul"),
        ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>(...)", "optimizer"),
        ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float>>>(...)",
         "norm/reduction"),
        ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl<...>>(int, ...)", "elementwise"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>(...)",
         "elementwise"),
        ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>(...)", "copy/layout"),
        ("Memcpy DtoD (Device -> Device)", "copy/layout"),
        ("some_unknown_kernel", "other"),
    ],
)
def test_kernel_category(name, category):
    assert load_train_step().kernel_category(name) == category


def test_summarize_kernels_per_step_totals():
    bench = load_train_step()
    kernels = [("nvjet_a", 3000.0, 6), ("flash_fwd_kernel", 1500.0, 3), ("vectorized_elementwise_kernel", 600.0, 30)]
    summary = bench.summarize_kernels(kernels, steps=3, wall_ms=2.0)
    assert summary["ms_by_category"] == {"matmul": 1.0, "attention": 0.5, "elementwise": 0.2}
    assert summary["kernel_ms_per_step"] == pytest.approx(1.7)
    assert summary["gpu_idle_ms_per_step"] == pytest.approx(0.3)
    assert summary["launches_per_step"] == 13
    assert [k["name"] for k in summary["top_kernels"]] == ["nvjet_a", "flash_fwd_kernel", "vectorized_elementwise_kernel"]


def test_train_step_benchmark_tiny_runs_both_models(tmp_path):
    out = tmp_path / "step.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "train_step.py"), "--tiny", "--warmup", "1", "--iters", "2",
           "--runs", "ours-eager@none;diffusers@none;ours-eager@full", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    runs = {(r["variant"], r["ckpt"]): r for r in report["runs"]}
    assert set(runs) == {("ours-eager", "none"), ("diffusers", "none"), ("ours-eager", "full")}
    for r in runs.values():
        assert "error" not in r, r
        assert r["step_ms"] > 0 and len(r["times_ms"]) == 2 and r["model_flops"] > 0
    # same shape, same FLOP count for both models: the MFU comparison is apples to apples
    assert runs[("ours-eager", "none")]["model_flops"] == runs[("diffusers", "none")]["model_flops"]
    assert runs[("ours-eager", "none")]["params"] == runs[("diffusers", "none")]["params"]


def test_train_scaling_script_runs_the_trainer_at_one_and_two_processes(tmp_path):
    """The scaling benchmark on CPU (gloo, demo config): both process counts train and the report is filled."""
    out = tmp_path / "scaling"
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
    cmd = ["bash", str(ROOT / "benchmarks" / "train_scaling.sh"), "--tiny", "--plugins", "zero2", "--gpus", "1 2",
           "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    report = json.loads((tmp_path / "scaling_tiny" / "scaling.json").read_text())
    assert report["device"] == "cpu"
    rows = {r["gpus"]: r for r in report["rows"]}
    assert set(rows) == {1, 2} and all("error" not in r for r in rows.values()), report
    assert rows[1]["scaling_efficiency"] == 1.0 and rows[2]["scaling_efficiency"] > 0
    for n, r in rows.items():
        assert r["tokens_per_s_per_gpu"] > 0 and r["steps"] == 5  # 8 steps, the first 3 skipped as warm-up
        metrics = [json.loads(l) for l in (tmp_path / "scaling_tiny" / f"zero2_{n}gpu" / "metrics.jsonl").open()]
        assert [m["step"] for m in metrics] == list(range(1, 9))
