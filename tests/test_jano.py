"""Jano region cache: exactness of the region-cached forward, the sampler with --jano off/on, baselines, FLOPs."""

import pytest
import torch

from benchmarks.offload_stores import NaiveOffload, OffloadManager
from opensora.inference.cache.jano import FullCompute, JanoCache, StepCache, region_forward_flops
from opensora.inference.cache.plan import (
    ACTIVE,
    FULL,
    MEDIUM,
    REFRESH,
    JanoConfig,
    RegionPlan,
    region_classes,
    step_levels,
)
from opensora.inference.cache.region_forward import RegionForward
from opensora.inference.cache.stores import DeviceStore, PackedOffloadManager
from opensora.inference.sampler import PreparedCondition, VideoSampler
from opensora.models.mmdit import MMDiT, mmdit_config, mmdit_forward_flops

TEXT_DIM, POOLED_DIM = 24, 16
GRID = (2, 4, 4)  # latent (2, 8, 8) with patch (1, 2, 2): 32 video tokens


def tiny_model(seed=0):
    cfg = mmdit_config(
        "tiny",
        text_dim=TEXT_DIM,
        pooled_dim=POOLED_DIM,
        in_channels=4,
        cond_channels=5,
        hidden_size=64,
        num_heads=2,
        axes_dims=(8, 12, 12),
        depth_double=2,
        depth_single=2,
    )
    cfg.pop("type")
    model = MMDiT(**cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # zero-initialised layers too, so every input matters
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.requires_grad_(False)


def inputs(batch=2, text_len=6, padded=True, with_cond=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, text_len, dtype=torch.bool)
    if padded:
        mask[:, 4:] = False
        mask[0, 3] = False
    cond = None
    if with_cond:
        cond = torch.zeros(batch, 5, 2, 8, 8)
        cond[:, 0, 0] = 1  # frame 0 given (i2v_head-like)
        cond[:, 1:, 0] = torch.randn(batch, 4, 8, 8, generator=gen)
    return dict(
        x=torch.randn(batch, 4, 2, 8, 8, generator=gen),
        timestep=torch.rand(batch, generator=gen),
        text_emb=torch.randn(batch, text_len, TEXT_DIM, generator=gen),
        text_mask=mask,
        pooled=torch.randn(batch, POOLED_DIM, generator=gen),
        cond=cond,
    )


def random_plan(rows=2, n=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    classes = torch.randint(1, 4, (rows, n), generator=gen).to(torch.int8)
    return RegionPlan.from_classes(classes), classes


def test_step_levels_follow_warmup_refresh_and_cooldown():
    cfg = JanoConfig(warmup_steps=3, cooldown_steps=2, refresh_interval=4, medium_interval=2)
    assert step_levels(14, cfg) == [0, 0, 0, 3, 1, 2, 1, 3, 1, 2, 1, 3, 0, 0]
    with pytest.raises(ValueError, match="warmup_steps"):
        JanoConfig(warmup_steps=1)


@pytest.mark.parametrize("padded,with_cond", [(True, True), (False, False)])
def test_levels_0_and_3_are_the_model_forward_bit_for_bit(padded, with_cond):
    model, batch = tiny_model(), inputs(padded=padded, with_cond=with_cond)
    reference = model(**batch)
    forward = RegionForward(model)
    assert torch.equal(forward(FULL, **batch), reference)
    plan, _ = random_plan()
    store = DeviceStore()
    assert torch.equal(forward(REFRESH, **batch, plan=plan, store=store), reference)
    layers = 4
    assert sorted(store._entries) == sorted([f"{p}_kv_{i}" for p in "ms" for i in range(layers)] + ["m_x", "s_x"])
    assert store._entries["s_kv_0"].shape == (2, 2, 2, plan.num_tokens - plan.k_medium, 32)


@pytest.mark.parametrize("padded,with_cond", [(True, True), (False, False)])
def test_cached_levels_reproduce_the_full_forward_on_unchanged_inputs(padded, with_cond):
    """With the same inputs as at the refresh, the skipped tokens' cached keys/values and outputs are exactly what the
    full forward computes, so level 1 and 2 must give the full output (to float rounding) for every row's own set."""
    model, batch = tiny_model(), inputs(padded=padded, with_cond=with_cond)
    reference = model(**batch)
    plan, _ = random_plan()
    assert plan.k_active < plan.k_medium < plan.num_tokens
    forward, store = RegionForward(model), DeviceStore()
    forward(REFRESH, **batch, plan=plan, store=store)
    for level in (ACTIVE, MEDIUM, ACTIVE):
        out = forward(level, **batch, plan=plan, store=store)
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


def test_cached_levels_use_the_cache_for_skipped_tokens():
    model, batch = tiny_model(), inputs()
    plan, _ = random_plan()
    forward, store = RegionForward(model), DeviceStore()
    forward(REFRESH, **batch, plan=plan, store=store)
    moved = dict(batch, x=batch["x"] + 0.5 * torch.randn_like(batch["x"]))
    out = forward(ACTIVE, **moved, plan=plan, store=store)
    full = model(**moved)
    # static tokens' outputs are the refresh's, not the moved input's
    tokens = lambda v: v.reshape(2, 4, 2, 4, 2, 4, 2).permute(0, 2, 3, 5, 1, 4, 6).reshape(2, 32, -1)  # noqa: E731
    static = plan.order[:, plan.k_medium :]
    pick = lambda v: torch.gather(tokens(v), 1, static[..., None].expand(-1, -1, 16))  # noqa: E731
    torch.testing.assert_close(pick(out), pick(model(**batch)), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(pick(out), pick(full), atol=1e-3)


def test_region_classes_thresholds_dilation_and_condition_frames():
    score = torch.zeros(1, 32)
    score[0, 21] = 1.0  # t=1, h=1, w=1: one moving token
    score[0, 0] = 0.4  # medium
    cfg = JanoConfig(dilation=0)
    classes = region_classes(score, GRID, cfg)
    assert classes[0, 21] == 3 and classes[0, 0] == 2 and (classes == 1).sum() == 30
    dilated = region_classes(score, GRID, JanoConfig(dilation=1))
    assert (dilated == 3).sum() == 3 * 3 and dilated[0, 16] == 3 and dilated[0, 5] != 3  # 3x3 in frame 1 only
    fixed = torch.zeros(1, 32, dtype=torch.bool)
    fixed[0, :16] = True  # the condition frame
    forced = region_classes(score, GRID, cfg, fixed)
    assert forced[0, 0] == 1 and forced[0, 21] == 3


def test_plan_takes_each_rows_most_dynamic_tokens_with_the_batch_maximum_count():
    classes = torch.tensor([[1, 3, 2, 1], [3, 3, 1, 2]], dtype=torch.int8)
    plan = RegionPlan.from_classes(classes)
    assert plan.k_active == 2 and plan.k_medium == 3
    assert plan.order.tolist() == [[1, 2, 0, 3], [0, 1, 3, 2]]


def test_region_flops_equal_the_closed_form_when_every_token_is_computed():
    model = tiny_model()
    full = mmdit_forward_flops(model, 32, 6, 3)["total"]
    assert region_forward_flops(model, 32, 6, 3) == full
    assert region_forward_flops(model, 32, 6, 3, 8) < full


def sampler_for(model):
    return VideoSampler(model, vae=None, text_encoder=None, progress=False)


def denoise(sampler, batch, steps=8, guidance=3.0, image_guidance=1.0):
    text = dict(text_emb=batch["text_emb"], text_mask=batch["text_mask"], pooled=batch["pooled"])
    null = dict(
        text_emb=torch.zeros_like(batch["text_emb"]),
        text_mask=batch["text_mask"],
        pooled=torch.zeros_like(batch["pooled"]),
    )
    condition = PreparedCondition(batch["cond"], torch.zeros_like(batch["cond"]), True)
    return sampler.denoise(
        batch["x"], text, null, condition, num_steps=steps, guidance_scale=guidance, image_guidance_scale=image_guidance
    )


def test_sampler_without_jano_is_unchanged_and_all_active_jano_is_bit_identical():
    model, batch = tiny_model(), inputs()
    sampler = sampler_for(model)
    plain = denoise(sampler, batch)
    sampler.accelerator = FullCompute()
    assert torch.equal(denoise(sampler, batch), plain)
    cache = JanoCache(JanoConfig(warmup_steps=2, cooldown_steps=1, refresh_interval=3))
    cache.forced_classes = torch.full((4, 32), 3, dtype=torch.int8)  # 2 samples x 2 CFG branches, all active
    sampler.accelerator = cache
    assert torch.equal(denoise(sampler, batch), plain)
    assert cache.stats.flops == cache.stats.full_flops


def test_jano_sampler_with_cfg_condition_and_batch_caches_and_saves_flops():
    model, batch = tiny_model(), inputs()
    sampler = sampler_for(model)
    plain = denoise(sampler, batch, steps=12)
    cache = JanoCache(JanoConfig(warmup_steps=3, cooldown_steps=1, refresh_interval=4, dilation=0))
    sampler.accelerator = cache
    out = denoise(sampler, batch, steps=12)
    assert cache.stats.levels[:3] == [0, 0, 0] and {1, 2, 3} <= set(cache.stats.levels)
    assert cache.stats.flops < cache.stats.full_flops
    counts = cache.region_counts["static"]
    assert len(counts) == 4 and counts[:2] == counts[2:]  # the 2 CFG branches of a sample share its regions
    assert torch.equal(cache.plan.order[:2], cache.plan.order[2:])
    assert min(counts) >= 16  # the condition frame's 16 tokens are static
    assert torch.isfinite(out).all() and (out - plain).abs().mean() < (plain.abs().mean())
    # the same trajectory through the naive offload store gives the same numbers
    sampler.accelerator = JanoCache(cache.config, store=NaiveOffload("cpu"))
    assert torch.equal(denoise(sampler, batch, steps=12), out)


def test_step_cache_baseline():
    model, batch = tiny_model(), inputs()
    sampler = sampler_for(model)
    plain = denoise(sampler, batch)
    sampler.accelerator = StepCache(threshold=0.0)
    assert torch.equal(denoise(sampler, batch), plain)
    skipping = StepCache(threshold=10.0)
    sampler.accelerator = skipping
    denoise(sampler, batch)
    assert -1 in skipping.stats.levels and skipping.stats.flops < skipping.stats.full_flops / 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize(
    "store", ["offload", "offload_one_chunk", "offload_slots", "offload_all_slots", "offload_v1", "naive"]
)
def test_offloaded_caches_equal_the_on_gpu_cache(store):
    model = tiny_model().cuda().to(torch.bfloat16)
    batch = {k: v.cuda() if v is not None else None for k, v in inputs().items()}
    sampler = sampler_for(model)
    config = JanoConfig(warmup_steps=3, cooldown_steps=1, refresh_interval=4, dilation=0)
    sampler.accelerator = JanoCache(config, store=DeviceStore())
    on_gpu = denoise(sampler, batch, steps=12)
    other = {
        # several chunks per step, several store batches per refresh (the tiny entries are a few KiB)
        "offload": lambda: PackedOffloadManager("cuda", slot_bytes=8 * 1024, slots=2, flush_bytes=16 * 1024),
        "offload_one_chunk": lambda: PackedOffloadManager("cuda"),  # defaults: a whole step in one chunk
        "offload_slots": lambda: OffloadManager("cuda", ring_size=2),
        "offload_all_slots": lambda: OffloadManager("cuda", ring_size=None),  # unchanged entries reuse their slot
        "offload_v1": lambda: OffloadManager("cuda", ring_size=2, reuse_slots=False),
        "naive": lambda: NaiveOffload("cuda"),
    }[store]()
    sampler.accelerator = JanoCache(config, store=other)
    assert torch.equal(denoise(sampler, batch, steps=12), on_gpu)
    if store != "naive":
        torch.cuda.synchronize()
        assert other.stats["sync_fetches"] == 0 and other.inflight() == 0
    if store == "offload_all_slots":
        assert other.stats["slot_hits"] > 0
    if store == "offload":
        assert other.stats["chunks"] > 1 and other.stats["flushes"] > 1


def test_cli_jano_settings_are_the_config_fields():
    from dataclasses import fields

    from opensora.inference import cli

    assert cli.INFERENCE_FLAGS["jano"] is False and cli.INFERENCE_FLAGS["jano_offload"] is False
    assert cli.INFERENCE_FLAGS["jano_graphs"] is False
    names = {f.name for f in fields(JanoConfig)} - {"store", "graphs"}
    assert set(cli.INFERENCE_FLAGS["jano_settings"]) == names
    assert JanoConfig(**cli.INFERENCE_FLAGS["jano_settings"]) == JanoConfig()


@pytest.mark.slow
def test_benchmark_script_smoke(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "jano.json"
    cmd = [sys.executable, "-m", "benchmarks.jano", "--smoke", "--parts", "levels,offload", "--out", str(out)]
    result = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data["levels"]["levels"]) >= {"L0 full", "L1 active", "L2 active+medium", "L3 full+refresh"}
    assert all(row["output_equal_to_device"] for row in data["offload"]["stores"].values())
    assert "goals:" in result.stdout


def test_cli_jano_flag_samples_and_records_its_settings(tmp_path):
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    from opensora.config import load_config
    from opensora.inference import cli
    from opensora.registry import MODELS, build_module

    root = Path(__file__).resolve().parents[1]
    config = root / "configs/diffusion/inference/demo.py"
    file = tmp_path / "random.safetensors"
    save_file(build_module(load_config(config).model, MODELS).state_dict(), str(file))
    written = cli.main(
        [
            str(config),
            "--ckpt",
            str(file),
            "--prompt",
            "a red circle moving left|a blue square",
            "--save-dir",
            str(tmp_path / "jano"),
            "--num-frames",
            "4",
            "--num-steps",
            "5",
            "--batch-size",
            "2",
            "--no-progress",
            "--jano",
            "--jano-offload",
            "--jano-graphs",
            "--jano-settings.warmup_steps",
            "2",
            "--jano-settings.cooldown_steps",
            "1",
        ]
    )
    assert len(written) == 2
    side = json.loads(written[0].with_suffix(".json").read_text())
    assert side["jano"]["warmup_steps"] == 2 and side["jano"]["store"] == "offload"  # a CPU run keeps it on the CPU
    assert side["jano"]["graphs"] is True  # off the GPU the levels run eagerly


def test_jano_with_three_guidance_passes_keeps_a_region_set_per_row():
    model, batch = tiny_model(), inputs()
    sampler = sampler_for(model)
    config = JanoConfig(warmup_steps=3, cooldown_steps=1, refresh_interval=4, dilation=0, share_branches=False)
    cache = JanoCache(config)
    sampler.accelerator = cache
    denoise(sampler, batch, steps=10, image_guidance=1.5)
    assert len(cache.region_counts["active"]) == 6  # 2 samples x (cond, null text, null text and image)
    # the no-image rows have no static condition frame: with this random network one of them is all active, and
    # the largest count over rows (batch_quantile=1) then means full compute for the whole batch
    assert max(cache.region_counts["active"]) == 32 and set(cache.stats.levels) == {0, 3}
    cache = JanoCache(JanoConfig(**{**vars(config), "batch_quantile": 0.5}))
    sampler.accelerator = cache
    out = denoise(sampler, batch, steps=10, image_guidance=1.5)
    assert torch.isfinite(out).all() and {1, 3} <= set(cache.stats.levels)
    assert cache.plan.k_active <= sorted(cache.region_counts["active"])[3]


def test_plan_orders_by_score_inside_a_class_and_takes_a_quantile_of_the_counts():
    classes = torch.tensor([[3, 3, 3, 1], [3, 1, 1, 1], [3, 2, 1, 1]], dtype=torch.int8)
    score = torch.tensor([[0.1, 0.9, 0.5, 0.0], [1.0, 0.0, 0.2, 0.1], [1.0, 0.5, 0.3, 0.0]])
    plan = RegionPlan.from_classes(classes, score, batch_quantile=0.5)
    assert plan.order.tolist() == [[1, 2, 0, 3], [0, 2, 3, 1], [0, 1, 2, 3]]
    assert plan.k_active == 1 and plan.k_medium == 2
    assert RegionPlan.from_classes(classes, score).k_active == 3


def test_benchmark_copy_overlap_summary(tmp_path):
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks/jano.py"
    spec = importlib.util.spec_from_file_location("jano_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    kernel = lambda ts, dur: dict(ph="X", cat="kernel", name="gemm", ts=ts, dur=dur, args=dict(stream=7))  # noqa
    copy = lambda ts, name: dict(ph="X", cat="gpu_memcpy", name=name, ts=ts, dur=10, args=dict(stream=9))  # noqa
    events = [
        kernel(0, 10),
        kernel(5, 10),
        kernel(30, 10),
        copy(10, "Memcpy HtoD (Pinned -> Device)"),
        copy(35, "Memcpy DtoH (Device -> Pinned)"),
        copy(50, "Memcpy HtoD (Pinned -> Device)"),
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(dict(traceEvents=events)))
    summary = bench.copy_overlap(str(trace))
    assert summary["HtoD"] == dict(copy_us=20.0, overlapped_fraction=0.25)  # 5 of [10, 20], none of [50, 60]
    assert summary["DtoH"]["overlapped_fraction"] == 0.5 and summary["copies"] == 3

    # compute-stream idle time: host (the launch returned after the gap began) vs waiting (queued but held back)
    launch = lambda ts, corr: dict(
        ph="X", cat="cuda_runtime", name="cudaLaunchKernel", ts=ts, dur=5, args=dict(correlation=corr)
    )  # noqa
    timed_kernel = lambda ts, dur, corr: dict(
        ph="X", cat="kernel", name="k", ts=ts, dur=dur, args=dict(stream=7, correlation=corr)
    )  # noqa
    events = [launch(0, 1), launch(10, 2), launch(200, 3), launch(300, 4)]
    events += [timed_kernel(10, 40, 1), timed_kernel(100, 10, 2), timed_kernel(250, 10, 3), timed_kernel(400, 10, 4)]
    events += [copy(40, "Memcpy HtoD (Pinned -> Device)") | dict(dur=60), copy(320, "Memcpy HtoD (Pinned -> Device)")]
    events[-1]["dur"] = 75  # ends at 395, 5 us before kernel 4 starts
    trace.write_text(json.dumps(dict(traceEvents=events)))
    gaps = bench.compute_gaps(str(trace))
    # gap 50-100: queued at 15, all waiting, under the first copy (ends at 100: the wait ended with it);
    # gap 110-250: host until 205, then waiting; gap 260-400: host until 305, waiting, ended by the second copy
    assert gaps["gap_host_us"] == 95 + 45 and gaps["gap_wait_us"] == 50 + 45 + 95
    assert gaps["gap_wait_under_h2d_us"] == 50 + 75 and gaps["gap_wait_ended_by_h2d_us"] == 50 + 95

    # the floor per level: max(compute, H2D bytes / rate, D2H bytes / rate)
    floor = bench.floors(
        [REFRESH, ACTIVE],
        [(0, 10e6), (30e6, 0)],
        {"L3 full+refresh": 5.0, "L1 active": 2.0},
        dict(h2d_pinned_GBps=10, d2h_pinned_GBps=10),
    )
    assert floor["per_level"]["L3 full+refresh"]["floor_ms"] == 5.0
    assert floor["per_level"]["L1 active"]["floor_ms"] == pytest.approx(3.0)
    assert floor["per_level"]["L1 active"]["bound"] == "copy" and floor["floor_ms_per_step"] == pytest.approx(4.0)


@pytest.mark.parametrize("level", [ACTIVE, MEDIUM, REFRESH])
def test_counted_flops_are_the_flops_the_region_forward_spends(level):
    from torch.utils.flop_counter import FlopCounterMode

    model, batch = tiny_model(), inputs(padded=False)
    model.set_attn_backend("math")  # the backend whose attention FlopCounterMode counts (as tests/test_mmdit.py)
    plan, _ = random_plan()
    forward, store = RegionForward(model), DeviceStore()
    forward(REFRESH, **batch, plan=plan, store=store)
    with FlopCounterMode(display=False) as counter:
        forward(level, **batch, plan=plan, store=store)
    assert counter.get_total_flops() == region_forward_flops(model, 32, 6, 2, plan.computed(level), True)


def test_medium_entries_that_no_level_one_step_reads_are_not_stored(monkeypatch):
    from opensora.inference.cache import jano

    levels = [3, 1, 2, 1, 2, 3, 2, 2, 1, 0]
    assert [jano.medium_read_later(lambda j: levels[j], i, len(levels)) for i in (2, 4, 6, 7)] == [
        True,
        False,
        False,
        True,
    ]

    class Counting(DeviceStore):
        wants_hints = True

        def __init__(self):
            super().__init__()
            self.keys = []

        def store_async(self, tensor, key):
            self.keys.append(key)
            super().store_async(tensor, key)

        def hint_upcoming(self, keys):
            self.hints = getattr(self, "hints", []) + [list(keys)]

    model, batch = tiny_model(), inputs()
    sampler = sampler_for(model)
    config = JanoConfig(warmup_steps=3, cooldown_steps=1, refresh_interval=3, medium_interval=2, dilation=0)
    runs = {}
    for always in (False, True):
        if always:
            monkeypatch.setattr(jano, "medium_read_later", lambda *args: True)
        store = Counting()
        cache = JanoCache(config, store=store)
        cache.forced_classes = torch.ones(4, 32, dtype=torch.int8)  # 2 samples x 2 CFG branches
        cache.forced_classes[:, :8], cache.forced_classes[:, 8:20] = 3, 2
        sampler.accelerator = cache
        runs[always] = denoise(sampler, batch, steps=12), store.keys
    assert cache.stats.levels == [0, 0, 0, 3, 1, 2, 3, 2, 1, 3, 1, 0]  # the first level-2 step precedes a refresh
    assert torch.equal(runs[False][0], runs[True][0])
    skipped = [k for k in runs[True][1] if k.startswith("m_")]
    assert len(skipped) - len([k for k in runs[False][1] if k.startswith("m_")]) == cache._forward.num_layers + 1
    # after each step that queues the next one's prefetches, the store hears the keys of the steps after it (up to
    # two, stopping at a refresh): after step 3 those of step 5 (level 2; step 6 refreshes), after step 6 step 8's
    layers = cache._forward.num_layers
    assert store.hints == [list(cache.plan.entry_keys(layers, 2)), [], list(cache.plan.entry_keys(layers, 1)), [], []]
