"""The sampling CLI's settings, one dataclass per feature, each the one owner of its defaults and checks.

* ``SamplingOptions``: the sampler's schedule, guidance, condition and output size (every run);
* ``StreamingOptions``: chunk-by-chunk generation with a causal model (``--streaming``);
* ``PipelineOptions``: the two-GPU pipeline of a streamed run (``--pp-devices``);
* ``CacheOptions``: the Jano region cache of the bidirectional sampler (``--jano``; its tunables are
  ``cache.config.JanoConfig``'s, whose defaults they take).

A field's name is its flag and config key (``--window-frames`` sets ``window_frames``) and the name the code below
the CLI uses for it. ``flags()`` gives the CLI its keys and defaults; ``from_args`` reads the parsed namespace once,
in ``cli.main``: nothing below the CLI sees the namespace. ``check`` raises a one-line ``UserInputError`` naming the
flag. Plain data: importing this module loads no torch (``--help`` stays fast).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import List, Optional

from opensora.cli_errors import UserInputError, check_range

from .cache.config import STORE_KINDS, JanoConfig, tunable_defaults
from .pipeline_parallel.schedule import DECODE_STREAM_MODES, HOST_COPY_MODES, OVERLAP_MODES
from .reference_check import check_reference
from .streaming import KV_RECACHE, ROLLOUTS, ROPE_ANCHORS
from .streaming.prompt_schedule import parse_prompt_schedule

GRAPH_CHOICES = ("auto", "on", "off")  # --cuda-graphs / --stream-graphs: auto = on a CUDA device


def parse_graphs(value, flag: str) -> str:
    """A graphs flag as one of ``GRAPH_CHOICES``, or a one-line error naming the choices."""
    choice = str(value).lower()
    if choice not in GRAPH_CHOICES:
        raise UserInputError(f"{flag} must be one of {', '.join(GRAPH_CHOICES)}, got {value!r}")
    return choice


def parse_step_list(value) -> Optional[List[float]]:
    """``--step-list`` as floats: a list/tuple (``1.0,0.5`` parses to one), a single number, or None."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, str):
        value = value.replace(",", " ").split()
    try:
        return [float(t) for t in value]
    except (TypeError, ValueError):
        raise UserInputError(f"--step-list {value!r}: give times like 1.0,0.75,0.5,0.25") from None


class _Options:
    """``flags()`` and ``from_args`` for a dataclass whose fields are flags."""

    @classmethod
    def flags(cls) -> dict:
        return {f.name: f.default_factory() if callable(f.default_factory) else f.default for f in fields(cls)}

    @classmethod
    def from_args(cls, args) -> "_Options":
        options = cls(**{f.name: getattr(args, f.name) for f in fields(cls)})
        options.check()
        return options

    def check(self) -> None:
        """Range and choice checks (one-line errors naming the flag)."""


@dataclass
class SamplingOptions(_Options):
    num_steps: int = 30
    step_list: Optional[List[float]] = None  # explicit t values (e.g. "1.0,0.75,0.5,0.25"); replaces num_steps
    seed: int = 0  # sample i uses seed + i
    num_frames: int = 16
    resolution: str = "256px"  # bucket-style name: "256px", "720p" or an exact "HxW"
    aspect_ratio: str = "1:1"  # height:width, for area resolutions
    fps: float = 8
    batch_size: int = 1
    guidance_scale: float = 7.5  # text CFG scale w_txt
    image_guidance_scale: float = 3.0  # image CFG scale w_img (reference conditions only; 1 = 2 passes)
    cond_type: str = "t2v"  # t2v | i2v_head | i2v_tail | i2v_loop | v2v_head | v2v_tail
    ref: Optional[str] = None  # reference image (i2v_*) or video (v2v_*)
    # the bidirectional sampler: replay each step's model pass as a CUDA graph (pass_graphs.py); auto = on a GPU
    # (1B, 256px, 30 steps x CFG on an H100: 0.95 s graphed vs 1.11-1.46 s eager; equal at 480p, where it is GPU-bound)
    cuda_graphs: str = "auto"  # auto | on | off

    def check(self) -> None:
        from opensora.diffusion.conditions import CONDITION_TYPES

        check_range("num_steps", self.num_steps, 1, integer=True)
        check_range("seed", self.seed, 0, 2**32 - 1, integer=True)
        check_range("batch_size", self.batch_size, 1, integer=True)
        check_range("num_frames", self.num_frames, 1, integer=True)
        check_range("fps", self.fps, 0.001)
        check_range("guidance_scale", self.guidance_scale, 0)
        check_range("image_guidance_scale", self.image_guidance_scale, 0)
        if self.cond_type not in CONDITION_TYPES:
            raise UserInputError(f"--cond-type {self.cond_type!r} is not one of {', '.join(CONDITION_TYPES)}")
        if self.ref is not None and not Path(str(self.ref)).is_file():
            raise UserInputError(f"--ref {self.ref}: no such file")
        self.step_list = parse_step_list(self.step_list)
        self.cuda_graphs = parse_graphs(self.cuda_graphs, "--cuda-graphs")
        self.num_steps, self.seed, self.num_frames = int(self.num_steps), int(self.seed), int(self.num_frames)
        self.batch_size, self.fps = int(self.batch_size), float(self.fps)
        self.guidance_scale, self.image_guidance_scale = float(self.guidance_scale), float(self.image_guidance_scale)

    def steps_record(self) -> dict:
        """``num_steps`` / ``step_list`` as a sample's sidecar records them."""
        if self.step_list is not None:
            steps = len(self.step_list) - 1 if self.step_list[-1] == 0.0 else len(self.step_list)
            return dict(num_steps=steps, step_list=list(self.step_list))
        return dict(num_steps=self.num_steps, step_list=None)


@dataclass
class StreamingOptions(_Options):
    """Chunk by chunk with a KV cache (causal models), each chunk appended to the mp4 as it finishes."""

    streaming: bool = False
    window_frames: Optional[int] = None  # latent frames the KV cache keeps (sinks included); None: all (memory grows)
    sink_frames: int = 0  # first latent frames kept for good when the window rolls
    rollout: str = "renoise"  # renoise (x0 + fresh noise at the next time, Self-Forcing) | euler
    context_time: float = 0.0  # time at which a finished chunk re-runs to fill the cache
    # replay each chunk pass (each pipeline stage) as a CUDA graph; auto = on a GPU
    stream_graphs: str = "auto"  # auto | on | off
    # off | shift: when the window rolls, re-run the kept frames against their current context (streaming/recache.py)
    kv_recache: str = "off"
    # absolute | window: once the window rolls, the text and sink frames sit at its start in RoPE time (KVCache);
    # window by default: it kept a Self-Forcing student's direction at 8x its clip, where absolute lost it
    # (benchmarks/reports/long_streaming_h200_2026-11.md); on one GPU and in the --pp-devices pipeline alike
    rope_anchor: str = "window"
    prompt_schedule: Optional[str] = None  # "0:A;64:B": one video whose prompt changes at those pixel frames
    # at a prompt switch, re-render the kept window under the new prompt from this time (streaming/recache.py)
    switch_renoise: Optional[float] = None

    def schedule(self) -> Optional[list]:
        """``--prompt-schedule`` parsed: ``[(0, A), (64, B), ...]`` (pixel frames), or None."""
        return None if self.prompt_schedule is None else parse_prompt_schedule(self.prompt_schedule)

    def check(self) -> None:
        check_range("window_frames", self.window_frames, 1, integer=True, allow_none=True)
        check_range("sink_frames", self.sink_frames, 0, integer=True)
        check_range("context_time", self.context_time, 0.0)
        if self.context_time >= 1:
            raise UserInputError(f"--context-time must be < 1 (1 is pure noise), got {self.context_time!r}")
        if self.rollout not in ROLLOUTS:
            raise UserInputError(f"--rollout {self.rollout!r} is not one of {', '.join(ROLLOUTS)}")
        self.stream_graphs = parse_graphs(self.stream_graphs, "--stream-graphs")
        if self.kv_recache not in KV_RECACHE:
            raise UserInputError(f"--kv-recache {self.kv_recache!r} is not one of {', '.join(KV_RECACHE)}")
        if self.rope_anchor not in ROPE_ANCHORS:
            raise UserInputError(f"--rope-anchor {self.rope_anchor!r} is not one of {', '.join(ROPE_ANCHORS)}")
        self.schedule()  # a one-line error for a malformed schedule, before anything loads
        if self.switch_renoise is not None:
            try:
                self.switch_renoise = float(self.switch_renoise)
            except (TypeError, ValueError):
                raise UserInputError(f"--switch-renoise must be a time, got {self.switch_renoise!r}") from None
            if not float(self.context_time) < self.switch_renoise <= 1.0:
                raise UserInputError(
                    f"--switch-renoise must lie in (--context-time {float(self.context_time)}, 1], "
                    f"got {self.switch_renoise}"
                )
            if self.prompt_schedule is None:
                raise UserInputError("--switch-renoise re-renders at a prompt switch: add --prompt-schedule")
        self.window_frames = None if self.window_frames is None else int(self.window_frames)
        self.sink_frames, self.context_time = int(self.sink_frames), float(self.context_time)

    def graphs_on(self, device) -> bool:
        """``--stream-graphs`` for a sampler on ``device``: auto = on a CUDA device (a chunk's passes at ~1k tokens are
        launch-bound eager; graphed they ran 2.2x faster at the 1B shape), never off a GPU."""
        return self.stream_graphs != "off" and str(device).startswith("cuda")

    def generator_kwargs(self, sampling: SamplingOptions, device) -> dict:
        """``StreamingGenerator`` keyword arguments for a sampler on ``device``."""
        return dict(
            cuda_graphs=self.graphs_on(device),
            step_list=sampling.step_list,
            num_steps=sampling.num_steps,
            rollout=self.rollout,
            guidance_scale=sampling.guidance_scale,
            window_frames=self.window_frames,
            sink_frames=self.sink_frames,
            context_time=self.context_time,
            kv_recache=self.kv_recache,
            rope_anchor=self.rope_anchor,
            switch_renoise=self.switch_renoise,
        )

    def record(self) -> dict:
        record = dict(window_frames=self.window_frames, sink_frames=self.sink_frames, rollout=self.rollout)
        if self.kv_recache != "off":
            record["kv_recache"] = self.kv_recache
        if self.rope_anchor != "absolute":
            record["rope_anchor"] = self.rope_anchor
        if self.prompt_schedule is not None:
            record["prompt_schedule"] = [list(entry) for entry in self.schedule()]
        if self.switch_renoise is not None:
            record["switch_renoise"] = self.switch_renoise
        return record


@dataclass
class PipelineOptions(_Options):
    """The two-GPU pipeline of a streamed run (``pipeline_parallel``)."""

    pp_devices: Optional[str] = None  # "cuda:0,cuda:1": two-GPU pipeline overlap of --streaming
    pp_overlap: str = "aggressive"  # off | basic | aggressive
    pp_split: str = "auto"  # auto | N: index of the last block on the first GPU
    pp_decode_stream: str = "side"  # side: each GPU decodes on a stream beside its passes | compute: in front of them
    # own: the chunks' copies to the host on a stream of their own per GPU | shared: on the copy streams the
    # GPU-to-GPU hand-offs use, where each hand-off then waits for the last decode (1.38-1.80x vs 1.85x, 2x H200)
    pp_host_copies: str = "own"
    pp_cfg_rows: bool = (
        True  # CFG passes as rows of one batch (bit-identical to one GPU's streaming); False: micro-batches
    )
    stream_refill: bool = (
        True  # refill the cache at --context-time (the streaming sampler); False: the last step stores
    )
    profile: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.pp_devices)

    def devices(self) -> List[str]:
        value = self.pp_devices
        items = value.split(",") if isinstance(value, str) else value  # "cuda:0,cuda:1", or a parsed 0,1 -> (0, 1)
        devices = [str(d).strip() for d in items if str(d).strip()]
        if len(devices) != 2:
            raise UserInputError(f"--pp-devices needs exactly two devices (e.g. cuda:0,cuda:1), got {value!r}")
        return devices

    def check(self) -> None:
        if self.pp_overlap not in OVERLAP_MODES:
            raise UserInputError(f"--pp-overlap must be one of {OVERLAP_MODES}, got {self.pp_overlap!r}")
        if self.pp_decode_stream not in DECODE_STREAM_MODES:
            raise UserInputError(
                f"--pp-decode-stream must be one of {DECODE_STREAM_MODES}, got {self.pp_decode_stream!r}"
            )
        if self.pp_host_copies not in HOST_COPY_MODES:
            raise UserInputError(f"--pp-host-copies must be one of {HOST_COPY_MODES}, got {self.pp_host_copies!r}")
        if self.enabled:
            self.devices()


@dataclass
class CacheOptions(_Options):
    """The Jano region cache of the bidirectional sampler."""

    jano: bool = False  # Jano region-aware caching (cache/jano.py); settings under jano_settings
    jano_offload: bool = False  # with --jano: keep its caches in pinned CPU memory, prefetched on a side stream
    jano_graphs: bool = False  # with --jano: replay each step level as CUDA graphs (GPU only; region_graphs.py)
    # JanoConfig's tunables with its defaults; override one with e.g. --jano-settings.warmup_steps 4
    jano_settings: dict = field(default_factory=tunable_defaults)

    @property
    def enabled(self) -> bool:
        return bool(self.jano or self.jano_offload or self.jano_graphs)

    def jano_config(self) -> JanoConfig:
        store = STORE_KINDS[1] if self.jano_offload else STORE_KINDS[0]
        return JanoConfig(**dict(self.jano_settings or {}), store=store, graphs=bool(self.jano_graphs))

    def check(self) -> None:
        unknown = sorted(set(self.jano_settings or {}) - set(tunable_defaults()))
        if unknown:
            raise UserInputError(
                f"--jano-settings.{unknown[0]} is not a Jano setting; choose from {', '.join(tunable_defaults())}"
            )
        try:
            self.jano_config()
        except (TypeError, ValueError) as error:
            raise UserInputError(f"--jano-settings: {error}") from None


@dataclass
class RunOptions(_Options):
    """What to sample from, where to run it and where the samples go."""

    ckpt: Optional[str] = (
        None  # checkpoint directory (step-XXXXXXX), a training outputs dir (newest checkpoint) or a .safetensors
    )
    role: str = "model"  # which network of the checkpoint (a distilled checkpoint names its generator's role)
    ema: bool = True  # --no-ema: the raw (non-EMA) weights
    prompt: Optional[str] = None  # one prompt; repeat --prompt for several (a single one is split at '|')
    prompt_file: Optional[str] = None  # .txt (one per line) or .csv with a 'text' column
    save_dir: str = "samples"
    overwrite: bool = False  # start --save-dir over instead of adding after its earlier samples (save_dir.py)
    verify_checkpoint: bool = False  # check every file's checksum against the checkpoint's manifest (sizes: always)
    dtype: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16 | fp16
    device: str = "auto"
    offload: bool = False  # keep text encoder and autoencoder on the CPU except while they run
    progress: bool = True
    # under torchrun: split each video's tokens over groups of this many ranks (must divide the world size); the
    # groups share the prompts (data parallel), each group's rank 0 writes
    sequence_parallel_size: int = 1

    def check(self) -> None:
        save_dir = Path(str(self.save_dir))
        if save_dir.exists() and not save_dir.is_dir():
            raise UserInputError(f"--save-dir {save_dir} is a file; give a directory (it is created if missing)")
        check_range("sequence_parallel_size", self.sequence_parallel_size, 1, integer=True)
        self.sequence_parallel_size = int(self.sequence_parallel_size)


FEATURES = dict(
    run=RunOptions, sampling=SamplingOptions, streaming=StreamingOptions, pipeline=PipelineOptions, cache=CacheOptions
)


@dataclass
class InferenceOptions:
    """Every feature's options of one sampling run, checked alone and together (``from_args``)."""

    run: RunOptions
    sampling: SamplingOptions
    streaming: StreamingOptions
    pipeline: PipelineOptions
    cache: CacheOptions
    config: str = ""  # the config file's path

    @staticmethod
    def flags() -> dict:
        """Every flag (config key) of the sampling CLI with its default."""
        return {name: default for options in FEATURES.values() for name, default in options.flags().items()}

    @classmethod
    def from_args(cls, args) -> "InferenceOptions":
        options = cls(**{name: kind.from_args(args) for name, kind in FEATURES.items()}, config=str(args.config))
        options.check()
        return options

    def check(self) -> None:
        """The checks across features (each feature checked its own flags)."""
        if self.run.sequence_parallel_size > 1:
            others = [
                flag
                for flag, on in (
                    ("--jano", self.cache.enabled),
                    ("--streaming", self.streaming.streaming),
                    ("--pp-devices", self.pipeline.enabled),
                )
                if on
            ]
            if others:
                raise UserInputError(
                    f"--sequence-parallel-size > 1 does not combine with {' / '.join(others)}: pick one"
                )
        if self.streaming.streaming and self.cache.enabled:
            raise UserInputError(
                "--jano caches a bidirectional sampler's steps; --streaming has its own KV cache: pick one"
            )
        if self.streaming.streaming and (self.sampling.cond_type != "t2v" or self.sampling.ref is not None):
            raise UserInputError("--streaming generates text-to-video only (no --cond-type / --ref)")
        if self.pipeline.enabled and not self.streaming.streaming:
            raise UserInputError("--pp-devices drives the streaming sampler: add --streaming")
        stream = self.streaming
        if stream.prompt_schedule is not None:
            if not stream.streaming:
                raise UserInputError("--prompt-schedule changes the prompt of a streamed video: add --streaming")
            if self.run.prompt is not None or self.run.prompt_file is not None:
                raise UserInputError("--prompt-schedule gives the prompts itself: drop --prompt / --prompt-file")
        if self.pipeline.enabled and (stream.kv_recache != "off" or stream.prompt_schedule is not None):
            raise UserInputError(
                "--kv-recache / --prompt-schedule run on one GPU; the --pp-devices pipeline has neither"
            )
        check_reference(self.sampling.cond_type, self.sampling.ref)  # the reference decodes and is used
