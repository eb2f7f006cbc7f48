"""Stage times for ``--pp-split auto``: per-block probe times of one forward (``measure_stage_times``, eager or
replayed as CUDA graphs) and timed whole stage passes of the causal stages (``measure_stage_passes``), which
split.py turns into the split. The probes run the model's own pieces (``embed``, ``run_block_range`` one block at a
time with the streaming ``kv_hook``s, ``final_tokens``)."""

from __future__ import annotations

import time
import warnings
from statistics import median
from typing import Callable, List, Mapping, Optional, Sequence

import torch

from opensora.models.mmdit.causal import streaming_kv_hooks
from opensora.models.mmdit.graph_memory import GraphMemory, on_capture_device

from ..streaming.chunk_graphs import ChunkGraphs
from .runtime import Lanes
from .stages import all_blocks, final_velocity
from .streaming_stages import CausalStreamingStages


class _Timer:
    """Marks on one device: CUDA events (no host sync until ``read``) or host clocks on the CPU."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.marks = []

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self.device))
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def read(self) -> List[float]:
        """Milliseconds between consecutive marks."""
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]


def _graph_replay_ms(body, device, repeats: int) -> float:
    """Median GPU time (ms) of one replay of ``body`` captured as a CUDA graph on ``device`` (events around every
    replay; the first replay is not counted). (tests/test_pipeline_parallel.py swaps this for an eager timer.)"""
    with on_capture_device(device):
        graph = GraphMemory().capture(body, device)
        stream = torch.cuda.current_stream(device)
        pairs = []
        for _ in range(repeats + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            graph.replay()
            end.record(stream)
            pairs.append((start, end))
        pairs[-1][1].synchronize()
    return median(a.elapsed_time(b) for a, b in pairs[1:])


@torch.no_grad()
def measure_stage_times(
    model,
    x: torch.Tensor,
    text: Mapping,
    decode: Optional[Callable] = None,
    repeats: int = 3,
    cuda_graphs: bool = False,
    past_frames: int = 0,
) -> dict:
    """Median time of the embedding, every block, the final layer and the decode of one forward of ``x`` (a chunk
    for a causal model, with the streaming mask; the whole clip otherwise) on the model's device.
    Feed the result to ``split.choose_split``.

    ``past_frames`` (causal models): the chunk attends to that many cached latent frames, as a chunk does once the
    rolling window is full. Pass the window the stages will hold: attention over the cache is a larger share of a
    single block than of a double block, so blocks timed at frame 0 put too much on the lane of the single blocks
    (2 H200s, 1B, split 10: GPU1 96% busy, GPU0 86%).

    Eager (default): what eager stages cost, launch time included (at a 1B streamed chunk the GPU waits for the
    host: a block's time is about its kernel count, not its work). ``cuda_graphs=True`` (a CUDA device only; eager
    elsewhere): the embedding, every block and the final layer each captured as a CUDA graph and timed by replays,
    i.e. what graphed stages (``CausalStreamingStages(cuda_graphs=...)``) cost; choose a graphed pipeline's split
    from these (``graphed`` in the result says which were taken: a failed capture falls back to the eager times).
    The decode is timed eagerly either way (the stages decode eagerly)."""
    if cuda_graphs and x.is_cuda and torch.cuda.is_available():
        try:
            return _graphed_stage_times(model, x, text, decode, repeats, past_frames)
        except Exception as error:  # noqa: BLE001  (a failed capture: the eager times, said so, not a crash)
            warnings.warn(f"graphed stage times failed, using eager ones: {error}")
            torch.cuda.synchronize(x.device)
    return _eager_stage_times(model, x, text, decode, repeats, past_frames)


@torch.no_grad()
def measure_stage_passes(
    model,
    devices: Sequence,
    split: int,
    group: Mapping,
    latent_size: Sequence[int],
    times: Sequence[float],
    past_frames: int,
    repeats: int = 4,
    cuda_graphs: bool = False,
    **stage_kw,
) -> dict:
    """Median time (ms) of one whole stage0 and one whole stage1 pass of ``CausalStreamingStages`` (the run's own
    pass code: its masks, caches, text cache, activation hand-over, and CUDA graphs when ``cuda_graphs``) with
    ``model`` placed at ``split`` on ``devices``, for the chunk after ``past_frames`` cached frames (the caches
    filled by running the earlier chunks' cache-writing passes eagerly). One warm-up pass per stage (the capture,
    when graphed), then ``repeats`` timed passes of the first denoising step (no cache write). ``group``: one
    prompt group as the stages take it; ``latent_size`` (C, T, H, W): the video's, only C, H, W are used;
    ``stage_kw``: the stages' sampler options (``refill``, ``rollout``, ``context_time``, ``window_frames``,
    ``cfg_rows``, ...). The result (``split``, ``stage0``, ``stage1``, ...) is what
    ``split.calibrated_split`` takes as ``measured``: per-block probes do not add up to a stage's pass."""
    lanes = Lanes(devices)
    chunk = int(model.causal_chunk_frames)
    size = (latent_size[0], int(past_frames) + chunk, *latent_size[2:])
    kw = dict(stage_kw, make_decoder=None, cuda_graphs=False)
    stages = CausalStreamingStages(model, lanes, split, [group], size, times, **kw)
    plan = stages.plan

    def forward(ctx, step: int, store: bool):
        with lanes.device_context(0):
            act = stages.stage0(ctx, 0, step, ctx["x"], store)
        with lanes.device_context(1):
            act = lanes.pull(act, lanes.event(0), 1)
            return act, stages.stage1(ctx, 0, step, act, store)

    for c in range(plan.num_chunks - 1):  # the caches (and the text cache: every pass time of chunk 0)
        ctx = stages.prepare(0, c)
        for step in range(plan.forwards(c)) if c == 0 else [plan.writer_step]:
            forward(ctx, step, plan.store_kv(step))
    if cuda_graphs:  # fill eagerly, capture only the timed passes (one graph per stage)
        stages.graphs = (ChunkGraphs(model), ChunkGraphs(model))
    ctx = stages.prepare(0, plan.num_chunks - 1)
    # warm-up; in a one-chunk video (nothing filled) the first pass fills the text cache, running the text rows
    # too, and the timed passes are the ones after it
    for _ in range(1 if plan.num_chunks > 1 else 2):
        act, _ = forward(ctx, 0, False)
    samples = []
    for lane in (0, 1):
        timer = _Timer(lanes.devices[lane])
        with lanes.device_context(lane):
            for _ in range(repeats):
                timer.mark()
                if lane == 0:
                    stages.stage0(ctx, 0, 0, ctx["x"], False)
                else:
                    stages.stage1(ctx, 0, 0, act, False)
                timer.mark()
        samples.append(timer.read()[::2])  # each pass's own span, not the gaps between them
    lanes.synchronize()
    graphs = None if stages.graphs is None else [runner.summary for runner in stages.graphs]
    return dict(
        split=split,
        stage0=median(samples[0]),
        stage1=median(samples[1]),
        stage0_samples=samples[0],
        stage1_samples=samples[1],
        past_frames=int(past_frames),
        cached_frames=stages.caches[0][0][0].num_frames,
        graphed=bool(graphs) and all(g["replays"] > 0 and g["eager"] == 0 for g in graphs),
        graphs=graphs,
    )


def typical_past_frames(total_frames: int, chunk_frames: int, window_frames: Optional[int] = None) -> int:
    """The cached latent frames a chunk of the video attends to on average (each chunk sees the frames before it,
    at most ``window_frames``): the ``past_frames`` at which to time stages for a split."""
    starts = range(0, int(total_frames), int(chunk_frames))
    seen = [s if window_frames is None else min(s, int(window_frames)) for s in starts]
    mean = sum(seen) / len(seen)
    return int(round(mean / chunk_frames)) * int(chunk_frames)  # whole chunks, as the cache holds them


def _stage_inputs(model, x, text):
    """(x, timestep, text_emb, pooled, text_mask) of a stage-time probe on ``x``'s device and the model's dtype."""
    device, dtype = x.device, model.img_in.weight.dtype
    text_emb, pooled = text["text_emb"].to(device, dtype), text["pooled"].to(device, dtype)
    text_mask = None if text.get("text_mask") is None else text["text_mask"].to(device)
    t = torch.full((x.shape[0],), 0.5, device=device).to(dtype)
    return x.to(dtype), t, text_emb, pooled, text_mask


def _probe_mask_hooks(model, text_mask, num_text: int, num_video: int, device, past=None):
    """The attention mask and kv hooks of a probe forward (a causal model: a chunk after the frames ``past``, a
    ``KVCache``, holds; none: at frame 0, nothing cached)."""
    if getattr(model, "causal_chunk_frames", 0):
        past = model.new_kv_cache() if past is None else past
        past_tokens = past.keys[0].shape[2] if past.keys[0] is not None else 0
        mask = model.chunk_mask(text_mask, num_text, num_video, past_tokens, device)
        return mask, streaming_kv_hooks(past, num_text, mask, None)
    return model.key_mask(text_mask, num_video), None


def _probe_past(model, x, t, text_emb, pooled, text_mask, past_frames: int):
    """A ``KVCache`` holding ``past_frames`` latent frames (copies of one probe chunk's keys/values; only their
    shapes matter for timing), or None for a bidirectional model or ``past_frames == 0``."""
    if not getattr(model, "causal_chunk_frames", 0) or past_frames <= 0:
        return None
    img, txt, vec, grid = model.embed(x, t, text_emb, pooled)
    rope = model.rope(grid, txt.shape[1], x.device)
    fresh = model.new_kv_cache()
    mask = model.chunk_mask(text_mask, txt.shape[1], img.shape[1], 0, x.device)
    pending = {}
    hooks = streaming_kv_hooks(fresh, txt.shape[1], mask, pending)
    model.run_block_range(dict(img=img, txt=txt), 0, len(all_blocks(model)), vec, rope, mask, hooks)
    chunk = x.shape[2]
    for start in range(0, past_frames, chunk):
        frames = min(chunk, past_frames - start)
        tokens = pending[0][0].shape[2] * frames // chunk
        fresh.append(
            {i: (k[:, :, :tokens], v[:, :, :tokens]) for i, (k, v) in pending.items()},
            start,
            frames,
            frames_per_group=model.patch_size[0],
        )
    return fresh


def _graphed_stage_times(model, x, text, decode, repeats: int, past_frames: int = 0) -> dict:
    device = x.device
    x, t, text_emb, pooled, text_mask = _stage_inputs(model, x, text)
    n = len(all_blocks(model))
    past = _probe_past(model, x, t, text_emb, pooled, text_mask, past_frames)
    img, txt, vec, grid = model.embed(x, t, text_emb, pooled)
    rope = model.rope(grid, txt.shape[1], device, time_offset=_probe_offset(model, past))
    mask, hooks = _probe_mask_hooks(model, text_mask, txt.shape[1], img.shape[1], device, past)
    states = [dict(img=img, txt=txt)]  # the input of every block (eager), each block then timed on its own input
    for i in range(n):
        states.append(_one_block(model, states[-1], i, vec, rope, mask, hooks))
    embed_ms = _graph_replay_ms(lambda: model.embed(x, t, text_emb, pooled), device, repeats)
    block_ms = [
        _graph_replay_ms(lambda i=i: _one_block(model, states[i], i, vec, rope, mask, hooks), device, repeats)
        for i in range(n)
    ]
    final_ms = _graph_replay_ms(lambda: final_velocity(model, dict(states[n]), vec, grid), device, repeats)
    decode_ms = 0.0
    if decode is not None:
        out = final_velocity(model, dict(states[n]), vec, grid).float()
        decode_ms = _eager_ms(lambda: decode(out), device, repeats)
    return dict(embed_ms=embed_ms, block_ms=block_ms, final_ms=final_ms, decode_ms=decode_ms, graphed=True)


def _eager_ms(fn, device, repeats: int) -> float:
    """Median eager time (ms) of ``fn`` over ``repeats`` runs after a warm-up run."""
    samples = []
    for _ in range(repeats + 1):
        timer = _Timer(device)
        timer.mark()
        fn()
        timer.mark()
        samples.append(timer.read()[0])
    return median(samples[1:])


def _probe_offset(model, past) -> int:
    """RoPE time offset (in time patches) of the probe chunk: right after the frames ``past`` holds."""
    return 0 if past is None else past.end_frame // model.patch_size[0]


def _eager_stage_times(model, x, text, decode, repeats: int, past_frames: int = 0) -> dict:
    device = x.device
    x, t, text_emb, pooled, text_mask = _stage_inputs(model, x, text)
    n = len(all_blocks(model))
    past = _probe_past(model, x, t, text_emb, pooled, text_mask, past_frames)
    samples = []
    for _ in range(repeats + 1):  # the first run warms up kernels and allocator
        timer = _Timer(device)
        timer.mark()
        img, txt, vec, grid = model.embed(x, t, text_emb, pooled)
        rope = model.rope(grid, txt.shape[1], device, time_offset=_probe_offset(model, past))
        mask, hooks = _probe_mask_hooks(model, text_mask, txt.shape[1], img.shape[1], device, past)
        timer.mark()
        state = dict(img=img, txt=txt)
        for i in range(n):
            state = _one_block(model, state, i, vec, rope, mask, hooks)
            timer.mark()
        out = final_velocity(model, state, vec, grid)
        timer.mark()
        if decode is not None:
            decode(out.float())
        timer.mark()
        samples.append(timer.read())
    samples = samples[1:]
    med = [median(s[i] for s in samples) for i in range(len(samples[0]))]
    return dict(embed_ms=med[0], block_ms=med[1 : 1 + n], final_ms=med[1 + n], decode_ms=med[2 + n], graphed=False)


def _one_block(model, state: dict, i: int, vec, rope, mask, hooks) -> dict:
    """Block ``i`` alone on (a copy of) ``state``, with its kv_hook when the probe has hooks."""
    return model.run_block_range(dict(state), i, i + 1, vec, rope, mask, None if hooks is None else hooks[i : i + 1])
