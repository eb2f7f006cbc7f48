"""Sampling into a ``--save-dir`` that already holds samples: the new ones are added after them, nothing is replaced.

A second run into the same directory numbers its files after the highest sample index already there
(``0000_..`` to ``0071_..``, then ``0072_..``), lists earlier and new samples in ``samples.csv`` and keeps the earlier
run's resolved ``config.py`` (the new run's goes to ``config_0072.py``). That is what users of diffusers' and
musubi-tuner's sampling scripts expect (they write new, uniquely named files and never replace earlier outputs): a
re-run with another seed or step count must not destroy the samples it is compared with. ``--overwrite`` starts the
directory over instead: the files the earlier runs listed in ``samples.csv`` (videos, images, sidecars) and their
configs are deleted and numbering restarts at 0, which is what regenerating a demo or an evaluation set wants.

Seeds do not move with the file numbers: sample ``i`` of a run still uses ``seed + i``, so the same command gives the
same videos wherever they are written.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import List

SAMPLES_CSV = "samples.csv"
CONFIG_NAME = "config.py"
_SAMPLE_FILE = re.compile(r"^(\d{4,})_.*\.(mp4|png|json)$")
_RUN_CONFIG = re.compile(r"^config(_\d{4,})?\.py$")


@dataclass
class SaveDirPlan:
    directory: Path
    first_index: int = 0  # file index of this run's first sample
    earlier_rows: List[dict] = field(default_factory=list)  # samples.csv rows of earlier runs, kept first
    config_name: str = CONFIG_NAME  # where this run's resolved config goes

    def index(self, i: int) -> int:
        """The file index of this run's sample ``i``."""
        return self.first_index + int(i)

    def rows(self, new_rows) -> List[dict]:
        """``samples.csv`` rows: the earlier runs' then this run's."""
        return self.earlier_rows + [dict(path=r["path"], text=r["text"]) for r in new_rows]


def read_samples_csv(directory: Path) -> List[dict]:
    path = Path(directory) / SAMPLES_CSV
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return [dict(path=row["path"], text=row["text"]) for row in csv.DictReader(f) if row.get("path")]


def plan_save_dir(save_dir, overwrite: bool = False) -> SaveDirPlan:
    """Where this run's samples go in ``save_dir`` (see the module docstring); with ``overwrite`` the earlier runs'
    samples are deleted first. Under torch.distributed, rank 0 decides and every rank gets its plan, so all ranks
    number their files alike even while rank 0 is already writing."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        holder = [_plan(Path(save_dir), overwrite) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]
    return _plan(Path(save_dir), overwrite)


def _plan(directory: Path, overwrite: bool) -> SaveDirPlan:
    if not directory.is_dir():
        return SaveDirPlan(directory)
    earlier = read_samples_csv(directory)
    if overwrite:
        _delete_earlier_samples(directory, earlier)
        return SaveDirPlan(directory)
    indices = [int(m.group(1)) for m in map(_SAMPLE_FILE.match, (p.name for p in directory.iterdir())) if m]
    indices += [int(m.group(1)) for m in map(_SAMPLE_FILE.match, (Path(r["path"]).name for r in earlier)) if m]
    if not indices and not (directory / CONFIG_NAME).exists():
        return SaveDirPlan(directory, earlier_rows=earlier)
    first = max(indices, default=-1) + 1
    config_name = CONFIG_NAME if not (directory / CONFIG_NAME).exists() else f"config_{first:04d}.py"
    return SaveDirPlan(directory, first, earlier, config_name)


def _delete_earlier_samples(directory: Path, earlier: List[dict]) -> None:
    """The files earlier runs wrote: those listed in samples.csv, their sidecars, and the run configs."""
    for row in earlier:
        sample = directory / Path(row["path"]).name
        if _SAMPLE_FILE.match(sample.name):
            sample.unlink(missing_ok=True)
            sample.with_suffix(".json").unlink(missing_ok=True)
    for path in directory.iterdir():
        if _RUN_CONFIG.match(path.name):
            path.unlink()
    (directory / SAMPLES_CSV).unlink(missing_ok=True)
