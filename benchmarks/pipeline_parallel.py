"""Two-GPU pipeline overlap (opensora/inference/pipeline_parallel/schedule.py) vs one GPU, at the 1B MMDiT shape.

Default (``--decoder real``): the real-size HunyuanVideo VAE with the exact-once chunk decode, one-GPU vs two-GPU
end to end at 480x832 and 256x256 x 33 frames (``benchmarks/pipeline_real_vae.py``; ``--quick``: 256x256 only).

  python -m benchmarks.pipeline_parallel --out DIR                  # 2 GPUs, real VAE, ~3-4 min per decode stream
  python -m benchmarks.pipeline_parallel --sizes 480x832 --decode-streams side,compute --out DIR   # decode A/B
  python -m benchmarks.pipeline_parallel --sizes 480x832 --decode-streams side --host-copies shared,own --out DIR
  python -m benchmarks.pipeline_parallel --decoder stand-in --out DIR

``--decoder stand-in`` (every row named "(stand-in decoder)"), streaming: a causal 1B MMDiT (8 double + 16 single blocks, 1536 wide, random weights) generates ``--chunks`` chunks
of ``--chunk-frames`` latent frames at 256px (32x32x16 latents, 256 tokens per frame) with ``--text-len`` text
tokens, each chunk decoded by a stand-in decoder (3D convs, 8x up in space, one frame per latent frame; the GPU
image has no diffusers VAE) on the last GPU. For every (steps per chunk 1 | 4) x (refill on | off) x (1 | 2 items
in flight) (x ``--batches`` samples per item) it times

* ``1gpu-eager``: one GPU, the streaming sampler of ``--streaming`` (``StreamingGenerator``; without refill, which
  it cannot do, the same per-chunk functions in a plain loop, ``stream_reference``);
* ``1gpu-graphs``: the same with every pass a CUDA graph (``StreamingGenerator(cuda_graphs=True)``; without refill
  the pipeline executor with both stages on cuda:0 and graphed stages): the fair one-GPU baseline;
* ``off`` / ``basic`` / ``aggressive``: two GPUs, ``--pp-overlap`` mode, each stage's pass a CUDA graph
  (``ChunkGraphs.stage``), every task issued from one host thread with events only, ``--pp-split auto`` (``off``
  from the per-block stage times measured on a warm-up chunk; ``basic`` and ``aggressive`` from those rescaled to
  the per-pass GPU times of ``off``'s profiled run, ``calibrated_split``, which also give them their issue order;
  the candidates of each plan are in the JSON); per row also the split the CLI's ``--pp-split auto`` picks
  (``pipeline_cli.auto_split``: the same calibration on a few timed graphed passes instead of a profiled run);
* ``aggressive-eager-threads``: two GPUs, eager passes issued by one host thread per GPU (the previous design).

Every timed run (and a profiled one, which gives the per-GPU busy fraction from CUDA events per task) is compared
with the one-GPU references: ``diff_eager`` = max |diff| over every chunk's latents and decoded frames vs
``1gpu-eager`` (the StreamingGenerator itself when refill is on), ``diff_graphs`` vs ``1gpu-graphs``. Eager
pipelines must give diff_eager 0; graphed ones diff_graphs 0 (a captured kernel may round unlike its eager twin,
so graphed vs eager is reported, not required). Then the bidirectional multi-step sampler (Euler + CFG, the same
weights without the causal mask, ``--bi-frames`` latent frames) with the same block split and the CFG branches x
prompt groups as the items in flight, bit-identical to one GPU running the same micro-batches.

  python -m benchmarks.pipeline_parallel --decoder stand-in --out DIR   # 2 GPUs, <= ~7 min
  python -m benchmarks.pipeline_parallel --tiny --out DIR               # CPU smoke test (stand-in decoder)

Timing: ``--repeats`` timed runs after one warm-up run per configuration (graph captures happen there), the
median reported; frames/s counts decoded frames of all items (the stand-in decoder makes one frame per latent
frame: with a 4x temporal VAE the video frames/s would be 4x the number printed, the ratios unchanged).
"""

import argparse
import copy
import cProfile
import datetime
import itertools
import json
import pstats
import statistics
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from opensora.diffusion.guidance import text_cfg  # noqa: E402
from opensora.diffusion.sampling import euler_step, timesteps_for_sampling  # noqa: E402
from opensora.inference.io import uint8_frames_on_device  # noqa: E402
from opensora.inference.pipeline_parallel.cli import auto_split  # noqa: E402
from opensora.inference.pipeline_parallel.runtime import HOST_COPY_MODES, Lanes, run_plan  # noqa: E402
from opensora.inference.pipeline_parallel.schedule import (  # noqa: E402
    DECODE_STREAM_MODES,
    DEFAULT_CONTENTION,
    OVERLAP_MODES,
    Plan,
)
from opensora.inference.pipeline_parallel.split import calibrated_split, choose_split, measured_task_ms  # noqa: E402
from opensora.inference.pipeline_parallel.stage_times import measure_stage_times, typical_past_frames  # noqa: E402
from opensora.inference.pipeline_parallel.stages import (  # noqa: E402
    BidirectionalStages,
    place_model,
    sample_microbatched,
    seeded_latent_noise,
)
from opensora.inference.pipeline_parallel.streaming_stages import CausalStreamingStages  # noqa: E402
from opensora.inference.streaming.chunk_graphs import ChunkGraphs  # noqa: E402
from opensora.inference.streaming.generator import ChunkDecoder, StreamingGenerator  # noqa: E402
from opensora.models.mmdit.configs import mmdit_config  # noqa: E402
from opensora.models.mmdit.model import MMDiT  # noqa: E402
from tests.streaming_reference import stream_reference  # noqa: E402

STEP_LISTS = {1: [1.0], 4: [1.0, 0.75, 0.5, 0.25]}
ONE_GPU = ("1gpu-eager", "1gpu-graphs")
# 2 GPUs: each overlap mode with graphed stages from one host thread; aggressive eager with a host thread per GPU
TWO_GPU = OVERLAP_MODES + ("aggressive-eager-threads",)
VARIANTS = ONE_GPU + TWO_GPU


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
    def decode(self, latent):
        """Latent -> float video [B, 3, T, H, W] in [-1, 1], the autoencoder API the streaming generator calls."""
        return self.net(latent.to(self.net[0].weight.dtype)).float().tanh()

    @torch.no_grad()
    def forward(self, latent):
        return uint8_frames_on_device(self.decode(latent))


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


def paired_speedup(one_gpu, two_gpu, devices, pairs: int) -> dict:
    """One-GPU and two-GPU runs alternated ``pairs`` times (after one warm run each): the median of the per-pair
    ratios, which the host's drift between separate medians (20% between calls) does not bias."""
    one, two = [], []
    for fn in (one_gpu, two_gpu):
        fn()
    for _ in range(pairs):
        for fn, out in ((one_gpu, one), (two_gpu, two)):
            sync(devices)
            t0 = time.perf_counter()
            fn()
            sync(devices)
            out.append(time.perf_counter() - t0)
    ratios = sorted(a / b for a, b in zip(one, two))
    return dict(
        pairs=pairs,
        one_gpu_s=one,
        two_gpu_s=two,
        speedup_median=statistics.median(ratios),
        speedup_min=ratios[0],
        speedup_max=ratios[-1],
    )


def host_profile(fn, devices, top: int = 25) -> list:
    """Where one run's host time goes (cProfile, the ``top`` functions by own time): the graphed pipeline is
    issued by one host thread, so its wall time is the host's whenever that thread is the bottleneck."""
    profiler = cProfile.Profile()
    sync(devices)
    profiler.enable()
    fn()
    sync(devices)
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [
        dict(fn=f"{Path(f).name}:{line}:{name}", calls=nc, own_ms=round(tt * 1e3, 2), cum_ms=round(ct * 1e3, 2))
        for (f, line, name), (_, nc, tt, ct, _) in rows
    ]


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
    parser.add_argument("--out", default=None, help="output directory (pipeline_parallel.json and .txt)")
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
    parser.add_argument("--batches", default="1", help="samples per group (one micro-batch)")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=360.0,
        help="skip the remaining configurations (bidirectional included) once the run has taken this long",
    )
    parser.add_argument(
        "--paired",
        type=int,
        default=5,
        help="per graphed 2-GPU mode, this many alternated 1-GPU / 2-GPU runs (median ratio); 0: off",
    )
    parser.add_argument(
        "--host-profile", action="store_true", help="one more run per 2-GPU mode under cProfile (top functions)"
    )
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny model, both stages on the CPU")
    parser.add_argument(
        "--decoder",
        choices=("real", "stand-in"),
        default="real",
        help="real (default): the real-size HunyuanVideo VAE with the exact-once decode, one-GPU vs two-GPU end to "
        "end per --sizes (benchmarks/pipeline_real_vae.py); stand-in: the sweep of this module's docstring with the "
        "3D-conv stand-in decoder (rows named '(stand-in decoder)')",
    )
    parser.add_argument("--sizes", default="480x832,256x256", help="real decoder: HxW per row")
    parser.add_argument("--frames", type=int, default=33, help="real decoder: pixel frames per video")
    parser.add_argument("--videos", type=int, default=2, help="real decoder: videos in flight")
    parser.add_argument(
        "--window-frames",
        default="train",
        help="real decoder: the KV cache's rolling window in latent frames: train (default: the training clip's "
        "latent frames minus a chunk, as benchmarks/streaming.py), none (keep every frame) or a number",
    )
    parser.add_argument("--config", default=None, help="real decoder: the student's config (1B synthetic)")
    parser.add_argument("--quick", action="store_true", help="real decoder: 256x256 only, 1 repeat")
    parser.add_argument(
        "--decode-streams",
        default=",".join(DECODE_STREAM_MODES),
        help="where each GPU decodes (Plan.decode_stream): real decoder: one 2-GPU variant per entry, each with its "
        "own --pp-split auto plan, timed and compared (A/B); stand-in: the first entry for every 2-GPU run",
    )
    parser.add_argument(
        "--contention",
        type=float,
        default=DEFAULT_CONTENTION,
        help="real decoder: the simulator's slow-down of two overlapping streams of one GPU (schedule.simulate) for "
        "the plans (the stand-in sweep keeps the default)",
    )
    parser.add_argument(
        "--host-copies",
        default="own",
        help="the stream each GPU copies the chunks' frames and latents to the host on (Lanes' host_copies): shared "
        "(its peer-copy stream) or own; real decoder: one 2-GPU variant per entry and --decode-streams entry; "
        "stand-in: the first entry for every 2-GPU run",
    )
    args = parser.parse_args(argv)
    for name, modes in (("decode_streams", DECODE_STREAM_MODES), ("host_copies", HOST_COPY_MODES)):
        entries = [d.strip() for d in getattr(args, name).split(",") if d.strip()]
        bad = [d for d in entries if d not in modes]
        if bad or not entries:
            parser.error(f"--{name.replace('_', '-')} takes entries of {modes}, got {bad or 'none'}")
        setattr(args, name, entries)
    if args.decoder == "real" and not args.tiny:
        return real_decoder_main(args)
    stand_in_stream, stand_in_host_copies = args.decode_streams[0], args.host_copies[0]
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
    past = typical_past_frames(args.chunks * args.chunk_frames, args.chunk_frames)  # no rolling window here
    times = measure_stage_times(model, x_warm, bench.features("warm-up", 1), decode=decoder, past_frames=past)
    # graphed stages cost what their kernels cost, eager ones what their launches cost: the split of a graphed
    # pipeline is chosen from graphed stage times (eager ones put too few blocks on GPU0 at this shape)
    graph_times = measure_stage_times(
        model, x_warm, bench.features("warm-up", 1), decode=decoder, cuda_graphs=True, past_frames=past
    )
    for st in (times, graph_times):  # "graphed" only where every capture worked (else its eager times again)
        say(
            f"stage times, {'graphed' if st['graphed'] else 'eager'} (ms, one chunk after {past} cached frames): embed {st['embed_ms']:.2f}, blocks "
            f"{sum(st['block_ms']):.2f} ({n_blocks}: {', '.join(f'{b:.2f}' for b in st['block_ms'])}), final "
            f"{st['final_ms']:.2f}, decode {st['decode_ms']:.2f}"
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
            f"{batch}" + (", CFG as 2 micro-batches" if guided and not rows_cfg else "") + " (stand-in decoder)"
        )
        if time.time() - started > args.budget_s:
            skipped.append(label)
            continue
        prompts = prompt_groups(n_groups, batch)
        seeds = [[100 + 10 * g + i for i in range(batch)] for g in range(n_groups)]
        gen = StreamingGenerator(bench, step_list=STEP_LISTS[steps], guidance_scale=conf["guidance"])
        times_list = gen.schedule(latent_size[1:])
        groups = []
        for p, sd in zip(prompts, seeds):
            text, null = bench.encode_text(p)
            groups.append(dict(seeds=sd, branches=[text, null] if guided else [text]))
        kw = dict(refill=refill, rollout="renoise", guidance_scale=conf["guidance"], cfg_rows=rows_cfg)
        video_frames = n_groups * batch * lat_frames
        # the generator can run only the refill rows in their rows-CFG layout; the others use the plain loop
        exact_generator = refill and (rows_cfg or not guided)
        plan = CausalStreamingStages.plan_for(
            n_groups,
            1 if rows_cfg or not guided else 2,
            latent_size,
            args.chunk_frames,
            times_list,
            refill,
            decode_stream=stand_in_stream,
        )
        row = dict(
            config=label,
            baseline="StreamingGenerator" if exact_generator else "stream_reference loop",
            **conf,
            modes={},
        )

        def generator_run(graphed_gen):  # the one-GPU streaming sampler (--streaming), one stream per item
            outs = []
            for p, sd in zip(prompts, seeds):
                chunks = list(graphed_gen.stream(p, sd, lat_frames, px, px))
                outs.append(([c.latents for c in chunks], [c.frames for c in chunks]))
            return outs

        def loop_run():  # the same per-chunk functions on one GPU for the variants the generator lacks
            return [
                stream_reference(
                    model,
                    g,
                    latent_size,
                    times_list,
                    device=dev0,
                    make_decoder=lambda *_: ChunkDecoder(decoder, decoder),
                    **kw,
                )
                for g in groups
            ]

        def pipeline_run(lane_devs, split, sched_mode, graphs, threads, profile=False, net=None, costs=None):
            dec = decoder if lane_devs[1] == devices[0] else pp_decoder
            lanes = Lanes(lane_devs, profile=profile, host_copies=stand_in_host_copies)
            stages = CausalStreamingStages(
                pp_model if net is None else net,
                lanes,
                split,
                groups,
                latent_size,
                times_list,
                make_decoder=lambda *_: ChunkDecoder(dec, dec),
                cuda_graphs=graphs,
                decode_stream=stand_in_stream,
                **kw,
            )
            result = run_plan(stages, sched_mode, lanes, costs=costs, threads=threads)[0]
            return result

        def as_lists(result):
            return [
                (
                    [result.latents[(g, c)] for c in range(args.chunks)],
                    [result.frames[(g, c)] for c in range(args.chunks)],
                )
                for g in range(n_groups)
            ]

        # 1 GPU, eager: the reference every eager pipeline must equal bit for bit
        t_eager, eager_outs = timed(lambda: generator_run(gen) if exact_generator else loop_run(), [dev0], args.repeats)
        ref_eager = eager_outs[0]
        row["modes"]["1gpu-eager"] = dict(
            seconds=t_eager,
            fps=video_frames / t_eager,
            diff_eager=max(compare_stream_lists(o, ref_eager) for o in eager_outs),
            runs_checked=len(eager_outs),
        )
        # 1 GPU with CUDA graphs: the fair baseline (the generator's graphs, or the executor's on one GPU)
        split1, _ = choose_split(
            plan, "basic", times["block_ms"], times["embed_ms"], times["final_ms"], decode_ms=times["decode_ms"]
        )
        if exact_generator:
            graphed_gen = StreamingGenerator(
                bench, step_list=STEP_LISTS[steps], guidance_scale=conf["guidance"], cuda_graphs=True
            )
            t_graphs, graph_outs = timed(lambda: generator_run(graphed_gen), [dev0], args.repeats)
            one_gpu_graphs = dict(generator=graphed_gen.cuda_graphs.summary)
            one_gpu_again = (lambda gen_=graphed_gen: generator_run(gen_)) if args.paired else None
            del graphed_gen
        else:
            place_model(pp_model, split1, [devices[0], devices[0]])
            runners = (ChunkGraphs(pp_model), ChunkGraphs(pp_model))
            run1 = lambda: as_lists(pipeline_run([devices[0]] * 2, split1, "off", runners, False))  # noqa: E731
            t_graphs, graph_outs = timed(run1, [dev0], args.repeats)
            one_gpu_graphs = dict(executor=[r.summary for r in runners], split=split1)
            runners = None
            one_gpu_again = None
            if args.paired:  # the same executor on the other model copy, whose blocks stay put on GPU0
                runners_1 = (ChunkGraphs(model), ChunkGraphs(model))
                one_gpu_again = lambda: pipeline_run(  # noqa: E731
                    [devices[0]] * 2, split1, "off", runners_1, False, net=model
                )
        ref_graphs = graph_outs[0]
        row["modes"]["1gpu-graphs"] = dict(
            seconds=t_graphs,
            fps=video_frames / t_graphs,
            diff_eager=max(compare_stream_lists(o, ref_eager) for o in graph_outs),
            diff_graphs=max(compare_stream_lists(o, ref_graphs) for o in graph_outs),
            runs_checked=len(graph_outs),
            graphs=one_gpu_graphs,
        )
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        measured = None  # per-task GPU times of the profiled graphed `off` run (no overlap) and its split
        for mode in TWO_GPU:
            graphed = mode != "aggressive-eager-threads"
            sched_mode = "aggressive" if mode == "aggressive-eager-threads" else mode
            st = graph_times if graphed else times
            costs, calibration = None, None
            if graphed and measured is not None:
                # the split and the issue order from what `off`'s passes measured: per-block graphed probes do
                # not add up to a stage's pass (2 H200s: the double blocks' probes ran ~21% long), see
                # pipeline_parallel.calibrated_split (what the CLI's --pp-split auto runs, on timed passes)
                split, table, details = calibrated_split(plan, sched_mode, st, len(model.double_blocks), measured)
                costs = details["costs"]
                calibration = dict(
                    measured_ms_per_task=measured, probe_split=details["probe_split"], block_ms=details["block_ms"]
                )
            else:
                split, table = choose_split(
                    plan, sched_mode, st["block_ms"], st["embed_ms"], st["final_ms"], decode_ms=st["decode_ms"]
                )
            split_tables[f"{label} / {mode}"] = table
            place_model(pp_model, split, devices)
            runners = (ChunkGraphs(pp_model), ChunkGraphs(pp_model)) if graphed else None
            threads = False if graphed else None

            def pipelined(profile=False):
                return pipeline_run(devices, split, sched_mode, runners, threads, profile, costs=costs)

            t, outs = timed(pipelined, devices, args.repeats)
            prof = pipelined(profile=True)
            host_top = host_profile(pipelined, devices) if args.host_profile else None
            paired = None
            if one_gpu_again is not None and graphed:
                paired = paired_speedup(one_gpu_again, pipelined, devices, args.paired)
            runs = [as_lists(o) for o in outs + [prof]]
            lanes_summary = prof.summary.get("lanes", {})
            row["modes"][mode] = dict(
                seconds=t,
                fps=video_frames / t,
                speedup_vs_1gpu_graphs=t_graphs / t,
                speedup_vs_1gpu_eager=t_eager / t,
                split=split,
                diff_eager=max(compare_stream_lists(o, ref_eager) for o in runs),
                diff_graphs=max(compare_stream_lists(o, ref_graphs) for o in runs),
                runs_checked=len(runs),
                busy=[lanes_summary.get(f"gpu{i}", {}).get("busy_fraction") for i in (0, 1)],
                idle_ms=[lanes_summary.get(f"gpu{i}", {}).get("idle_ms") for i in (0, 1)],
                host_issue_ms=prof.summary.get("host_issue_ms"),
                ms_per_kind=prof.summary.get("ms_per_kind"),
                graphs=None if runners is None else [r.summary for r in runners],
                host_profile=host_top,
                paired=paired,
                calibration=calibration,
            )
            if mode == "off" and graphed and prof.summary.get("ms_per_kind"):
                measured = dict(measured_task_ms(plan, prof.summary["ms_per_kind"]), split=split)
                say(
                    f"  {label}: GPU ms per task in the profiled off run (split {split}): "
                    + ", ".join(f"{k} {v:.3f}" for k, v in measured.items() if k != "split")
                    + "; basic / aggressive take their split and issue order from these"
                )
            runners = None
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
        # what the CLI's --pp-split auto picks for this plan: the same code (pipeline_cli.auto_split: probe, a few
        # timed graphed passes at the probe split, calibrated_split) instead of a profiled `off` run
        place_model(pp_model, n_blocks - 2, [devices[0]] * 2)  # the CLI probes with the whole model on GPU0
        stage_kw = dict(
            kw, cuda_graphs=True, make_decoder=lambda *_: ChunkDecoder(decoder, decoder), decode_stream=stand_in_stream
        )
        cli_split, cli = auto_split(
            pp_model, devices, "aggressive", groups, latent_size, times_list, stage_kw, gen, stage_kw["make_decoder"]
        )
        passes = cli["calibration"]["measured"]
        row["cli_auto"] = dict(split=cli_split, probe_split=cli["probe_split"], passes=passes)
        say(
            f"  {label}: the CLI's --pp-split auto: timed {'graphed' if passes['graphed'] else 'eager'} passes at the "
            f"probe split {cli['probe_split']}: stage0 {passes['stage0']:.3f}, stage1 {passes['stage1']:.3f} ms -> "
            f"split {cli_split}"
        )
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        best_one = min(row["modes"][m]["seconds"] for m in ONE_GPU)
        row["best_two_gpu_vs_best_one_gpu"] = best_one / min(row["modes"][m]["seconds"] for m in TWO_GPU)
        rows.append(row)
        print_row(row)
    place_model(pp_model, n_blocks // 2 - 1, devices)
    bi_rows = []
    if time.time() - started > args.budget_s:
        skipped.append("bidirectional")
    else:
        bi_rows = bidirectional(
            args, cfg, model, pp_model, decoder, pp_decoder, devices, dtype, times, text_dim, pooled_dim
        )
    report = dict(
        date=datetime.date.today().isoformat(),
        device=device_name(devices),
        torch=torch.__version__,
        args=vars(args),
        stage_times=times,
        stage_times_graphed=graph_times,
        streaming=rows,
        bidirectional=bi_rows,
        split_tables=split_tables,
        skipped=skipped,
        wall_s=time.time() - started,
    )
    print_tables(rows, bi_rows, split_tables)
    ok = all(row_ok(r) for r in rows + bi_rows)
    if skipped:
        say(f"skipped (over --budget-s): {skipped}")
    say(f"\nall outputs bit-identical to their one-GPU references: {ok}   (wall {report['wall_s']:.0f} s)")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "pipeline_parallel.json").write_text(json.dumps(report, indent=1, default=str))
        (out / "pipeline_parallel.txt").write_text("\n".join(LOG) + "\n")
        print(f"wrote {out / 'pipeline_parallel.json'} and {out / 'pipeline_parallel.txt'}")
    return 0 if ok else 1


def real_decoder_main(args) -> int:
    """``--decoder real``: benchmarks/pipeline_real_vae.py's rows, written as pipeline_parallel.{json,txt}."""
    from benchmarks.pipeline_real_vae import run_real_vae

    args.sizes = [tuple(int(v) for v in s.split("x")) for s in ("256x256" if args.quick else args.sizes).split(",")]
    args.groups = args.videos
    if args.quick:
        args.repeats = 1
    report = run_real_vae(args, say)
    report.update(date=datetime.date.today().isoformat(), torch=torch.__version__, args=vars(args))
    ok = bool(report["rows"]) and all(r["bit_identical"] for r in report["rows"])
    say(f"\nall outputs bit-identical to the one-GPU run: {ok}   (wall {report['wall_s']:.0f} s)")
    if report["skipped"]:
        say(f"skipped (over --budget-s): {report['skipped']}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "pipeline_parallel.json").write_text(json.dumps(report, indent=1, default=str))
        (out / "pipeline_parallel.txt").write_text("\n".join(LOG) + "\n")
        print(f"wrote {out / 'pipeline_parallel.json'} and {out / 'pipeline_parallel.txt'}")
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
                lanes = Lanes(devices, profile=profile, host_copies=args.host_copies[0])
                stages = BidirectionalStages(bi_pp, lanes, split, groups, shape, sched, scale, decode=pp_decoder)
                return run_plan(stages, mode, lanes)[0]

            t, outs = timed(pipelined, devices, args.repeats)
            prof = pipelined(profile=True)
            host_top = host_profile(pipelined, devices) if args.host_profile else None
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
                host_profile=host_top,
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


LOG: list = []


def say(line=""):
    """Print and keep the line for the text report."""
    print(line, flush=True)
    LOG.append(line)


def print_row(row):
    parts = [f"{row['config']}:"]
    for mode, m in row["modes"].items():
        extra = []
        if "speedup_vs_1gpu_graphs" in m:
            extra.append(f"{m['speedup_vs_1gpu_graphs']:.2f}x of 1gpu-graphs")
        if "split" in m:
            probe = (m.get("calibration") or {}).get("probe_split")
            extra.append(f"split {m['split']}" + ("" if probe is None else f" (calibrated; probe: {probe})"))
        if "busy" in m:
            extra.append(f"busy {fmt_busy(m['busy'])}")
        if "diff_eager" in m:
            extra.append(f"diff_eager {m['diff_eager']:g}")
        if "diff_graphs" in m:
            extra.append(f"diff_graphs {m['diff_graphs']:g}")
        if m.get("paired"):
            pr = m["paired"]
            extra.append(
                f"paired {pr['pairs']}x: {pr['speedup_median']:.2f}x ({pr['speedup_min']:.2f}-{pr['speedup_max']:.2f})"
            )
        if isinstance(m.get("graphs"), list):  # per lane: graphed / eager passes (eager = a capture failed)
            extra.append("replays/eager " + " ".join(f"{g['replays']}/{g['eager']}" for g in m["graphs"]))
        parts.append(f"{mode} {m['fps']:.1f} fps ({', '.join(extra)})")
    say(" ".join(parts))


def print_tables(rows, bi_rows, split_tables):
    say(
        "\n| configuration | "
        + " | ".join(f"{m} fps" for m in ONE_GPU)
        + " | "
        + " | ".join(f"{m} fps (x of 1gpu-graphs, busy GPU0/GPU1, split)" for m in TWO_GPU)
        + " | best 2 GPUs / best 1 GPU | paired with 1gpu-graphs: basic / aggressive (median, min-max) | bit-identical |"
    )
    say("| --- " * (len(VARIANTS) + 4) + "|")
    for r in rows:
        cells = [f"{r['modes'][m]['fps']:.1f}" if m in r["modes"] else "-" for m in ONE_GPU]
        for m in TWO_GPU:
            v = r["modes"].get(m)
            cells.append(
                "-"
                if v is None
                else f"{v['fps']:.1f} ({v['speedup_vs_1gpu_graphs']:.2f}x, {fmt_busy(v['busy'])}, {v['split']})"
            )
        best = r.get("best_two_gpu_vs_best_one_gpu")
        paired = [r["modes"].get(m, {}).get("paired") for m in ("basic", "aggressive")]
        paired_cell = " / ".join(
            "-" if p is None else f"{p['speedup_median']:.2f}x ({p['speedup_min']:.2f}-{p['speedup_max']:.2f})"
            for p in paired
        )
        say(
            f"| {r['config']} | "
            + " | ".join(cells)
            + f" | {'-' if best is None else f'{best:.2f}x'} | {paired_cell} | {'yes' if row_ok(r) else 'NO'} |"
        )
    say(
        "(bit-identical: every eager run equals 1gpu-eager (the StreamingGenerator for the refill rows) and every "
        "graphed 2-GPU run equals 1gpu-graphs, max |diff| 0 over every chunk's latents and frames; graphed vs eager: "
        + ", ".join(f"{r['config']}: {max(r['modes'][m].get('diff_eager', 0.0) for m in r['modes']):g}" for r in rows)
        + ")"
    )
    for r in bi_rows:
        cells = ", ".join(
            f"{m} {v['fps']:.1f} fps ({v['speedup']:.2f}x, busy {fmt_busy(v['busy'])}, split {v['split']}, "
            f"diff {v['max_abs_diff']:g})"
            for m, v in r["modes"].items()
        )
        say(
            f"{r['config']}: 1 GPU micro-batched {r['one_gpu_fps']:.1f} fps (batched-CFG sampler "
            f"{r['batched_cfg_s'] * 1e3:.1f} ms vs micro-batched {r['one_gpu_s'] * 1e3:.1f} ms, max |diff| "
            f"{r['batched_cfg_max_abs_diff_vs_microbatched']:g}); {cells}"
        )
    key = next((k for k in split_tables if k.endswith("/ aggressive")), None)
    if key:
        say(
            f"\nhow auto chose the split for '{key}' (GPU0 = embed + blocks[0..split], GPU1 = the rest + final + "
            f"decode; simulated time of the whole plan per candidate):"
        )
        for c in split_tables[key]:
            say(
                f"  split {c['split']:2d}: stage0 {c['stage0_ms']:.2f} ms, stage1 {c['stage1_ms']:.2f} ms, per chunk "
                f"GPU0 {c['gpu0_ms_per_chunk']:.2f} / GPU1 {c['gpu1_ms_per_chunk']:.2f} ms, simulated "
                f"{c['simulated_ms']:.1f} ms"
            )


def graphs_fell_back(m) -> bool:
    """Whether a capture of a graphed variant failed (that shape then runs eagerly): not a graphed timing."""
    summaries = m.get("graphs")
    if isinstance(summaries, dict):
        summaries = [v for v in summaries.values() if isinstance(v, dict)] + list(summaries.get("executor", []))
    return any(g.get("failures") for g in summaries or [])


def row_ok(row) -> bool:
    """Eager runs equal the eager 1-GPU reference; graphed 2-GPU runs equal the graphed 1-GPU baseline, and no
    graphed variant fell back to eager passes (eager passes can equal the graphed ones bit for bit, so a run whose
    stage-1 captures all failed would otherwise pass unnoticed)."""
    for mode, m in row["modes"].items():
        if graphs_fell_back(m):
            return False
        if "max_abs_diff" in m:  # bidirectional
            if m["max_abs_diff"] != 0.0:
                return False
        elif mode in ("1gpu-eager", "aggressive-eager-threads"):
            if m["diff_eager"] != 0.0:
                return False
        elif m.get("diff_graphs", 0.0) != 0.0:
            return False
    return True


if __name__ == "__main__":
    sys.exit(main())
