"""What ``inference.py --help`` says about its flags, and the defaults a training config gives them.

Sampling with a training or distillation config (``--ckpt outputs/run``) samples at the clip size the model was
trained on (the config's first bucket, ``opensora.datasets.buckets.first_bucket``) unless the config or the command
line sets ``resolution`` / ``num_frames``: a 24x24 demo model sampled at the generic 256x256 takes 14x as long and
shows nothing it learnt.
"""

from typing import Mapping

INFERENCE_HELP = {
    "ckpt": "checkpoint dir, .safetensors, a training run dir (its newest complete checkpoint), or RUN/best (the "
    "run's best checkpoint by its validation.best_metric)",
    "prompt": "a prompt; repeat --prompt for several (one --prompt with '|' is split there, for old scripts)",
    "prompt_file": ".txt (one prompt per line) or .csv with a text/prompt/caption column",
    "save_dir": "samples are added after those already there; --overwrite starts the directory over",
    "overwrite": "delete the samples earlier runs wrote to --save-dir and number from 0 again",
    "seed": "sample i uses seed + i; a config's own 'seed' key (a training config's) is the default",
    "num_frames": "a training config's default: its first bucket's frame count",
    "resolution": "'256px', '720p' or exact 'HxW'; a training config's default: its first bucket",
    "step_list": "explicit t values, e.g. 1.0,0.75,0.5,0.25 (replaces --num-steps)",
    "streaming": "causal models: chunk by chunk with a KV cache, each chunk appended to the mp4 as it is done",
    "window_frames": "--streaming: latent frames the KV cache keeps (sink frames included); default: every frame",
    "pp_decode_stream": "--pp-devices: side (each GPU decodes on a stream beside its passes) or compute (in front of them)",
    "pp_host_copies": "--pp-devices: shared (chunks go to the host on the GPU-to-GPU copy streams) or own (a stream "
    "of their own per GPU, so no hand-off waits for a decode; the default)",
    "sink_frames": "--streaming: the first latent frames, kept in the cache for good when the window rolls (attention "
    "sinks); multiples of the temporal patch, <= --window-frames",
    "kv_recache": "--streaming: off | shift: when the window rolls, re-run the kept frames' keys/values against the "
    "context they have now (one pass per recomputed chunk, in place of that refill)",
    "rope_anchor": "--streaming: window (default) | absolute: once the window rolls, put the text and sink frames at "
    "its start in RoPE time, so no query-key distance exceeds what a training clip has (absolute: the text at frame 0)",
    "prompt_schedule": "--streaming: one video whose prompt changes, e.g. '0:A;64:B' (pixel frames, each a chunk start;"
    " ';' separates entries); at each switch the window's keys/values are recomputed under the new prompt",
    "switch_renoise": "--prompt-schedule: re-render the kept window under the new prompt from time T at a prompt "
    "switch (context-time < T <= 1; best one of the --step-list times, which a distilled student was trained at), so "
    "later chunks do not copy the old prompt's look from their context (MovingShapes: T=1 made the new colour in 97% "
    "of streams within one window, with a cut at the switch; the re-cache alone, 3%)",
}


def training_clip_defaults(tree: Mapping) -> dict:
    """``resolution`` and ``num_frames`` of a config that trains on buckets (its first bucket), and ``fps`` when its
    dataset resamples clips to a ``target_fps``; {} otherwise."""
    from opensora.datasets.buckets import first_bucket

    buckets = tree.get("bucket_config")
    if not buckets:
        return {}
    resolution, num_frames = first_bucket(buckets)
    defaults = dict(resolution=resolution, num_frames=num_frames)
    dataset = tree.get("dataset")
    if isinstance(dataset, Mapping) and dataset.get("target_fps"):
        defaults["fps"] = dataset["target_fps"]  # the rate the model saw its clips at
    return defaults
