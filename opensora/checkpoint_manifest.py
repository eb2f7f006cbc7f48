"""Checkpoints that verify themselves: a manifest of every file's size and checksum, checked by every reader.

Saving writes ``manifest.json`` into the checkpoint after every other file and before the completion marker::

    {"format": 1, "checksum": "crc32", "files": {"model/model/model.safetensors": {"size": 123, "crc32": "1a2b3c4d"},
                                                  ...}}

Readers call ``verify_checkpoint(path, checksums=...)``: sizes always (a ``stat`` per file: a truncated or missing file
is caught before any loader parses it), checksums where a silently flipped byte would cost most (``--resume``,
``--load``, the converter; sampling with ``--verify-checkpoint``). CRC-32 (zlib, ~2 GB/s per core, files hashed in
parallel threads) detects accidental damage (truncation, a bad disk or copy); it is not a defence against someone
who rewrites the files on purpose: weights-only loading (``opensora.safe_load``) is that defence.

A checkpoint saved before manifests existed loads as before, with one log line saying its files are not verified.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from opensora.cli_errors import UserInputError

logger = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
_UNLISTED = ("COMPLETE", MANIFEST_FILE)  # written after the manifest (the marker) or the manifest itself
_CHUNK = 8 * 2**20


class DamagedCheckpointError(UserInputError):
    """A checkpoint file differs from its manifest (missing, another size, another checksum)."""

    def __init__(self, checkpoint: Path, message: str):
        super().__init__(message)
        self.checkpoint = checkpoint


def file_crc32(path: Path) -> str:
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            value = zlib.crc32(chunk, value)  # zlib releases the GIL: threads hash files in parallel
    return f"{value:08x}"


def _listed_files(directory: Path) -> list[str]:
    return sorted(
        str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() and p.name not in _UNLISTED
    )


def _threads(count: int) -> int:
    return max(1, min(8, os.cpu_count() or 1, count))


def write_manifest(directory: str | Path) -> dict:
    """Record the size and CRC-32 of every file under ``directory`` (a checkpoint being saved) in its manifest."""
    directory = Path(directory)
    names = _listed_files(directory)
    with ThreadPoolExecutor(_threads(len(names))) as pool:
        sums = list(pool.map(lambda name: file_crc32(directory / name), names))
    files = {name: {"size": (directory / name).stat().st_size, "crc32": crc} for name, crc in zip(names, sums)}
    manifest = {"format": 1, "checksum": "crc32", "files": files}
    tmp = directory / f".{MANIFEST_FILE}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, directory / MANIFEST_FILE)
    return manifest


def read_manifest(checkpoint: str | Path) -> dict | None:
    """The manifest of ``checkpoint`` (None for one saved before manifests); a damaged manifest is an error."""
    path = Path(checkpoint) / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if not isinstance(files, dict):
            raise TypeError("files is not a mapping")
    except (ValueError, KeyError, TypeError) as error:
        raise DamagedCheckpointError(
            Path(checkpoint), f"checkpoint {checkpoint} is damaged: {path} cannot be read ({error}); {_ADVICE}"
        ) from None
    return manifest


_ADVICE = "resume from an older checkpoint (--load DIR, or --resume auto, which skips damaged ones) or re-copy it"


def verify_checkpoint(
    checkpoint: str | Path, checksums: bool = False, only: str | None = None, quiet: bool = False
) -> bool:
    """Check ``checkpoint``'s files against its manifest: sizes, and with ``checksums`` their CRC-32 too.

    ``only``: check just the files under this sub-path (a role directory: what a sampler reads). Returns False for
    a checkpoint without a manifest (saved by an older version; logged unless ``quiet``), True when everything matches; raises
    ``DamagedCheckpointError`` naming the first damaged file otherwise.
    """
    checkpoint = Path(checkpoint)
    manifest = read_manifest(checkpoint)
    if manifest is None:
        if quiet:
            return False
        logger.warning(
            "checkpoint %s has no %s (saved by an older version): its files are not verified", checkpoint, MANIFEST_FILE
        )
        return False
    entries = [
        (name, entry)
        for name, entry in sorted(manifest["files"].items())
        if only is None or name == only or name.startswith(only.rstrip("/") + "/")
    ]
    for name, entry in entries:
        path = checkpoint / name
        if not path.is_file():
            raise DamagedCheckpointError(
                checkpoint, f"checkpoint {checkpoint} is damaged: {path} is missing; {_ADVICE}"
            )
        size = path.stat().st_size
        if size != int(entry["size"]):
            raise DamagedCheckpointError(
                checkpoint,
                f"checkpoint {checkpoint} is damaged: {path} has {size:,} bytes, its manifest says "
                f"{int(entry['size']):,} (truncated or overwritten); {_ADVICE}",
            )
    if checksums:
        with ThreadPoolExecutor(_threads(len(entries))) as pool:
            sums = list(pool.map(lambda item: file_crc32(checkpoint / item[0]), entries))
        for (name, entry), crc in zip(entries, sums):
            if crc != entry.get("crc32"):
                raise DamagedCheckpointError(
                    checkpoint,
                    f"checkpoint {checkpoint} is damaged: {checkpoint / name} does not match its manifest's "
                    f"checksum (its bytes changed after the save); {_ADVICE}",
                )
    return True


def check_safetensors_complete(path: str | Path) -> None:
    """A safetensors file's header and its size agree (the check for files without a manifest: exported files,
    checkpoints saved before manifests). Raises ``DamagedCheckpointError`` naming the file."""
    path = Path(path)
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if length < 2 or 8 + length > size:
                raise ValueError(f"truncated, or not safetensors: its header alone claims {length:,} bytes")
            header = json.loads(f.read(length))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError) as error:
        raise DamagedCheckpointError(
            path, f"{path} is damaged or not a safetensors file ({size:,} bytes; {error}); {_ADVICE}"
        ) from None
    if 8 + length + end != size:
        raise DamagedCheckpointError(
            path,
            f"{path} is damaged: {size:,} bytes, but its header describes {8 + length + end:,} (truncated or "
            f"overwritten); {_ADVICE}",
        )


def checkpoint_of(path: str | Path) -> tuple[Path, str | None] | None:
    """(checkpoint directory, sub-path inside it) for a path inside a checkpoint that has a manifest, else None."""
    path = Path(path).resolve()
    for parent in [path, *path.parents]:
        if (parent / MANIFEST_FILE).is_file():
            inner = path.relative_to(parent)
            return parent, None if str(inner) == "." else str(inner)
    return None
