"""Metrics sinks on rank 0: ``metrics.jsonl`` (one JSON object per optimizer step and one per validation),
tensorboard, optional wandb.

wandb runs offline unless the config says otherwise, so a machine without network never blocks on it.
"""

import json
import math
import os
from pathlib import Path
from typing import Mapping, Optional


class MetricsLogger:
    def __init__(
        self,
        outputs,
        enabled: bool,
        tensorboard: bool = True,
        wandb_cfg: Optional[Mapping] = None,
        run_config: Optional[dict] = None,
    ):
        self.enabled = enabled
        self.path = Path(outputs) / "metrics.jsonl"
        self._tb = None
        self._wandb = None
        # the sinks open on first use (``start``): a run refused at resume leaves nothing in its outputs directory
        self._settings = (Path(outputs), tensorboard, dict(wandb_cfg or {}), run_config)
        self._started = False

    def start(self) -> None:
        """Create the outputs directory and open tensorboard / wandb (once; on rank 0 only)."""
        if not self.enabled or self._started:
            return
        self._started = True
        outputs, tensorboard, wandb_cfg, run_config = self._settings
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(outputs / "tensorboard"))
        if wandb_cfg.pop("enable", False):
            import wandb

            wandb_cfg.setdefault("mode", "offline")
            wandb_cfg.setdefault("dir", str(outputs))
            os.environ.setdefault("WANDB_SILENT", "true")
            self._wandb = wandb.init(config=run_config, **wandb_cfg)

    def truncate_after(self, step: int) -> None:
        """On resume, drop the records of steps after ``step`` that a crashed run wrote past its checkpoint."""
        self.start()
        if not self.enabled or not self.path.exists():
            return
        kept = [ln for ln in self.path.read_text().splitlines() if ln and json.loads(ln)["step"] <= step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(ln + "\n" for ln in kept))
        os.replace(tmp, self.path)

    def log(self, step: int, values: Mapping[str, float], prefix: str = "train/") -> None:
        """One ``metrics.jsonl`` record; tensorboard scalars are tagged ``{prefix}{key}``."""
        if not self.enabled:
            return
        self.start()
        record = {"step": step, **{k: v for k, v in values.items() if v is not None}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                if self._tb is not None:
                    self._tb.add_scalar(f"{prefix}{key}", value, step)
        if self._wandb is not None:
            self._wandb.log(record, step=step)

    def log_samples(self, step: int, grid, videos, paths, captions, fps: float = 8.0) -> None:
        """Validation samples: ``grid`` (uint8 ``[H, W, 3]``) as the image ``val/samples``; ``videos`` (uint8
        ``[N, T, H, W, 3]``) as the tensorboard video ``val/videos`` where tensorboard can encode it (it needs
        moviepy); the mp4 files ``paths`` as wandb videos."""
        if not self.enabled:
            return
        self.start()
        if self._tb is not None:
            self._tb.add_image("val/samples", grid, step, dataformats="HWC")
            if _has_module("moviepy"):
                import torch

                self._tb.add_video("val/videos", torch.from_numpy(videos).permute(0, 1, 4, 2, 3), step, fps=fps)
            self._tb.flush()
        if self._wandb is not None:
            import wandb

            self._wandb.log(
                {
                    "val/samples": wandb.Image(grid),
                    "val/videos": [wandb.Video(str(p), caption=c) for p, c in zip(paths, captions)],
                },
                step=step,
            )

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def read_metrics(outputs) -> list:
    path = Path(outputs) / "metrics.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln]
