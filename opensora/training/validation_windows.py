"""Validation of long clips: MovingShapes scores per window, so drift past the training length shows on the curve.

    validation = dict(every=500, prompts=[...], score="moving_shapes", long_frames=128, motion="wrap")

With ``long_frames`` set, every validation also samples each prompt at ``long_frames`` frames -- a causal network
streams them chunk by chunk through its rolling KV cache (``StreamingGenerator`` with the config's sampling keys
``window_frames``, ``sink_frames``, ``rollout``, ``context_time``, as ``scripts/diffusion/inference.py`` reads
them; where the config sets no ``window_frames``, the validation clip's latent frames minus one chunk, the window the
streaming benchmarks and ``benchmarks/long_streaming_quality.py`` judge: a cache that keeps every frame attends
further back than any training clip, which scored direction 0.58 where the judged window scored 1.00 on one H200
run), a bidirectional one samples the whole clip -- scores them per window of ``window_frames`` pixel frames
(default: the validation clip length) with ``opensora.eval.moving_shapes_windows`` under the ``motion`` rule, and logs
``val/{color,shape,direction,stats}_window_min`` (the worst window), ``val/*_vs_first_min`` (the worst window
over the first) and ``val/all_window_min`` (the lowest of the four window minima). The long samples go to
``samples/step-N/long/`` with their ``samples.csv``
(``tools/eval_moving_shapes.py CSV --window W --motion M`` re-scores them).

The long clips share validation's ``max_seconds``: a batch of them starts only while time is left, except the first,
so a validation with long clips lasts at most ``max_seconds`` plus one batch of each kind (size it accordingly: a
128-frame clip costs 8x a 16-frame one).
"""

import time
from pathlib import Path
from typing import Dict, List, Mapping

import torch

from opensora.config import ConfigValueError

ATTRIBUTES = ("color", "shape", "direction", "stats")
WINDOW_KINDS = ("window_min", "vs_first_min")  # val/{attribute}_{kind}


def long_clip_settings(s: dict) -> dict:
    """Check and resolve ``long_frames`` / ``window_frames`` of resolved validation settings ``s``."""
    if s["long_frames"] is None:
        return s
    if s["score"] != "moving_shapes":
        raise ConfigValueError('validation.long_frames needs validation.score="moving_shapes" (windows are scored)')
    s["window_frames"] = int(s["window_frames"] or s["num_frames"])
    s["long_frames"] = int(s["long_frames"])
    if not 2 <= s["window_frames"] <= s["long_frames"]:
        raise ConfigValueError(
            f"validation needs 2 <= window_frames <= long_frames, got {s['window_frames']} and {s['long_frames']}"
        )
    return s


def kv_window_frames(sampler, s: Mapping, cfg: Mapping, height: int, width: int) -> int:
    """The KV window a causal network streams its validation clips with (latent frames, sinks included): the
    config's ``window_frames``, else the validation clip's latent frames minus one chunk (the chunk being made then
    sees as many frames as the last chunk of a training clip)."""
    if cfg.get("window_frames") is not None:
        return int(cfg.get("window_frames"))
    latent_frames = sampler.latent_size(s["num_frames"], height, width)[0]
    return max(int(latent_frames) - int(sampler.model.causal_chunk_frames), 1)


def streaming_generator(sampler, s: Mapping, cfg: Mapping, height: int, width: int):
    """The ``StreamingGenerator`` validation samples a causal network with (clip-length and long clips alike: chunk
    by chunk, as the network is trained and used), or None for a bidirectional one."""
    if not getattr(sampler.model, "causal_chunk_frames", 0):
        return None
    from opensora.inference.streaming.generator import StreamingGenerator

    return StreamingGenerator(
        sampler,
        step_list=s["step_list"],
        num_steps=s["num_steps"],
        rollout=cfg.get("rollout") or "renoise",
        guidance_scale=s["guidance_scale"],
        window_frames=kv_window_frames(sampler, s, cfg, height, width),
        sink_frames=int(cfg.get("sink_frames") or 0),
        rope_anchor=cfg.get("rope_anchor") or "window",  # the sampling CLI's default
        context_time=float(cfg.get("context_time") or 0.0),
    )


def sample_long_clips(sampler, generator, s: Mapping, prompts, seeds, height: int, width: int, started: float):
    """uint8 ``[N, long_frames, H, W, 3]`` for the prompts (fewer when ``max_seconds`` runs out between batches),
    streamed through ``generator`` (``streaming_generator``'s) or, where it is None, sampled whole."""
    batch = int(s["batch_size"])
    if generator is not None:

        def generate(p, sd):
            return generator.generate(p, sd, s["long_frames"], height, width)
    else:

        def generate(p, sd):
            return sampler.generate(
                p,
                sd,
                num_frames=s["long_frames"],
                height=height,
                width=width,
                num_steps=s["num_steps"],
                step_list=s["step_list"],
                guidance_scale=s["guidance_scale"],
            )

    videos: List[torch.Tensor] = []
    for start in range(0, len(prompts), batch):
        if start and time.monotonic() - started > float(s["max_seconds"]):
            break
        videos.append(generate(list(prompts[start : start + batch]), list(seeds[start : start + batch])))
    return torch.cat(videos).numpy()


def long_clip_record(sampler, generator, s: Mapping, prompts, seeds, height, width, save_dir, started) -> Dict:
    """Sample (as ``sample_long_clips``), save and score the long clips; returns the ``val/*_window_min`` /
    ``val/*_vs_first_min`` record and writes ``save_dir/long/windows.json`` (every window's scores)."""
    import json

    from opensora.eval.moving_shapes_windows import score_windows
    from opensora.inference.io import save_samples

    videos = sample_long_clips(sampler, generator, s, prompts, seeds, height, width, started)
    prompts = list(prompts[: len(videos)])
    out = Path(save_dir) / "long"
    save_samples(out, prompts, videos, fps=s["fps"])
    report = score_windows(list(videos), prompts, s["window_frames"], motion=s["motion"])
    head = dict(long_frames=s["long_frames"], kv_window_frames=generator.window_frames if generator else None)
    (out / "windows.json").write_text(json.dumps(dict(head, **report), indent=1) + "\n")
    record = {}
    for name in ATTRIBUTES:
        for kind in WINDOW_KINDS:
            value = report[f"{name}_{kind}"]
            record[f"val/{name}_{kind}"] = float("nan") if value is None else float(value)
    # the worst attribute in the worst window: one number a best checkpoint can be chosen by (all are shares of clips)
    scored = [report[f"{name}_window_min"] for name in ATTRIBUTES if report[f"{name}_window_min"] is not None]
    record["val/all_window_min"] = float(min(scored)) if scored else float("nan")
    record["val/long_samples"] = len(videos)
    return record


__all__ = ["long_clip_settings", "kv_window_frames", "streaming_generator", "sample_long_clips", "long_clip_record"]
