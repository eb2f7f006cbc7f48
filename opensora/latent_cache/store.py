"""On-disk layout of a latent cache, and the atomic writes that make it safe to kill and to read while it grows.

::

    DIR/plan.json                      what is being cached (table, buckets, encoders); written once, checked on rerun
    DIR/null_text.safetensors          the empty prompt's text features (classifier-free guidance dropout)
    DIR/shards/chunk-NNNNNN.safetensors  one chunk of samples: latents, trimmed T5 features, pooled vectors;
                                        captions in the header's metadata
    DIR/progress/chunk-NNNNNN.json     the chunk's rows (written after its shard: its presence means "done")
    DIR/index.parquet                  one row per stored clip (and per bad or unbucketed sample); written last
    DIR/bad_samples.csv                path, reason of every sample that could not be decoded

Every file is written to a temporary name in its own directory, flushed to disk, then renamed over its final name
(``os.replace`` is atomic on one filesystem). A chunk counts as done only when its progress record exists, and the
record is renamed into place after the shard, so a process killed at any point leaves either a finished chunk or
one that the next run redoes from scratch; no sample is ever half written or written twice. The index is
assembled from the records after every chunk is done and renamed into place, so a reader sees the previous index
or the complete new one, never a partial one.
"""

import json
import os
import struct
import tempfile
from pathlib import Path
from typing import Dict, Iterable, Mapping, Tuple

import pandas as pd

FORMAT_VERSION = 1
PLAN_FILE = "plan.json"
INDEX_FILE = "index.parquet"
NULL_TEXT_FILE = "null_text.safetensors"
BAD_SAMPLES_FILE = "bad_samples.csv"
LOCK_FILE = ".lock"
SHARD_DIR = "shards"
RECORD_DIR = "progress"
# parquet schema metadata key holding the cache's provenance (JSON)
PROVENANCE_KEY = b"opensora_latent_cache"


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some filesystems do not open directories; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: Path, write) -> None:
    """Call ``write(tmp_path)`` on a temporary file next to ``path``, flush it to disk, then rename it to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def write_json_atomic(path: Path, value) -> None:
    write_atomic(path, lambda tmp: Path(tmp).write_text(json.dumps(value, indent=1, sort_keys=True)))


def hold_lock(root: Path):
    """An exclusive lock on the cache directory for this process's lifetime (released by the OS even on kill -9);
    a second precompute into the same directory is refused instead of racing the first one."""
    import fcntl

    handle = open(Path(root) / LOCK_FILE, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        owner = handle.read().strip() or "another process"
        handle.close()
        raise BlockingIOError(f"{root} is being written by another precompute run ({owner}); wait for it") from None
    handle.truncate(0)
    handle.write(f"pid {os.getpid()} on {os.uname().nodename}")
    handle.flush()
    return handle


def shard_relpath(chunk: int) -> str:
    return f"{SHARD_DIR}/chunk-{chunk:06d}.safetensors"


def record_path(root: Path, chunk: int) -> Path:
    return Path(root) / RECORD_DIR / f"chunk-{chunk:06d}.json"


def safetensors_offsets(path: Path) -> Dict[str, Tuple[int, int]]:
    """``{tensor name: (byte offset in the file, byte length)}`` from a safetensors header (for raw readers)."""
    with open(path, "rb") as f:
        (header_size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_size))
    base = 8 + header_size
    return {
        name: (base + entry["data_offsets"][0], entry["data_offsets"][1] - entry["data_offsets"][0])
        for name, entry in header.items()
        if name != "__metadata__"
    }


def write_shard(root: Path, chunk: int, tensors: Mapping, metadata: Mapping[str, str]) -> Dict[str, Tuple[int, int]]:
    """Write chunk ``chunk``'s tensors atomically; returns their offsets in the file."""
    from safetensors.torch import save_file

    path = Path(root) / shard_relpath(chunk)
    write_atomic(path, lambda tmp: save_file(dict(tensors), tmp, metadata=dict(metadata)))
    return safetensors_offsets(path)


def completed_chunks(root: Path) -> set:
    """Chunks whose progress record exists (each record is renamed into place after its shard)."""
    directory = Path(root) / RECORD_DIR
    if not directory.is_dir():
        return set()
    done = set()
    for path in directory.glob("chunk-*.json"):
        try:
            done.add(int(path.stem.split("-")[1]))
        except (IndexError, ValueError):
            continue
    return done


def read_records(root: Path, chunks: Iterable[int]) -> list:
    rows = []
    for chunk in sorted(chunks):
        rows.extend(json.loads(record_path(root, chunk).read_text())["rows"])
    return rows


def write_index(root: Path, rows: list, provenance: Mapping) -> Path:
    """Write ``index.parquet`` (one row per entry of ``rows``) with ``provenance`` in its schema metadata."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pandas(pd.DataFrame(rows), preserve_index=False)
    metadata = dict(table.schema.metadata or {})
    metadata[PROVENANCE_KEY] = json.dumps(provenance, sort_keys=True).encode()
    table = table.replace_schema_metadata(metadata)
    path = Path(root) / INDEX_FILE
    write_atomic(path, lambda tmp: pq.write_table(table, tmp))
    return path


def read_index(root: Path) -> Tuple[pd.DataFrame, dict]:
    """(rows, provenance) of a finished cache; ``FileNotFoundError`` when ``root`` holds no index."""
    import pyarrow.parquet as pq

    path = Path(root) / INDEX_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{root} holds no {INDEX_FILE}: not a finished latent cache (run scripts/diffusion/precompute.py "
            "CONFIG --outputs DIR, and rerun the same command if it was stopped)"
        )
    table = pq.read_table(path)
    raw = (table.schema.metadata or {}).get(PROVENANCE_KEY)
    if raw is None:
        raise ValueError(f"{path} has no latent-cache provenance: not written by precompute.py")
    return table.to_pandas(), json.loads(raw)
