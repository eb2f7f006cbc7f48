"""The training step users run with real prompts, next to diffusers' Flux: padded text, full checkpointing, batch 4.

Shape (the 1B preset, 8 double + 16 single blocks, 1536 wide, 12 heads x 128): batch 4 at 256px x 33 frames =
9 x 16 x 16 = 2304 video tokens per sample; T5 text padded to 512 tokens of which 20-120 are valid (uniform, fresh
a different draw every step, so the compiled model sees changing lengths as in training); full gradient
checkpointing; bf16 weights and activations, fused AdamW. Each variant's inputs (``--input-pool`` draws, cycled) are
made on the GPU before timing, as a data loader hands them over ready: drawing them on the host each step (what this
benchmark did until 2026-11-27) made the step host-bound, the 512-column padded text 4x more so than the 128-column
unpadded text, and inflated the padded / unpadded ratio (benchmarks/reports/padded_text_h200_2026-11.md). Every variant lives in this one process and the variants run in interleaved
rounds (round r: each variant ``--iters`` steps), so slow drift of the card hits all of them alike.

Variants (``ours-*`` share one model; ``diffusers-*`` is diffusers' FluxTransformer2DModel with flash SDPA, which
has no text mask: it attends to every padded token, as Flux training does):
  ours-padded          compiled blocks, 512 padded columns given: the model reads the valid lengths back, trims
                       the text and skips the rest of the padding per row (text_padding.py; zero keys since
                       2026-11-27, the dense key mask before, now ours-padded-dense)
  ours-padded-bound    the same with the longest prompt length given from the host (text_length_bound): the model
                       cuts the text there and reads no lengths back from the GPU (no host wait per forward;
                       FlowMatching passes the bound since 2026-11-27), with torch.utils.checkpoint around each
                       compiled block (MMDiT(checkpoint_in_graph=False): the trainer's step until 2026-11-27)
  ours-padded-bound-graph-ckpt  the same with each checkpointed block call compiled as one graph, the recompute
                       inside the compiled backward (MMDiT.checkpoint_in_graph, the default since 2026-11-27;
                       graph_checkpoint.py) -- what the trainer runs
  ours-padded-bound-graph-ckpt-master  the same with the trainer's optimizer precision: fp32 master weights and
                       AdamW moments, fused AdamW on the masters, masters copied back into the bf16 weights
                       (train_step.MasterWeightAdamW; no clip, no EMA, no ZeRO bookkeeping): the trainer's like-for-like
                       bare step
  ours-padded-bound-graph-ckpt-fa4  the trainer's step with the attention backend "fa4": FlashAttention 4 as the
                       zero-key kernel (fa4_kernel.py); only where flash-attn-4 imports (the reason is printed and
                       kept under ``fa4_missing`` otherwise; benchmarks/fa4_wheels.sh installs it)
  ours-padded-bound-graph-ckpt-cudagraphs  the trainer's step with each compiled block graph replayed as a CUDA graph
                       (Inductor's ``triton.cudagraphs``, cudagraph trees; a third model, built only when asked
                       for; CUDA only): the profiled step spends ~18 of its 164 ms between kernels (2666 launches)
  ours-padded-bound-graph-ckpt-autotune  the trainer's step with Inductor's max-autotune GEMMs (``max_autotune_gemm``:
                       Triton GEMM templates benchmarked against cuBLAS, pointwise epilogues such as the single blocks'
                       GELU fusable into the winner; a model of its own, built only when asked for; CUDA only)
  ours-padded-bound-graph-ckpt-coordesc  the same with Inductor's coordinate-descent tuning of the pointwise and
                       reduction kernels (``coordinate_descent_tuning``: the norms and copies, 35 of the profiled
                       146 ms)
  (every other ours-* variant runs the model's default, the recompute inside the graph since 2026-11-27)
  ours-unpadded-128    compiled, 128 text columns and no mask: the mask-free step at the trimmed shape
  ours-unpadded-70     compiled, 70 text columns and no mask: the mean valid length of the padded batches
  ours-masked          compiled, the 512 columns behind a dense boolean mask (what the model did before trimming)
  ours-eager-padded    the padded batch with eager blocks
  diffusers-512        Flux over all 512 text tokens (what diffusers users run)
  diffusers-128        Flux at our trimmed token count

MFU: model FLOPs (3x forward matmuls incl. attention, recompute not counted) / step time, against both the measured
bf16 matmul ceiling (--ceiling-tflops, 752 on H100/H200) and the vendor dense peak (--vendor-tflops, 989).
``useful`` counts the valid tokens only (2304 video + each row's valid text); ``processed`` the tokens the variant's
kernels ran over (diffusers-512: all 512 text tokens).

  python -m benchmarks.padded_text_step --out $OUT/padded_text_step.json
  python -m benchmarks.padded_text_step --warm-lengths 0    # cold: cuDNN meets each prompt length in the timed steps

cuDNN builds an execution plan per new attention shape (~0.1 s); the per-row padded path gives each row its own
shape, so the first steps that meet a prompt length pay it (once per length per run). When a per-row variant is timed
the benchmark builds them first by default (``text_padding.warm_attention_lengths``) and times the steady state;
``--warm-lengths 0`` times the cold start.
  python -m benchmarks.padded_text_step --tiny          # CPU smoke test of the script
"""

import argparse
import contextlib
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import OUT, model_config, randomize_
from benchmarks.train_step import LATENT_CHANNELS, flux_model, spread

REAL = dict(grid=(9, 16, 16), batch=4, text_tokens=512, valid=(20, 120), depth_double=8, depth_single=16,
            hidden=1536, heads=12, text_dim=4096, pooled_dim=768, axes=(16, 56, 56))  # fmt: skip
TINY = dict(grid=(2, 4, 4), batch=2, text_tokens=40, valid=(3, 9), depth_double=1, depth_single=1,
            hidden=64, heads=2, text_dim=32, pooled_dim=16, axes=(8, 12, 12))  # fmt: skip

# Variants with Inductor options of their own: each needs its own model (a model's blocks compile with one set of
# options), so each is built only when named in --variants. name -> (Inductor options, step context or None)
OWN_MODEL_VARIANTS = {
    "ours-padded-bound-graph-ckpt-cudagraphs": ({"triton.cudagraphs": True}, lambda: cudagraph_step()),
    "ours-padded-bound-graph-ckpt-autotune": ({"max_autotune_gemm": True}, None),
    "ours-padded-bound-graph-ckpt-coordesc": ({"coordinate_descent_tuning": True}, None),
}
VARIANTS = ("ours-padded", "ours-padded-bound", "ours-padded-bound-graph-ckpt", "ours-padded-bound-graph-ckpt-master", "ours-padded-bound-graph-ckpt-fa4", *OWN_MODEL_VARIANTS, "ours-padded-dense", "ours-padded-flex", "ours-padded-bias-channel", "ours-padded-zero-keys", "ours-padded-packed", "ours-padded-packed-128", "ours-padded-rows", "ours-padded-dense-32",
            "ours-unpadded-128", "ours-unpadded-70", "ours-masked", "ours-eager-padded", "diffusers-512",
            "diffusers-128")  # fmt: skip
PER_ROW_VARIANTS = ("ours-padded-rows",)  # one SDPA call per row: a cuDNN plan per prompt length
# torch has no flex_attention backward on CPU, and CUDA graphs and GEMM autotuning need CUDA: --tiny leaves them out
CUDA_ONLY_VARIANTS = ("ours-padded-flex", *OWN_MODEL_VARIANTS)
OPT_IN_VARIANTS = tuple(OWN_MODEL_VARIANTS)  # run only when named in --variants (a model each)


def our_config(shape):
    cfg = model_config(shape, in_channels=LATENT_CHANNELS)
    cfg.pop("type")
    return cfg


def useful_flops(shape, text_lengths):
    """Model FLOPs of one step over each row's valid tokens (video + its valid text), summed over the rows."""
    from opensora.models.mmdit import mmdit_train_flops

    cfg, video = our_config(shape), shape["grid"][0] * shape["grid"][1] * shape["grid"][2]
    return sum(mmdit_train_flops(cfg, video, length, 1) for length in text_lengths)


@contextlib.contextmanager
def dense_text_mask():
    """The model's path before trimming: every padded column kept, a dense boolean key mask."""
    import opensora.models.mmdit.model as model_module

    trim = model_module.trim_text
    model_module.trim_text = lambda emb, mask, has_padding=None, multiple=None: (emb, mask, None)
    try:
        yield
    finally:
        model_module.trim_text = trim


class Variant:
    """One way to run a step: a model, its optimizer, an input maker (step index -> inputs) and a context."""

    def __init__(self, name, model, optimizer, make, forward, processed, context=contextlib.nullcontext):
        self.name, self.model, self.optimizer, self.make, self.forward = name, model, optimizer, make, forward
        self.processed, self.context = processed, context
        self.times, self.useful, self.peak = [], [], 0.0

    def step(self, index):
        import torch

        inputs, target, lengths = self.make(index)
        with self.context():
            out = self.forward(self.model, inputs)
            loss = torch.nn.functional.mse_loss(out.float(), target.float())
            loss.backward()
        self.optimizer.step()
        self.model.zero_grad(set_to_none=True)
        return loss, lengths


class MastersOnFirstStep:
    """The trainer's optimizer precision (``train_step.MasterWeightAdamW``: fp32 masters and moments, AdamW on the
    masters, copied back into the bf16 weights), built at its first step so the fp32 copies (12 bytes a parameter)
    exist only when the variant runs."""

    def __init__(self, model, fused: bool):
        self.model, self.fused, self.inner = model, fused, None

    def step(self):
        if self.inner is None:
            from benchmarks.train_step import MasterWeightAdamW

            self.inner = MasterWeightAdamW(self.model, fused=self.fused)
        self.inner()


def checkpoint_in_graph(model, in_graph):
    """``MMDiT.checkpoint_in_graph`` set to ``in_graph`` for the step: True, the checkpointed blocks compiled with
    their recompute inside the graph (the default since 2026-11-27); False, ``torch.utils.checkpoint`` around each
    compiled block."""

    @contextlib.contextmanager
    def context():
        before = model.checkpoint_in_graph
        model.checkpoint_in_graph = in_graph
        try:
            yield
        finally:
            model.checkpoint_in_graph = before

    return context


def attention_backend(model, backend):
    """The model's attention backend set to ``backend`` for the step (Dynamo recompiles the blocks once for it)."""

    @contextlib.contextmanager
    def context():
        before = model.arch["attn_backend"]
        model.set_attn_backend(backend)
        try:
            yield
        finally:
            model.set_attn_backend(before)

    return context


@contextlib.contextmanager
def cudagraph_step():
    """A new training iteration for the cudagraph trees (the last step's graph outputs may be overwritten)."""
    import torch

    torch.compiler.cudagraph_mark_step_begin()
    yield


def chained(*contexts):
    """One step context made of several."""

    @contextlib.contextmanager
    def context():
        with contextlib.ExitStack() as stack:
            for make in contexts:
                stack.enter_context(make())
            yield

    return context


def padded_path(model, how, multiple):
    """The padded rows through ``how`` (model.padded_text_attention) with text trimmed to multiples of ``multiple``
    (the default 128: one trimmed length for 20-120-token prompts, so the compiled blocks see one shape)."""

    @contextlib.contextmanager
    def context():
        before = model.padded_text_attention, model.text_length_multiple
        model.padded_text_attention, model.text_length_multiple = how, multiple
        try:
            yield
        finally:
            model.padded_text_attention, model.text_length_multiple = before

    return context


def build(shape, device, dtype, args):
    import torch

    from opensora.models.mmdit import MMDiT, fa4_kernel

    t, h, w = shape["grid"]
    batch, n_txt = shape["batch"], shape["text_tokens"]
    video = t * h * w

    def our_model(compiled, inductor_options=None):
        with torch.device(device):
            model = MMDiT(**our_config(shape))
        randomize_(model)
        model.to(device=device, dtype=dtype).train()
        model.set_grad_ckpt(shape["depth_double"], shape["depth_single"])
        model.set_compile_blocks(compiled, inductor_options)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")

    wanted = args.variants.split(",") if args.variants else [v for v in VARIANTS if v not in OPT_IN_VARIANTS]
    if torch.device(device).type != "cuda":
        wanted = [name for name in wanted if name not in CUDA_ONLY_VARIANTS]
    if not args.tiny and not fa4_kernel.available():  # on the CPU smoke run "fa4" falls back to SDPA
        print(f"ours-padded-bound-graph-ckpt-fa4 skipped: {fa4_kernel.unavailable_reason()}", flush=True)
        wanted = [name for name in wanted if not name.endswith("-fa4")]

    # two models: toggling compile_blocks on one would make Dynamo recompile at every switch (a new backend)
    ours, ours_opt = our_model(device.type == "cuda" or args.tiny_compile)
    eager, eager_opt = our_model(False)

    def draws(index, seed):
        gen = torch.Generator().manual_seed(seed * 1000 + index)
        lengths = torch.randint(shape["valid"][0], shape["valid"][1] + 1, (batch,), generator=gen).tolist()
        rnd = lambda *s: torch.randn(*s, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
        return gen, lengths, rnd

    def pooled(make):
        """``make``'s first ``--input-pool`` draws, made now on the device and cycled: no host work in the step."""
        pool = [make(index) for index in range(max(1, args.input_pool))]
        return lambda index: pool[index % len(pool)]

    def ours_inputs(text_cols, masked, host_bound=False):
        def make(index):
            gen, lengths, rnd = draws(index, 1)
            inputs = dict(
                x=rnd(batch, LATENT_CHANNELS, t, 2 * h, 2 * w),
                timestep=torch.rand(batch, generator=gen).to(device),
                text_emb=rnd(batch, text_cols, shape["text_dim"]),
                pooled=rnd(batch, shape["pooled_dim"]),
            )
            if masked:  # T5's mask: valid tokens first, on the device as the text encoder returns it
                inputs["text_mask"] = (torch.arange(text_cols)[None] < torch.tensor(lengths)[:, None]).to(device)
                if host_bound:  # the longest prompt known on the host: the model reads no lengths back
                    inputs["text_length_bound"] = max(lengths)
            else:
                lengths = [text_cols] * batch
            return inputs, rnd(*inputs["x"].shape), lengths

        return pooled(make)

    def flux_inputs(text_cols):
        from opensora.models.mmdit.rope import video_position_ids

        def make(index):
            gen, lengths, rnd = draws(index, 2)
            inputs = dict(
                hidden_states=rnd(batch, video, 4 * LATENT_CHANNELS),
                encoder_hidden_states=rnd(batch, text_cols, shape["text_dim"]),
                pooled_projections=rnd(batch, shape["pooled_dim"]),
                timestep=torch.rand(batch, generator=gen).to(device, dtype),
                img_ids=video_position_ids(t, h, w).to(device, dtype),
                txt_ids=torch.zeros(text_cols, 3).to(device, dtype),
                return_dict=False,
            )
            return inputs, rnd(*inputs["hidden_states"].shape), lengths  # FLOPs: the valid tokens, as for ours

        return pooled(make)

    run_ours = lambda model, inputs: model(**inputs)  # noqa: E731
    run_flux = lambda model, inputs: model(**inputs)[0]  # noqa: E731

    processed = lambda cols: mmdit_flops_at(shape, cols)  # noqa: E731
    padded = ours_inputs(n_txt, True)
    bounded = ours_inputs(n_txt, True, host_bound=True)
    variants = [
        Variant("ours-padded", ours, ours_opt, padded, run_ours, None),  # the model's defaults
        Variant("ours-padded-dense", ours, ours_opt, padded, run_ours, None, padded_path(ours, "dense", 128)),
        Variant("ours-padded-flex", ours, ours_opt, padded, run_ours, None, padded_path(ours, "flex", 128)),
        Variant(
            "ours-padded-bias-channel", ours, ours_opt, padded, run_ours, None, padded_path(ours, "bias-channel", 128)
        ),
        Variant("ours-padded-zero-keys", ours, ours_opt, padded, run_ours, None, padded_path(ours, "zero-keys", 128)),
        Variant("ours-padded-bound", ours, ours_opt, bounded, run_ours, None, checkpoint_in_graph(ours, False)),
        Variant(
            "ours-padded-bound-graph-ckpt", ours, ours_opt, bounded, run_ours, None, checkpoint_in_graph(ours, True)
        ),
        Variant(
            "ours-padded-bound-graph-ckpt-master",
            ours,
            MastersOnFirstStep(ours, fused=device.type == "cuda"),
            bounded,
            run_ours,
            None,
            checkpoint_in_graph(ours, True),
        ),
        Variant(
            "ours-padded-bound-graph-ckpt-fa4",
            ours,
            ours_opt,
            bounded,
            run_ours,
            None,
            chained(checkpoint_in_graph(ours, True), attention_backend(ours, "fa4")),
        ),
        Variant("ours-padded-packed", ours, ours_opt, padded, run_ours, None, padded_path(ours, "packed", 32)),
        Variant("ours-padded-packed-128", ours, ours_opt, padded, run_ours, None, padded_path(ours, "packed", 128)),
        Variant("ours-padded-rows", ours, ours_opt, padded, run_ours, None, padded_path(ours, "rows", 32)),
        Variant("ours-padded-dense-32", ours, ours_opt, padded, run_ours, None, padded_path(ours, "dense", 32)),
        Variant(
            "ours-unpadded-128",
            ours,
            ours_opt,
            ours_inputs(min(128, n_txt), False),
            run_ours,
            processed(min(128, n_txt)),
        ),  # fmt: skip
        Variant(
            "ours-unpadded-70", ours, ours_opt, ours_inputs(min(70, n_txt), False), run_ours, processed(min(70, n_txt))
        ),  # fmt: skip
        Variant("ours-masked", ours, ours_opt, ours_inputs(n_txt, True), run_ours, processed(n_txt), dense_text_mask),
        Variant("ours-eager-padded", eager, eager_opt, ours_inputs(n_txt, True), run_ours, None),
    ]
    if not args.no_diffusers:
        with torch.device(device):
            flux = flux_model(shape)
        randomize_(flux)
        flux.to(device=device, dtype=dtype).train()
        flux.enable_gradient_checkpointing()
        flux_opt = torch.optim.AdamW(flux.parameters(), lr=1e-5, fused=device.type == "cuda")
        flash = flash_context(device)
        variants += [
            Variant("diffusers-512", flux, flux_opt, flux_inputs(n_txt), run_flux, processed(n_txt), flash),
            Variant(
                "diffusers-128",
                flux,
                flux_opt,
                flux_inputs(min(128, n_txt)),
                run_flux,
                processed(min(128, n_txt)),
                flash,
            ),  # fmt: skip
        ]
    for name, (options, step_context) in OWN_MODEL_VARIANTS.items():
        if name not in wanted:
            continue
        model, opt = our_model(True, options)
        context = checkpoint_in_graph(model, True)
        if step_context is not None:
            context = chained(context, step_context)
        variants.append(Variant(name, model, opt, bounded, run_ours, None, context))
    return [v for v in variants if v.name in wanted]


def mmdit_flops_at(shape, text_cols):
    """FLOPs of a batch whose every row runs ``text_cols`` text tokens (what the kernels process)."""
    return useful_flops(shape, [text_cols] * shape["batch"])


def flash_context(device):
    if device.type != "cuda":
        return contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION])


def run(args):
    import torch
    from torch._dynamo.utils import counters

    shape = TINY if args.tiny else REAL
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    torch.manual_seed(0)
    variants = build(shape, device, dtype, args)
    cuda = device.type == "cuda"
    warm_s = None
    per_row = any(v.name in PER_ROW_VARIANTS for v in variants)  # the only path that meets a shape per prompt length
    if args.warm_lengths and cuda and per_row:  # steady state: cuDNN has built its plan for every prompt length
        from opensora.models.mmdit.text_padding import warm_attention_lengths

        t0 = time.perf_counter()
        lo, hi = shape["valid"]
        video = shape["grid"][0] * shape["grid"][1] * shape["grid"][2]
        warm_attention_lengths(
            shape["heads"], shape["hidden"] // shape["heads"], video, range(lo, hi + 1), device, dtype
        )
        torch.cuda.synchronize()
        warm_s = round(time.perf_counter() - t0, 1)
        print(f"cuDNN plans for prompt lengths {lo}-{hi}: {warm_s} s", flush=True)
    warm = {}
    index = 0
    for v in variants:  # warm-up (compilation happens here: the first steps of the first compiled variant)
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            loss, _ = v.step(index)
            index += 1
        if cuda:
            torch.cuda.synchronize()
        warm[v.name] = round(time.perf_counter() - t0, 2)
        if not torch.isfinite(loss):
            raise RuntimeError(f"{v.name}: non-finite loss {loss.item()}")
        print(f"warm-up {v.name}: {warm[v.name]} s, graphs so far {counters['stats']['unique_graphs']}", flush=True)
    for round_ in range(args.rounds):
        for v in variants:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            for _ in range(args.iters):
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    _, lengths = v.step(index)
                    end.record()
                    end.synchronize()
                    v.times.append(start.elapsed_time(end) / 1e3)
                else:
                    s0 = time.perf_counter()
                    _, lengths = v.step(index)
                    v.times.append(time.perf_counter() - s0)
                v.useful.append(useful_flops(shape, lengths))
                index += 1
            if cuda:
                v.peak = max(v.peak, torch.cuda.max_memory_allocated() / 2**30)
    summaries = {}
    if args.profile_steps and cuda:  # after the timed rounds, so the profiler's overhead is not timed
        from benchmarks.train_step import profile_summary

        for v in variants:  # GPU ms by kernel category and the top kernels: which attention kernel each path runs
            first = index
            summaries[v.name] = profile_summary(lambda: v.step(first), args.profile_steps)
            index += 1
    rows = []
    for v in variants:
        median = statistics.median(v.times)
        useful = statistics.mean(v.useful)
        processed = v.processed if v.processed is not None else useful
        row = dict(variant=v.name, **spread(v.times), step_ms=median * 1e3, times_ms=[round(t * 1e3, 2) for t in v.times],
                   warmup_s=warm[v.name], peak_mem_gib=v.peak if cuda else None, useful_tflop=useful / 1e12,
                   processed_tflop=processed / 1e12, profile_summary=summaries.get(v.name))  # fmt: skip
        for name, peak in (("ceiling", args.ceiling_tflops), ("vendor", args.vendor_tflops)):
            row[f"mfu_useful_vs_{name}"] = useful / median / 1e12 / peak
            row[f"mfu_processed_vs_{name}"] = processed / median / 1e12 / peak
        rows.append(row)
    by = {r["variant"]: r for r in rows}
    ratios = {}
    for a, b in (("diffusers-512", "ours-padded"), ("diffusers-128", "ours-padded"), ("ours-padded", "ours-unpadded-128"),
                 ("ours-padded-rows", "ours-padded"), ("ours-padded-flex", "ours-padded"), ("ours-padded-flex", "ours-unpadded-128"),
                 ("ours-padded-bias-channel", "ours-padded"), ("ours-padded-bias-channel", "ours-unpadded-128"),
                 ("ours-padded-zero-keys", "ours-padded"), ("ours-padded-zero-keys", "ours-unpadded-128"),
                 ("ours-padded-dense", "ours-padded"), ("ours-padded-dense", "ours-unpadded-128"),
                 ("ours-padded-bound-graph-ckpt", "ours-padded"), ("ours-padded-bound-graph-ckpt", "ours-unpadded-128"),
                 ("diffusers-128", "ours-padded-bound"), ("diffusers-128", "ours-padded-bound-graph-ckpt"),
                 ("ours-padded-bound-graph-ckpt", "ours-padded-bound"),
                 ("ours-padded-bound-graph-ckpt-fa4", "ours-padded-bound-graph-ckpt"), ("diffusers-128", "ours-padded-bound-graph-ckpt-fa4"),
                 *((name, "ours-padded-bound-graph-ckpt") for name in OWN_MODEL_VARIANTS), *(("diffusers-128", name) for name in OWN_MODEL_VARIANTS),
                 ("ours-padded-packed", "ours-padded"),
                 ("ours-padded-packed-128", "ours-padded"), ("ours-padded-dense-32", "ours-padded"),
                 ("ours-padded", "ours-masked"), ("ours-padded", "ours-unpadded-70"), ("ours-masked", "ours-padded"), ("ours-eager-padded", "ours-padded")):  # fmt: skip
        if a in by and b in by:
            ratios[f"{a} / {b}"] = by[a]["step_ms"] / by[b]["step_ms"]
    from opensora.models.mmdit import fa4_kernel

    return dict(
        rows=rows,
        ratios=ratios,
        graphs=counters["stats"]["unique_graphs"],
        warm_lengths_s=warm_s,
        fa4_missing=None if args.tiny else fa4_kernel.unavailable_reason(),
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--input-pool", type=int, default=4, help="input draws per variant, made on the device before timing and cycled"
    )
    parser.add_argument("--iters", type=int, default=6, help="timed steps per variant per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", default="", help=f"comma list (default all): {','.join(VARIANTS)}")
    parser.add_argument(
        "--profile-steps", type=int, default=0, help="GPU: profile N steps per variant after timing (kernel summary)"
    )
    parser.add_argument("--no-diffusers", action="store_true")
    parser.add_argument(
        "--warm-lengths",
        type=int,
        default=1,
        help="1: build cuDNN's plans for every prompt length of the range before timing (steady state); 0: cold",
    )
    parser.add_argument("--ceiling-tflops", type=float, default=752.0, help="measured bf16 matmul ceiling")
    parser.add_argument("--vendor-tflops", type=float, default=989.0, help="vendor dense bf16 peak (H100/H200 SXM)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on CPU in fp32 (smoke test)")
    parser.add_argument("--tiny-compile", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import torch

    result = run(args)
    env = dict(date=datetime.date.today().isoformat(), torch=torch.__version__, shape="tiny" if args.tiny else "real")
    if torch.cuda.is_available() and not args.tiny:
        env["device"] = torch.cuda.get_device_name()
    report = dict(environment=env, **result)
    out = Path(args.out or OUT / f"padded_text_step_{env['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps(env))
    print(f"{'variant':20s} {'step ms':>8s} {'p90/p10':>7s} {'useful MFU 752/989':>19s} {'processed 752/989':>18s}")
    for r in result["rows"]:
        print(
            f"{r['variant']:20s} {r['step_ms']:8.1f} {r['p90_over_p10'] or 0:7.3f} "
            f"{100 * r['mfu_useful_vs_ceiling']:8.1f}/{100 * r['mfu_useful_vs_vendor']:4.1f}% "
            f"{100 * r['mfu_processed_vs_ceiling']:8.1f}/{100 * r['mfu_processed_vs_vendor']:4.1f}%"
        )
    for name, value in result["ratios"].items():
        print(f"{name}: {value:.3f}")
    for r in result["rows"]:
        if r["profile_summary"]:
            from opensora.training.profiling import format_profile

            print(f"{r['variant']} {format_profile(r['profile_summary'])}")
    print(f"compiled graphs: {result['graphs']}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
