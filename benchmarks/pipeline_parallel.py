"""Two-GPU pipeline overlap (opensora/inference/pipeline_parallel.py) vs one GPU, at the 1B MMDiT shape.

Streaming: a causal 1B MMDiT (8 double + 16 single blocks, 1536 wide, random weights) generates ``--chunks`` chunks
of ``--chunk-frames`` latent frames at 256px (32x32x16 latents, 256 tokens per frame) with ``--text-len`` text
tokens, each chunk decoded by a stand-in decoder (3D convs, 8x up in space, one frame per latent frame; the GPU
image has no diffusers VAE) on the last GPU. For every (batch 1 | 2 per item) x (steps per chunk 1 | 4) x
(refill on | off) x (1 | 2 items in flight), and for one video whose CFG passes run as 2 micro-batches, it times

* 1 GPU, the streaming sampler of ``--streaming`` (``StreamingGenerator``; the same math as a plain
  ``forward_chunk`` loop, ``stream_reference``, for the no-refill rows it cannot run),
* 1 GPU, the pipeline executor with both stages on cuda:0 (same work, no copies: the schedule's own overhead),
* 2 GPUs, ``--pp-overlap off | basic | aggressive`` with ``--pp-split auto`` (chosen per plan and mode from the
  stage times measured on a warm-up chunk; the candidates of one plan are printed), one host thread per GPU,
* 2 GPUs, aggressive issued by a single host thread (how much the per-GPU issuing threads matter),

checks every chunk's latents and decoded frames against the 1-GPU loop (max |diff| must be 0, on every timed
run), and takes per-GPU busy fractions from a separate profiled run (CUDA events per task). Then the bidirectional
multi-step sampler (Euler + CFG, the same weights without the causal mask, ``--bi-frames`` latent frames) with the
same block split and the CFG branches x prompt groups as the items in flight, again bit-identical to one GPU
running the same micro-batches (and, for reference, the batched-CFG sampler's time and its max |diff|).

  python benchmarks/pipeline_parallel.py --out benchmarks/results/pipeline_parallel.json     # 2 GPUs, ~3-4 min
  python benchmarks/pipeline_parallel.py --tiny                                              # CPU smoke test

Timing: ``--repeats`` timed runs after one warm-up run per configuration, the median reported; frames/s counts
decoded frames of all groups (the stand-in decoder makes one frame per latent frame: with a 4x temporal VAE the
video frames/s would be 4x the number printed, the ratios unchanged).
"""

import argparse
import copy
import datetime
import itertools
import json
import statistics
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from opensora.diffusion.guidance import text_cfg  # noqa: E402
from opensora.diffusion.sampling import euler_step, timesteps_for_sampling  # noqa: E402
from opensora.inference.pipeline_parallel import OVERLAP_MODES, Lanes, Plan, choose_split, run_plan  # noqa: E402
from opensora.inference.pipeline_stages import (  # noqa: E402
    BidirectionalStages,
    CausalStreamingStages,
    measure_stage_times,
    place_model,
    sample_microbatched,
    seeded_latent_noise,
    stream_reference,
)
from opensora.inference.streaming import ChunkDecoder, StreamingGenerator  # noqa: E402
from opensora.models.mmdit.configs import mmdit_config  # noqa: E402
from opensora.models.mmdit.model import MMDiT  # noqa: E402

STEP_LISTS = {1: [1.0], 4: [1.0, 0.75, 0.5, 0.25]}
# 1 GPU through the pipeline executor; 2 GPUs per overlap mode (one host thread per GPU); aggressive with one thread
VARIANTS = ("single-gpu-executor",) + OVERLAP_MODES + ("aggressive-1thread",)


class StandInDecoder(nn.Module):
    """Latent [B, C, T, h, w] -> uint8 video [B, T, 8h, 8w, 3]: a few 3D convs, the size of a small streaming
    decoder (the GPU image has no diffusers VAE). One video frame per latent frame, so chunks decode exactly."""

    latent_channels: int
    temporal_compression = 1  # what streaming.ChunkDecoder reads
    causal_temporal = False

    def __init__(self, channels: int, width: int = 128):
        super().__init__()
        self.latent_channels = channels
        self.net = nn.Sequential(
            nn.Conv3d(channels, width, 3, padding=1),
            nn.SiLU(),
            nn.ConvTranspose3d(width, width // 2, (1, 2, 2), stride=(1, 2, 2)),
            nn.SiLU(),
            nn.Conv3d(width // 2, width // 2, 3, padding=1),
            nn.SiLU(),
            nn.ConvTranspose3d(width // 2, width // 4, (1, 2, 2), stride=(1, 2, 2)),
            nn.SiLU(),
            nn.Conv3d(width // 4, width // 4, 3, padding=1),
            nn.SiLU(),
            nn.ConvTranspose3d(width // 4, 3, (1, 2, 2), stride=(1, 2, 2)),
        )

    @torch.no_grad()
    def forward(self, latent):
        video = self.net(latent.to(self.net[0].weight.dtype)).float().tanh()
        return ((video + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 4, 1)


class BenchSampler:
    """What ``streaming.StreamingGenerator`` needs from a ``VideoSampler``, with fixed random text features per
    prompt (the 1B shape's 4096-d T5 / 768-d CLIP sizes) instead of text encoders, and the stand-in decoder."""

    def __init__(self, model, decoder, text_len, seed=0):
        self.model, self.vae = model, decoder
        self.device, self.dtype = model.img_in.weight.device, model.img_in.weight.dtype
        self.text_len, self.seed = text_len, seed

    def features(self, key: str, batch: int) -> dict:
        g = torch.Generator().manual_seed(zlib.crc32(key.encode()) + self.seed)
        m = self.model
        return dict(
            text_emb=torch.randn(batch, self.text_len, m.txt_in.in_features, generator=g).to(self.device),
            text_mask=torch.ones(batch, self.text_len, dtype=torch.bool, device=self.device),
            pooled=torch.randn(batch, m.vector_in.in_layer.in_features, generator=g).to(self.device),
        )

    def encode_text(self, prompts):
        rows = [self.features(p, 1) for p in prompts]
        text = {k: torch.cat([r[k] for r in rows]) for k in rows[0]}
        return text, self.features("", len(prompts))

    def latent_size(self, num_frames, height, width):
        return (num_frames, height // 8, width // 8)  # frames are latent frames here

    def shift_alpha(self, size):
        return 1.0

    def decode(self, latents):
        return self.vae(latents).cpu()


def random_init(model, seed):
    torch.manual_seed(seed)
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Conv3d, nn.ConvTranspose3d)):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    return model


def sync(devices):
    for d in set(devices):
        if torch.device(d).type == "cuda":
            torch.cuda.synchronize(d)


def timed(fn, devices, repeats):
    """(median seconds over ``repeats`` runs after a warm-up run, outputs of every run)."""
    outs, times = [], []
    for i in range(repeats + 1):
        sync(devices)
        t0 = time.perf_counter()
        out = fn()
        sync(devices)
        if i:
            times.append(time.perf_counter() - t0)
            outs.append(out)
    return statistics.median(times), outs


def max_diff(a, b):
    if a.dtype == torch.uint8:
        a, b = a.int(), b.int()
    return float((a.float() - b.float()).abs().max())


def compare_stream_lists(a, b):
    """Largest |diff| between two per-group (latents, frames) chunk lists."""
    return max(max_diff(x.cpu(), y.cpu()) for (la, fa), (lb, fb) in zip(a, b) for x, y in [*zip(la, lb), *zip(fa, fb)])


def compare_stream(result, refs, num_chunks):
    """Largest |diff| over every chunk's latents and frames of every group (0.0 = bit-identical)."""
    worst = 0.0
    for g, (latents, frames) in enumerate(refs):
        for c in range(num_chunks):
            worst = max(
                worst,
                max_diff(result.latents[(g, c)], latents[c].cpu()),
                max_diff(result.frames[(g, c)], frames[c].cpu()),
            )
    return worst


def text_group(batch, length, text_dim, pooled_dim, seed, device):
    g = torch.Generator().manual_seed(seed)
    return dict(
        text_emb=torch.randn(batch, length, text_dim, generator=g).to(device),
        pooled=torch.randn(batch, pooled_dim, generator=g).to(device),
        text_mask=None,
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="JSON output path")
    parser.add_argument("--devices", default="cuda:0,cuda:1")
    parser.add_argument("--chunks", type=int, default=6)
    parser.add_argument("--chunk-frames", type=int, default=3)
    parser.add_argument("--latent-hw", type=int, default=32, help="latent side (256px / 8)")
    parser.add_argument("--text-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--bi-frames", type=int, default=8)
    parser.add_argument("--bi-steps", type=int, default=6)
    parser.add_argument("--steps", default="1,4")
    parser.add_argument("--groups", default="1,2", help="independent items (groups) in flight")
    parser.add_argument("--batches", default="1,2", help="samples per group (one micro-batch)")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=300.0,
        help="skip the remaining streaming configurations once the run has taken this long",
    )
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny model, both stages on the CPU")
    args = parser.parse_args(argv)
    started = time.time()
    devices = args.devices.split(",")
    if args.tiny:
        devices, dtype = ["cpu", "cpu"], torch.float32
        cfg = mmdit_config("tiny", cond_channels=None, causal_chunk_frames=2)
        args.chunk_frames, args.latent_hw, args.text_len, args.chunks, args.repeats = 2, 8, 8, 2, 1
        args.bi_frames, args.bi_steps = 2, 2
        torch.set_num_threads(1)
    else:
        if torch.cuda.device_count() < 2:
            raise SystemExit("needs 2 CUDA devices (or --tiny)")
        dtype = torch.bfloat16
        cfg = mmdit_config("1b", causal_chunk_frames=args.chunk_frames)
    dev0 = torch.device(devices[0])
    cfg.pop("type")
    with torch.device(dev0):
        model = random_init(MMDiT(**cfg), 0).to(dtype).eval().requires_grad_(False)
        decoder = random_init(StandInDecoder(cfg["in_channels"]), 1).to(dtype).eval()
    pp_model = copy.deepcopy(model)
    pp_decoder = copy.deepcopy(decoder).to(devices[1])
    n_blocks = len(model.double_blocks) + len(model.single_blocks)
    chunk_shape = (cfg["in_channels"], args.chunk_frames, args.latent_hw, args.latent_hw)
    text_dim, pooled_dim = cfg["text_dim"], cfg["pooled_dim"]
    bench = BenchSampler(model, decoder, args.text_len)
    step_counts = [int(s) for s in args.steps.split(",")]
    group_counts = [int(g) for g in args.groups.split(",")]
    x_warm = seeded_latent_noise([0], chunk_shape).to(dev0)
    times = measure_stage_times(model, x_warm, bench.features("warm-up", 1), decode=decoder)
    print(
        f"stage times (ms, one chunk at frame 0): embed {times['embed_ms']:.2f}, blocks "
        f"{sum(times['block_ms']):.2f} ({n_blocks}), final {times['final_ms']:.2f}, decode {times['decode_ms']:.2f}"
    )
    rows, split_tables, skipped = [], {}, []
    lat_frames = args.chunks * args.chunk_frames
    latent_size = (cfg["in_channels"], lat_frames, args.latent_hw, args.latent_hw)
    px = args.latent_hw * 8

    def prompt_groups(n_groups, batch):
        return [[f"prompt {g}-{i}" for i in range(batch)] for g in range(n_groups)]

    configs = [
        dict(steps=s_, refill=r_, items=n_, batch=b_, guidance=1.0, cfg_rows=True)
        for b_, s_, r_, n_ in itertools.product(
            [int(b) for b in args.batches.split(",")], step_counts, (True, False), group_counts
        )
    ]
    # one video with CFG: the two passes as micro-batches are two independent items (bit-identical to one GPU
    # running those micro-batches; the usual rows-CFG generator is the timing baseline)
    configs += [dict(steps=s_, refill=True, items=1, batch=1, guidance=4.0, cfg_rows=False) for s_ in step_counts]
    for conf in configs:
        steps, refill, n_groups, batch = conf["steps"], conf["refill"], conf["items"], conf["batch"]
        guided, rows_cfg = conf["guidance"] != 1.0, conf["cfg_rows"]
        label = (
            f"{steps} step{'s' if steps > 1 else ''}{' + refill' if refill else ''}, {n_groups} item(s) x batch "
            f"{batch}" + (", CFG as 2 micro-batches" if guided and not rows_cfg else "")
        )
        if time.time() - started > args.budget_s:
            skipped.append(label)
            continue
        gen = StreamingGenerator(bench, step_list=STEP_LISTS[steps], guidance_scale=conf["guidance"])
        times_list = gen.schedule(latent_size[1:])
        prompts = prompt_groups(n_groups, batch)
        seeds = [[100 + 10 * g + i for i in range(batch)] for g in range(n_groups)]
        groups = []
        for p, sd in zip(prompts, seeds):
            text, null = bench.encode_text(p)
            groups.append(dict(seeds=sd, branches=[text, null] if guided else [text]))
        kw = dict(refill=refill, rule="renoise", guidance_scale=conf["guidance"], cfg_rows=rows_cfg)
        video_frames = n_groups * batch * lat_frames

        def generator_run():  # the one-GPU streaming sampler (--streaming), one stream per item
            outs = []
            for p, sd in zip(prompts, seeds):
                chunks = list(gen.stream(p, sd, lat_frames, px, px))
                outs.append(([c.latents for c in chunks], [c.frames for c in chunks]))
            return outs

        def loop_run():  # the same math on one GPU for the variants the generator lacks
            return [
                stream_reference(
                    model,
                    g,
                    latent_size,
                    times_list,
                    device=dev0,
                    make_decoder=lambda: ChunkDecoder(decoder, decoder),
                    **kw,
                )
                for g in groups
            ]

        exact_generator = refill and (rows_cfg or not guided)
        t_ref, ref_outs = timed(generator_run if refill else loop_run, [dev0], args.repeats)
        refs = ref_outs[0] if exact_generator else loop_run()
        row = dict(
            config=label,
            baseline="StreamingGenerator" if refill else "stream_reference loop",
            **conf,
            one_gpu_s=t_ref,
            one_gpu_fps=video_frames / t_ref,
            modes={},
        )
        if not exact_generator:
            row["max_abs_diff_vs_baseline_layout"] = compare_stream_lists(ref_outs[0], refs)
        plan = CausalStreamingStages.plan_for(
            n_groups, 1 if rows_cfg or not guided else 2, latent_size, args.chunk_frames, times_list, refill
        )
        for mode in VARIANTS:
            lane_devs = [devices[0], devices[0]] if mode == "single-gpu-executor" else devices
            sched_mode = {"single-gpu-executor": "basic", "aggressive-1thread": "aggressive"}.get(mode, mode)
            threads = False if mode == "aggressive-1thread" else None
            split, table = choose_split(
                plan, sched_mode, times["block_ms"], times["embed_ms"], times["final_ms"], decode_ms=times["decode_ms"]
            )
            split_tables[f"{label} / {mode}"] = table
            place_model(pp_model, split, lane_devs)
            dec = decoder if mode == "single-gpu-executor" else pp_decoder

            def pipelined(profile=False):
                lanes = Lanes(lane_devs, profile=profile)
                stages = CausalStreamingStages(
                    pp_model,
                    lanes,
                    split,
                    groups,
                    latent_size,
                    times_list,
                    make_decoder=lambda: ChunkDecoder(dec, dec),
                    **kw,
                )
                return run_plan(stages, sched_mode, lanes, threads=threads)[0]

            t, outs = timed(pipelined, lane_devs, args.repeats)
            prof = pipelined(profile=True)
            diffs = [compare_stream(o, refs, args.chunks) for o in outs + [prof]]
            lanes_summary = prof.summary.get("lanes", {})
            row["modes"][mode] = dict(
                seconds=t,
                fps=video_frames / t,
                speedup=t_ref / t,
                split=split,
                max_abs_diff=max(diffs),
                runs_checked=len(diffs),
                busy=[lanes_summary.get(f"gpu{i}", {}).get("busy_fraction") for i in (0, 1)],
                idle_ms=[lanes_summary.get(f"gpu{i}", {}).get("idle_ms") for i in (0, 1)],
                ms_per_kind=prof.summary.get("ms_per_kind"),
            )
        one_gpu = min(t_ref, row["modes"]["single-gpu-executor"]["seconds"])
        row["best_two_gpu_vs_best_one_gpu"] = one_gpu / min(row["modes"][m]["seconds"] for m in VARIANTS[1:])
        rows.append(row)
        print_row(row)
    place_model(pp_model, n_blocks // 2 - 1, devices)
    bi_rows = bidirectional(
        args, cfg, model, pp_model, decoder, pp_decoder, devices, dtype, times, text_dim, pooled_dim
    )
    report = dict(
        date=datetime.date.today().isoformat(),
        device=device_name(devices),
        torch=torch.__version__,
        args=vars(args),
        stage_times=times,
        streaming=rows,
        bidirectional=bi_rows,
        split_tables=split_tables,
        skipped=skipped,
        wall_s=time.time() - started,
    )
    print_tables(rows, bi_rows, split_tables)
    ok = all(m["max_abs_diff"] == 0.0 for r in rows + bi_rows for m in r["modes"].values())
    if skipped:
        print(f"skipped (over --budget-s): {skipped}")
    print(f"\nall outputs bit-identical to one GPU: {ok}   (wall {report['wall_s']:.0f} s)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
        print(f"wrote {args.out}")
    return 0 if ok else 1


def bidirectional(args, cfg, model, pp_model, decoder, pp_decoder, devices, dtype, times, text_dim, pooled_dim):
    """Euler + CFG over a whole clip with the same weights (no causal mask): CFG branches x groups in flight."""
    dev0 = torch.device(devices[0])
    bi_cfg = dict(cfg, causal_chunk_frames=0)
    with torch.device(dev0):
        bi = MMDiT(**bi_cfg).to(dtype).eval().requires_grad_(False)
    bi.load_state_dict(model.state_dict())
    bi_pp = copy.deepcopy(bi)
    shape = (cfg["in_channels"], args.bi_frames, args.latent_hw, args.latent_hw)
    sched = timesteps_for_sampling(args.bi_steps, 1.0).tolist()
    scale = 5.0
    rows = []
    for n_groups in (1, 2):
        groups = [
            dict(
                seeds=[200 + g],
                branches=[
                    text_group(1, args.text_len, text_dim, pooled_dim, 10 + g, "cpu"),
                    text_group(1, args.text_len, text_dim, pooled_dim, 50, "cpu"),
                ],
            )
            for g in range(n_groups)
        ]
        video_frames = n_groups * args.bi_frames

        def reference():
            return [sample_microbatched(bi, g, shape, sched, scale, dev0, decoder) for g in groups]

        t_ref, ref_outs = timed(reference, [dev0], args.repeats)
        refs = ref_outs[0]

        def batched():  # the usual sampler: both CFG branches in one batch of 2
            outs = []
            for g in groups:
                x = seeded_latent_noise(g["seeds"], shape).to(dev0)
                b = [
                    {k: (v.to(dev0, dtype) if v is not None and k != "text_mask" else v) for k, v in br.items()}
                    for br in g["branches"]
                ]
                for k in range(len(sched) - 1):
                    t_vec = torch.full((2,), sched[k], device=dev0).to(dtype)
                    out = bi(
                        torch.cat([x, x]).to(dtype),
                        timestep=t_vec,
                        text_emb=torch.cat([b[0]["text_emb"], b[1]["text_emb"]]),
                        text_mask=None,
                        pooled=torch.cat([b[0]["pooled"], b[1]["pooled"]]),
                    ).float()
                    x = euler_step(x, text_cfg(*out.chunk(2), scale), sched[k], sched[k + 1])
                outs.append(x)
            return outs

        t_batched, batched_outs = timed(batched, [dev0], args.repeats)
        batched_diff = max(max_diff(a, r[0]) for a, r in zip(batched_outs[0], refs))
        row = dict(
            config=f"bidirectional {args.bi_steps} steps, CFG 2 branches, {n_groups} prompt(s)",
            items=2 * n_groups,
            one_gpu_s=t_ref,
            one_gpu_fps=video_frames / t_ref,
            batched_cfg_s=t_batched,
            batched_cfg_max_abs_diff_vs_microbatched=batched_diff,
            modes={},
        )
        plan = Plan(num_groups=n_groups, num_branches=2, num_chunks=1, num_steps=len(sched) - 1, cached=False)
        for mode in OVERLAP_MODES:
            split, _ = choose_split(
                plan, mode, times["block_ms"], times["embed_ms"], times["final_ms"], decode_ms=times["decode_ms"]
            )
            place_model(bi_pp, split, devices)

            def pipelined(profile=False):
                lanes = Lanes(devices, profile=profile)
                stages = BidirectionalStages(bi_pp, lanes, split, groups, shape, sched, scale, decode=pp_decoder)
                return run_plan(stages, mode, lanes)[0]

            t, outs = timed(pipelined, devices, args.repeats)
            prof = pipelined(profile=True)
            diffs = [
                max(
                    max(max_diff(o.latents[(g, 0)], refs[g][0].cpu()), max_diff(o.frames[(g, 0)], refs[g][1].cpu()))
                    for g in range(n_groups)
                )
                for o in outs + [prof]
            ]
            lanes_summary = prof.summary.get("lanes", {})
            row["modes"][mode] = dict(
                seconds=t,
                fps=video_frames / t,
                speedup=t_ref / t,
                split=split,
                max_abs_diff=max(diffs),
                runs_checked=len(diffs),
                busy=[lanes_summary.get(f"gpu{i}", {}).get("busy_fraction") for i in (0, 1)],
            )
        rows.append(row)
        print_row(row)
    return rows


def device_name(devices):
    if torch.device(devices[0]).type != "cuda":
        return "cpu"
    return f"{len(set(devices))}x {torch.cuda.get_device_name(torch.device(devices[0]))}"


def fmt_busy(busy):
    return "/".join("-" if b is None else f"{b:.2f}" for b in busy)


def print_row(row):
    parts = [f"{row['config']}: 1 GPU {row['one_gpu_fps']:.1f} fps"]
    for mode, m in row["modes"].items():
        parts.append(
            f"{mode} {m['fps']:.1f} fps ({m['speedup']:.2f}x, split {m['split']}, busy {fmt_busy(m['busy'])}, "
            f"diff {m['max_abs_diff']:g})"
        )
    print("; ".join(parts), flush=True)


def print_tables(rows, bi_rows, split_tables):
    modes = VARIANTS
    print(
        "\n| configuration | 1 GPU fps | "
        + " | ".join(f"{m} fps (x, busy GPU0/GPU1, split)" for m in modes)
        + " | best 2 GPUs / best 1 GPU | bit-identical |"
    )
    print("| --- " * (len(modes) + 4) + "|")
    for r in rows + bi_rows:
        cells = []
        for m in modes:
            if m in r["modes"]:
                v = r["modes"][m]
                cells.append(f"{v['fps']:.1f} ({v['speedup']:.2f}x, {fmt_busy(v['busy'])}, {v['split']})")
            else:
                cells.append("-")
        same = all(v["max_abs_diff"] == 0.0 for v in r["modes"].values())
        best = r.get("best_two_gpu_vs_best_one_gpu")
        print(
            f"| {r['config']} | {r['one_gpu_fps']:.1f} | "
            + " | ".join(cells)
            + f" | {'-' if best is None else f'{best:.2f}x'} | {'yes' if same else 'NO'} |"
        )
    for r in rows:
        if "max_abs_diff_vs_baseline_layout" in r:
            print(
                f"{r['config']}: bit-identical to one GPU running the same micro-batches; max |diff| vs the timed "
                f"baseline's rows-CFG layout {r['max_abs_diff_vs_baseline_layout']:g}"
            )
    for r in bi_rows:
        print(
            f"{r['config']}: batched-CFG 1-GPU sampler {r['batched_cfg_s'] * 1e3:.1f} ms vs micro-batched "
            f"{r['one_gpu_s'] * 1e3:.1f} ms; max |diff| batched vs micro-batched "
            f"{r['batched_cfg_max_abs_diff_vs_microbatched']:g}"
        )
    key = next((k for k in split_tables if "aggressive" in k), None)
    if key:
        print(
            f"\nhow auto chose the split for '{key}' (GPU0 = embed + blocks[0..split], GPU1 = the rest + final + "
            f"decode; simulated time of the whole plan per candidate):"
        )
        for c in split_tables[key]:
            print(
                f"  split {c['split']:2d}: stage0 {c['stage0_ms']:.2f} ms, stage1 {c['stage1_ms']:.2f} ms, per chunk "
                f"GPU0 {c['gpu0_ms_per_chunk']:.2f} / GPU1 {c['gpu1_ms_per_chunk']:.2f} ms, simulated "
                f"{c['simulated_ms']:.1f} ms"
            )


if __name__ == "__main__":
    sys.exit(main())
