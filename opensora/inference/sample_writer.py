"""``SampleWriter``: the one place every sampling path (whole videos, streamed chunks, the two-GPU pipeline) writes
its samples: ``{save_dir}/{index:04d}_{slug}.mp4`` (``.png`` for one frame), a ``.json`` sidecar each (the run's
record plus the sample's own fields) and ``samples.csv`` (``path,text``, the input of ``tools/eval_moving_shapes.py``),
rewritten as samples land so a run stopped early leaves a usable table."""

from pathlib import Path
from typing import List, Mapping, Optional, Sequence

from .io import save_sample, write_samples_csv, write_sidecar
from .prompts import sample_stem
from .save_dir import SaveDirPlan
from .streaming.writer import BatchVideoWriters


class SampleWriter:
    """Writes the samples of one run into ``save_dir``; ``record``: what every sidecar carries (config, checkpoint,
    sampler settings). ``plan``: where this run's files go in a save-dir that holds earlier samples (numbered after
    them, earlier ``samples.csv`` rows kept first; ``save_dir.py``). ``written`` / ``rows``: this run's sample paths
    and ``samples.csv`` rows so far."""

    def __init__(
        self,
        save_dir,
        prompts: Sequence[str],
        seeds: Sequence[int],
        fps: float,
        record: Mapping,
        plan: Optional[SaveDirPlan] = None,
    ):
        self.save_dir, self.prompts, self.seeds = Path(save_dir), list(prompts), list(seeds)
        self.fps, self.record = float(fps), dict(record)
        self.plan = SaveDirPlan(self.save_dir) if plan is None else plan
        self.written: List[Path] = []
        self.rows: List[dict] = []

    def stem(self, index: int) -> Path:
        return self.save_dir / sample_stem(self.plan.index(index), self.prompts[index])

    def video(self, index: int, frames, **extra) -> Path:
        """Sample ``index``'s whole video (uint8 [T, H, W, 3]) and its sidecar."""
        return self.finished(index, save_sample(self.stem(index), frames, fps=self.fps), **extra)

    def streams(self, indices: Sequence[int], height: int, width: int) -> BatchVideoWriters:
        """mp4 writers for samples ``indices`` that take their frames chunk by chunk (``finished`` each after)."""
        return BatchVideoWriters([self.stem(i) for i in indices], height, width, self.fps)

    def finished(self, index: int, path: Path, **extra) -> Path:
        """Sample ``index``'s file ``path`` is complete: its sidecar and its row."""
        record = dict(
            index=self.plan.index(index), prompt=self.prompts[index], seed=self.seeds[index], path=path.name, **extra
        )
        write_sidecar(path.with_suffix(".json"), dict(record, **self.record))
        self.written.append(path)
        self.rows.append(dict(index=index, path=path.name, text=self.prompts[index]))
        return path

    def write_csv(self, rows=None) -> Path:
        """``samples.csv``: the earlier runs' rows, then ``rows`` (default: this writer's) in prompt order."""
        rows = sorted(self.rows if rows is None else rows, key=lambda row: row["index"])
        return write_samples_csv(self.save_dir, self.plan.rows(rows))
