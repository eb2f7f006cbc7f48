"""A training table from a folder of clips: every video and image under it with its caption, probed with PyAV.

Captions, first found wins for each file:

1. a text file beside it with the same stem (``clip_007.mp4`` + ``clip_007.txt``; musubi-tuner's and ai-toolkit's
   layout); lines are joined with spaces;
2. a mapping file at the folder's top (or given with ``captions=``): ``captions.csv`` (a file column ``path`` /
   ``file_name`` / ``file`` / ``video`` / ``image`` and a caption column ``text`` / ``caption`` / ``prompt``),
   ``captions.json`` (``{"clip_007.mp4": "caption", ...}`` or a list of such rows) or ``metadata.jsonl`` (one row per
   line, Hugging Face ``datasets``' folder layout). A file is named by its path relative to the folder or by its
   bare name.

The table (``TABLE_COLUMNS``) is what ``VideoTextDataset`` reads, metadata columns included, so training starts
without probing. Files that cannot be read (empty, truncated, no video stream, nothing decodable) and files without
a caption are listed with the reason and left out (``allow_uncaptioned`` keeps the latter with an empty caption).
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .media_probe import UnreadableMediaError, is_image, is_media, probe_checked

TABLE_COLUMNS = ("path", "text", "num_frames", "height", "width", "fps", "duration")
MAPPING_NAMES = ("captions.csv", "captions.json", "metadata.jsonl")
_FILE_COLUMNS = ("path", "file_name", "filename", "file", "video", "image")
_TEXT_COLUMNS = ("text", "caption", "prompt")


@dataclass
class FolderTable:
    rows: List[dict] = field(default_factory=list)  # TABLE_COLUMNS, paths as found (absolute)
    unreadable: List[Tuple[str, str]] = field(default_factory=list)  # (path, reason)
    uncaptioned: List[str] = field(default_factory=list)
    caption_source: Dict[str, int] = field(default_factory=dict)  # "txt" / mapping file name -> files captioned


def media_files(folder: Path) -> List[Path]:
    """Every video and image under ``folder``, sorted, hidden files and folders skipped."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [Path(root) / f for f in sorted(files) if is_media(f) and not f.startswith(".")]
    return found


def read_caption_mapping(path: Path) -> Dict[str, str]:
    """``{file name or relative path: caption}`` from a captions.csv / .json / metadata.jsonl file."""
    path = Path(path)
    suffix = path.suffix.lower()
    try:
        if suffix == ".csv":
            with open(path, newline="", encoding="utf-8") as f:
                rows = list(csv.DictReader(f))
        elif suffix == ".jsonl":
            rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        elif suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(data, dict):
                return {str(k): _clean(v) for k, v in data.items()}
            rows = data
        else:
            raise ValueError(f"captions file {path} must be .csv, .json or .jsonl")
    except (json.JSONDecodeError, UnicodeDecodeError, csv.Error) as error:
        raise ValueError(f"captions file {path} cannot be parsed: {error}") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"captions file {path}: expected rows of {{file, caption}}")
    columns = set().union(*(r.keys() for r in rows)) if rows else set()
    file_column = next((c for c in _FILE_COLUMNS if c in columns), None)
    text_column = next((c for c in _TEXT_COLUMNS if c in columns), None)
    if rows and (file_column is None or text_column is None):
        raise ValueError(
            f"captions file {path} needs a file column (one of {_FILE_COLUMNS}) and a caption column "
            f"(one of {_TEXT_COLUMNS}); it has {sorted(columns)}"
        )
    return {str(r[file_column]): _clean(r.get(text_column)) for r in rows if r.get(file_column)}


def _clean(caption) -> str:
    return " ".join(str(caption or "").split())


def _side_caption(media: Path) -> Optional[str]:
    text_file = media.with_suffix(".txt")
    if not text_file.is_file():
        return None
    return _clean(text_file.read_text(encoding="utf-8", errors="replace"))


def _mapped_caption(mapping: Dict[str, str], folder: Path, media: Path) -> Optional[str]:
    relative = media.relative_to(folder).as_posix()
    for key in (relative, "./" + relative, media.name):
        if key in mapping:
            return mapping[key]
    return None


def build_folder_table(folder, captions=None, allow_uncaptioned: bool = False, progress: bool = False) -> FolderTable:
    """Scan ``folder`` (see the module docstring). ``captions``: a mapping file; default: the first of
    ``MAPPING_NAMES`` at the folder's top."""
    from tqdm import tqdm

    folder = Path(folder).resolve()
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a directory")
    mapping_file = (
        Path(captions)
        if captions is not None
        else next((folder / n for n in MAPPING_NAMES if (folder / n).is_file()), None)
    )
    if mapping_file is not None and not mapping_file.is_file():
        raise FileNotFoundError(f"captions file {mapping_file} does not exist")
    mapping = read_caption_mapping(mapping_file) if mapping_file is not None else {}
    table = FolderTable()
    for media in tqdm(media_files(folder), desc="probing", unit="file", disable=not progress):
        try:
            info = probe_checked(media)
        except UnreadableMediaError as error:
            table.unreadable.append((str(media), str(error)))
            continue
        caption, source = _side_caption(media), "txt"
        if caption is None and mapping:
            caption, source = _mapped_caption(mapping, folder, media), mapping_file.name
        if caption is None or caption == "":
            if not allow_uncaptioned:
                table.uncaptioned.append(str(media))
                continue
            caption, source = "", "none"
        table.caption_source[source] = table.caption_source.get(source, 0) + 1
        table.rows.append(
            dict(
                path=str(media),
                text=caption,
                num_frames=info.num_frames,
                height=info.height,
                width=info.width,
                fps=0.0 if is_image(media) else round(info.fps, 6),
                duration=round(info.duration, 6),
            )
        )
    return table


def write_table(rows: List[dict], out, absolute: bool = False) -> Path:
    """``rows`` as a .csv or .parquet table; paths relative to the table's folder (how the dataset resolves them)
    unless ``absolute``. Written to a temporary file and renamed, so a stopped run leaves no half table."""
    import pandas as pd

    out = Path(out)
    if out.suffix.lower() not in (".csv", ".parquet"):
        raise ValueError(f"--out {out} must end in .csv or .parquet")
    out.parent.mkdir(parents=True, exist_ok=True)
    base = out.parent.resolve()
    frame = pd.DataFrame(
        [dict(r, path=r["path"] if absolute else os.path.relpath(r["path"], base)) for r in rows],
        columns=list(TABLE_COLUMNS),
    )
    tmp = out.with_name(f".{out.name}.tmp")
    if out.suffix.lower() == ".csv":
        frame.to_csv(tmp, index=False)
    else:
        frame.to_parquet(tmp, index=False)
    os.replace(tmp, out)
    return out
