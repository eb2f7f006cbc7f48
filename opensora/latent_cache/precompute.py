"""``scripts/diffusion/precompute.py``'s logic: encode a training config's dataset once into a latent cache.

``python scripts/diffusion/precompute.py CONFIG --outputs DIR`` (or ``torchrun --nproc_per_node N ...``). Samples are
cut into chunks of ``--samples-per-shard``; each rank takes every N-th unfinished chunk, decodes its clips in
DataLoader workers (the training dataset's ``load_sample``: same frames, resize and crop), encodes them with the
config's VAE and text conditioner (built as the trainer builds them), and hands the chunk to a writer thread, so
the encoders never wait for the disk. Layout and crash safety: ``opensora.latent_cache.store``. Rerunning the same
command continues where a killed run stopped; a rerun with another config, table or encoders is refused.
"""

import errno
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from tqdm import tqdm

from opensora.cli_errors import UserInputError, check_range
from opensora.config import load_config_from_cli
from opensora.datasets.dataset import BadSampleError, VideoTextDataset
from opensora.datasets.sampler import BucketBatchSampler
from opensora.dtypes import resolve_dtype
from opensora.registry import DATASETS, build_module
from opensora.training.components import build_text_encoder, build_vae
from opensora.training.defaults import TRAINER_DEFAULTS

from . import store
from .fingerprint import file_fingerprint, first_difference, module_record, plain_data, spec_record
from .plan import plan_clips

logger = logging.getLogger(__name__)

PRECOMPUTE_FLAGS = {
    "outputs": None,  # the cache directory (required on the command line)
    "epochs": 1,  # epochs of bucket / frame decisions to store (later epochs reuse them, cycling)
    "flip": False,  # also store each clip flipped left-right
    "samples_per_shard": 64,  # samples per chunk (one safetensors shard + one progress record)
    "encode_batch_size": 1,  # clips of one shape per VAE call
}


# ---------------------------------------------------------------------------------------------------- set-up


def _check_flags(argv, args) -> None:
    if not any(a == "--outputs" or a.startswith("--outputs=") for a in argv):
        raise UserInputError("--outputs DIR is required: the directory the cache is written to")
    check_range("epochs", args.epochs, 1, integer=True)
    check_range("samples_per_shard", args.samples_per_shard, 1, integer=True)
    check_range("encode_batch_size", args.encode_batch_size, 1, integer=True)
    if not isinstance(args.flip, bool):
        raise UserInputError(f"--flip takes no value or true/false, got {args.flip!r}")
    outputs = Path(str(args.outputs))
    if outputs.exists() and not outputs.is_dir():
        raise UserInputError(f"--outputs {outputs} is a file: give a directory for the cache")
    own = {store.LOCK_FILE}  # a run killed before writing its plan leaves only its lock file
    if outputs.is_dir() and set(os.listdir(outputs)) - own and not (outputs / store.PLAN_FILE).is_file():
        raise UserInputError(
            f"--outputs {outputs} holds files but no latent cache ({store.PLAN_FILE} missing): give a new or empty "
            "directory (nothing there is overwritten)"
        )


def _check_config(cfg) -> None:
    for name in ("dataset", "bucket_config", "vae", "text_encoder"):
        if not cfg.get(name):
            raise UserInputError(f"the config has no {name}: precompute encodes a training config's dataset")
    if cfg.dataset.get("type") in ("CachedLatentDataset", "SyntheticLatentDataset"):
        raise UserInputError(f"dataset type {cfg.dataset['type']} holds no videos to encode: use a video dataset")
    if cfg.vae.get("sample_posterior"):
        raise UserInputError(
            "vae.sample_posterior=True draws new latents every step; a cache stores one (the posterior mode): set "
            "--vae.sample_posterior false, or do not cache"
        )


def _make_plan_record(cfg, args, dataset, dtype, vae, text_encoder) -> dict:
    """Everything the stored features depend on; a rerun into the same directory must match it."""
    dataset_spec = {k: v for k, v in plain_data(cfg.dataset).items() if k != "data_path"}
    return dict(
        format=store.FORMAT_VERSION,
        table=file_fingerprint(dataset.data_path)["sha256"] if os.path.isfile(dataset.data_path) else None,
        dataset=dataset_spec,
        num_samples=len(dataset),
        bucket_config=plain_data(cfg.bucket_config),
        seed=int(cfg.get("seed", 0)),
        epochs=int(args.epochs),
        flip=bool(args.flip),
        samples_per_shard=int(args.samples_per_shard),
        components=dict(
            vae=dict(spec=spec_record(cfg.vae, dtype), module=module_record(vae, dtype)),
            text_encoder=dict(spec=spec_record(cfg.text_encoder, None), module=module_record(text_encoder)),
        ),
        text=dict(max_length=int(text_encoder.max_length), dim=int(text_encoder.text_dim)),
    )


def _start(root: Path, plan: dict, text_encoder) -> List[int]:
    """Rank 0: write or check the plan, clear temporaries of a killed run; returns the unfinished chunks."""
    plan_path = root / store.PLAN_FILE
    if plan_path.is_file():
        import json

        difference = first_difference(json.loads(plan_path.read_text()), plain_data(plan))
        if difference:
            raise UserInputError(
                f"{root} holds a cache of another run ({difference}); use a new --outputs directory, or the config "
                "and flags the cache was started with"
            )
    else:
        store.write_json_atomic(plan_path, plan)
    for leftover in root.rglob(".*.tmp"):  # half-written files of a killed run
        leftover.unlink(missing_ok=True)
    if not (root / store.NULL_TEXT_FILE).is_file():
        from safetensors.torch import save_file

        null = {k: v.detach().cpu().contiguous() for k, v in text_encoder.null_embeddings(1).items()}
        store.write_atomic(root / store.NULL_TEXT_FILE, lambda tmp: save_file(null, tmp))
    num_chunks = -(-plan["num_samples"] // plan["samples_per_shard"])
    done = store.completed_chunks(root)
    return [chunk for chunk in range(num_chunks) if chunk not in done]


# ---------------------------------------------------------------------------------------------------- the run


class _ClipSource(torch.utils.data.Dataset):
    """The clips of this rank's chunks in order, loaded by the training dataset: ``(position, video or reason)``."""

    def __init__(self, dataset, items):
        self.dataset, self.items = dataset, items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, position: int):
        _, clip = self.items[position]
        try:
            return position, self.dataset.load_sample(clip.key)
        except BadSampleError as error:
            return position, error.reason


class _ChunkWriter:
    """A thread that writes finished chunks (shard, then progress record) while the encoders go on."""

    def __init__(self, root: Path):
        self.root = root
        self.queue: "queue.Queue" = queue.Queue(maxsize=2)
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, name="chunk-writer", daemon=True)
        self.thread.start()

    def put(self, chunk: int, tensors: dict, metadata: dict, rows: list) -> None:
        self._raise()
        self.queue.put((chunk, tensors, metadata, rows))

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()
        self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        while True:
            job = self.queue.get()
            if job is None:
                return
            if self.error is not None:
                continue
            try:
                chunk, tensors, metadata, rows = job
                offsets = store.write_shard(self.root, chunk, tensors, metadata) if tensors else {}
                for row in rows:
                    row["shard"] = store.shard_relpath(chunk) if row["status"] == "ok" else ""
                    for name in ("latents", "text", "pooled"):
                        key = row.get(f"{name}_key")
                        row[f"{name}_offset"], row[f"{name}_nbytes"] = offsets.get(key, (-1, 0)) if key else (-1, 0)
                store.write_json_atomic(store.record_path(self.root, chunk), dict(chunk=chunk, rows=rows))
            except BaseException as error:  # noqa: BLE001 - reported to the main thread at its next put / close
                self.error = error


_EMPTY_ROW = dict(
    reason="",
    slots=[],
    resolution="",
    aspect=-1,
    num_frames=0,
    height=0,
    width=0,
    frame_indices=[],
    flip=False,
    fps=0.0,
    shard="",
    latents_key="",
    latent_shape=[],
    latents_dtype="",
    text_key="",
    pooled_key="",
    text_tokens=0,
    **{
        f"{name}_{field}": (-1 if field == "offset" else 0)
        for name in ("latents", "text", "pooled")
        for field in ("offset", "nbytes")
    },
)


def _sample_row(dataset, index: int) -> dict:
    return dict(
        sample=index,
        path=dataset.paths[index],
        text=dataset.texts[index],
        src_num_frames=int(dataset.num_frames[index]),
        src_height=int(dataset.heights[index]),
        src_width=int(dataset.widths[index]),
        frame_interval=int(dataset.frame_intervals[index]),
        is_image=bool(dataset.is_image[index]),
        src_fps=float(dataset.fps[index]),
    )


def _clip_row(dataset, clip, status: str, reason: str = "", flip: bool = False) -> dict:
    return dict(
        _sample_row(dataset, clip.sample),
        status=status,
        reason=reason,
        slots=list(clip.slots),
        resolution=clip.resolution,
        aspect=clip.aspect,
        num_frames=clip.shape[0],
        height=clip.shape[1],
        width=clip.shape[2],
        frame_indices=list(clip.frame_indices or []),
        flip=flip,
    )


class _Encoder:
    """Encodes clips (batched by shape) and a chunk's captions; collects the chunk's tensors and rows."""

    def __init__(self, dataset, vae, text_encoder, device, dtype, flip: bool, batch_size: int):
        self.dataset = dataset
        self.vae, self.text_encoder, self.device, self.dtype = vae, text_encoder, device, dtype
        self.flip, self.batch_size = flip, batch_size
        self.pending: list = []  # (clip, sample dict) of one shape
        self.tensors: Dict[str, torch.Tensor] = {}
        self.rows: list = []

    def add(self, clip, loaded) -> None:
        if isinstance(loaded, str):
            self.rows.append(_clip_row(self.dataset, clip, "bad", loaded))
            return
        if self.pending and self.pending[0][0].shape != clip.shape:
            self.flush()
        self.pending.append((clip, loaded))
        if len(self.pending) >= self.batch_size:
            self.flush()

    @torch.no_grad()
    def flush(self) -> None:
        if not self.pending:
            return
        video = torch.stack([loaded["video"] for _, loaded in self.pending]).to(self.device, self.dtype)
        variants = [(False, video)] + ([(True, video.flip(-1))] if self.flip else [])
        for flipped, pixels in variants:
            # Kept on the device until the chunk ends: a host copy here would wait for this batch's encode and
            # leave the GPU idle while the next batch is launched (one wait per chunk instead of one per batch).
            latents = self.vae.encode(pixels)
            for (clip, loaded), latent in zip(self.pending, latents):
                key = f"s{clip.sample}.e{clip.slots[0]}{'.flip' if flipped else ''}.latents"
                self.tensors[key] = latent.clone()
                row = _clip_row(self.dataset, clip, "ok", flip=flipped)
                row.update(fps=float(loaded["fps"]), latents_key=key, latent_shape=list(latent.shape))
                row["latents_dtype"] = str(latent.dtype)
                self.rows.append(row)
        self.pending = []

    def finish_chunk(self) -> tuple:
        """(tensors, rows) of the chunk: its clips' latents plus each sample's trimmed T5 features and pooled
        vector, encoded together for the chunk's captions."""
        self.flush()
        samples = sorted({row["sample"] for row in self.rows if row["status"] == "ok"})
        if samples:
            text = self.text_encoder.encode([self.dataset.texts[i] for i in samples])
            for position, index in enumerate(samples):
                mask = text["text_mask"][position].cpu()
                valid = int(mask.sum())
                if not bool(mask[:valid].all()):
                    raise ValueError("the text conditioner pads on the left: trimmed features would lose tokens")
                self.tensors[f"s{index}.text_emb"] = text["text_emb"][position, :valid].cpu().clone()
                self.tensors[f"s{index}.pooled"] = text["pooled"][position].cpu().clone()
        self.tensors = {key: value.cpu() for key, value in self.tensors.items()}
        for row in self.rows:
            if row["status"] == "ok":
                row.update(text_key=f"s{row['sample']}.text_emb", pooled_key=f"s{row['sample']}.pooled")
                row["text_tokens"] = int(self.tensors[row["text_key"]].shape[0])
        tensors, rows = self.tensors, self.rows
        self.tensors, self.rows = {}, []
        return tensors, rows


def _rank_world() -> tuple:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _broadcast(value, world: int):
    if world == 1:
        return value
    holder = [value]
    torch.distributed.broadcast_object_list(holder, src=0)
    return holder[0]


@dataclass
class _Job:
    """One rank's share of a precompute run and what it needs."""

    cfg: Any
    args: Any
    root: Path
    rank: int
    world: int
    device: torch.device
    dtype: torch.dtype
    dataset: Any = None
    vae: Any = None
    text_encoder: Any = None


def run(cfg, args) -> Optional[Path]:
    """Encode what is missing of the cache; rank 0 then writes the index. Returns the index path on rank 0."""
    rank, world = _rank_world()
    if world > 1 and not torch.distributed.is_initialized():
        from datetime import timedelta

        # control messages only (the work list, the final barrier): gloo on every device; ranks may finish their
        # chunks hours apart, hence the long timeout
        torch.distributed.init_process_group("gloo", timeout=timedelta(hours=48))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if torch.cuda.is_available() else None
    if device is not None:
        torch.cuda.set_device(device)
    dtype = resolve_dtype(cfg.get("precision", TRAINER_DEFAULTS["precision"]))
    job = _Job(cfg, args, Path(str(args.outputs)), rank, world, device or torch.device("cpu"), dtype)

    job.dataset = build_module(cfg.dataset, DATASETS)
    if not isinstance(job.dataset, VideoTextDataset):
        raise UserInputError(f"dataset type {type(job.dataset).__name__} is not a video dataset: nothing to encode")
    sampler = BucketBatchSampler(job.dataset, cfg.bucket_config, num_replicas=1, rank=0, seed=int(cfg.get("seed", 0)))
    job.vae = build_vae(cfg.vae, job.device, dtype)
    job.text_encoder = build_text_encoder(cfg.text_encoder, job.device)
    plan = _make_plan_record(cfg, args, job.dataset, dtype, job.vae, job.text_encoder) if rank == 0 else None
    lock, todo, message = None, None, None
    try:
        if rank == 0:
            job.root.mkdir(parents=True, exist_ok=True)
            lock = store.hold_lock(job.root)  # until this run ends (the OS drops it if the process dies)
            todo = _start(job.root, plan, job.text_encoder)
    except (UserInputError, BlockingIOError) as error:
        message = str(error)
    try:
        todo, message = _broadcast((todo, message), world)
        if message is not None:
            raise UserInputError(message)
        clips = plan_clips(job.dataset, sampler, int(args.epochs))
        _encode_chunks(job, clips, todo[rank::world])
        if world > 1:
            torch.distributed.barrier()
        return _write_index(job.root, plan, len(job.dataset)) if rank == 0 else None
    finally:
        if lock is not None:
            lock.close()


def _encode_chunks(job: _Job, clips, mine: List[int]) -> None:
    """Encode chunks ``mine``: clips decoded in DataLoader workers, written chunk by chunk from a thread."""
    per_shard = int(job.args.samples_per_shard)
    items = [
        (chunk, clip)
        for chunk in mine
        for plan_of_sample in clips[chunk * per_shard : (chunk + 1) * per_shard]
        for clip in plan_of_sample.clips
    ]
    dataset = job.dataset
    num_workers = int(job.cfg.get("num_workers", TRAINER_DEFAULTS["num_workers"]))
    loader = torch.utils.data.DataLoader(
        _ClipSource(dataset, items),
        batch_size=None,
        num_workers=num_workers,
        prefetch_factor=4 if num_workers else None,
    )
    encoder = _Encoder(
        dataset, job.vae, job.text_encoder, job.device, job.dtype, bool(job.args.flip), int(job.args.encode_batch_size)
    )
    writer = _ChunkWriter(job.root)
    bar = tqdm(total=len(items), unit="clip", desc=f"precompute (rank {job.rank})", disable=job.rank != 0)
    bad = 0
    pending_chunks = list(mine)

    def finish(chunk):
        tensors, rows = encoder.finish_chunk()
        stored = {row["sample"] for row in rows}
        for plan_of_sample in clips[chunk * per_shard : (chunk + 1) * per_shard]:
            if plan_of_sample.sample not in stored and not plan_of_sample.clips:
                rows.append(dict(_sample_row(dataset, plan_of_sample.sample), status="unbucketed", slots=[]))
        writer.put(chunk, tensors, {f"caption.s{r['sample']}": r["text"] for r in rows if r["status"] == "ok"}, rows)

    try:
        for position, loaded in loader:
            chunk, clip = items[position]
            while pending_chunks and pending_chunks[0] != chunk:  # chunks before it are complete (or empty)
                finish(pending_chunks.pop(0))
            if isinstance(loaded, str):
                bad += 1
                logger.warning("skipping bad sample %s: %s (%d bad so far)", dataset.paths[clip.sample], loaded, bad)
            encoder.add(clip, loaded)
            bar.update(1)
            bar.set_postfix(bad=bad, refresh=False)
        while pending_chunks:
            finish(pending_chunks.pop(0))
    finally:
        bar.close()
        writer.close()


def _write_index(root: Path, plan: dict, num_samples: int) -> Path:
    num_chunks = -(-num_samples // plan["samples_per_shard"])
    done = store.completed_chunks(root)
    missing = [chunk for chunk in range(num_chunks) if chunk not in done]
    if missing:
        raise RuntimeError(f"chunks {missing[:5]} of {root} are not finished; rerun the same command")
    # one type per column: rows of bad and unbucketed samples get the clip columns' empty values
    rows = [dict(_EMPTY_ROW, **row) for row in store.read_records(root, range(num_chunks))]
    seen = sorted({row["sample"] for row in rows})
    if seen != list(range(num_samples)):
        raise RuntimeError(f"{root}: the progress records cover {len(seen)} of {num_samples} samples")
    bad = [(row["path"], row["reason"]) for row in rows if row["status"] == "bad"]
    import pandas as pd

    bad_table = pd.DataFrame(bad, columns=["path", "reason"]).drop_duplicates()
    store.write_atomic(root / store.BAD_SAMPLES_FILE, lambda tmp: bad_table.to_csv(tmp, index=False))
    provenance = dict(plan, counts=dict(clips=sum(r["status"] == "ok" for r in rows), bad=len(bad)))
    path = store.write_index(root, rows, provenance)
    logger.info(
        "latent cache %s: %d stored clips of %d samples, %d bad (listed in %s)",
        root,
        provenance["counts"]["clips"],
        num_samples,
        len(bad_table),
        store.BAD_SAMPLES_FILE,
    )
    return path


def main(argv=None) -> None:
    cfg, args = load_config_from_cli(
        argv,
        script_flags=PRECOMPUTE_FLAGS,
        prog="precompute.py",
        description="Encode a training config's dataset once: latents and text features for CachedLatentDataset.",
    )
    _check_flags(list(argv or []), args)
    _check_config(cfg)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    started = time.monotonic()
    try:
        path = run(cfg, args)
    except OSError as error:
        if error.errno != errno.ENOSPC:
            raise
        raise UserInputError(
            f"no space left on the device of {args.outputs}: free some and rerun the same command (finished chunks "
            "are kept)"
        ) from None
    if path is not None:
        logger.info("done in %.1f s: %s", time.monotonic() - started, path)
