"""A run's best checkpoint by a validation metric: ``{outputs}/best.json``.

With ``validation.best_metric`` set (a logged validation value, higher is better, e.g. ``"val/stats_window_min"``),
rank 0 notes that value after every validation at step ``s``, whose checkpoint the trainer saved just before it
(``validation.every`` must be a multiple of ``ckpt_every``). ``best.json`` keeps every noted value and the best step
(the last of equal values: scores are shares of a few dozen clips, so ties are common, and the later step has trained
more). Why: a distilled student's quality is not monotone in its steps (a Self-Forcing student on one H200 scored
0.08, 0.33, 0.75, 0.42 at steps 200-800 on the worst window's frame statistics), so the last checkpoint is not the
one to ship.

* checkpoint pruning (``keep_last``) spares the best checkpoint;
* a resumed run forgets the values past the step it resumed from (those steps are trained again; the trainer does
  this on rank 0 whatever its config says), and a validation cut short by ``max_seconds`` is no candidate;
* ``RUN/best`` names the best checkpoint wherever weights are read (``inference.py --ckpt``, ``init_from.path``, the
  converter), through ``checkpoint_layout.newest_checkpoint_of``; ``--load`` still takes a step directory;
* a history noted under another metric is replaced (a run that changes ``best_metric`` starts a new record).

Pure filesystem work, no torch: sampling reads it without the training stack.
"""

import json
import os
from pathlib import Path
from typing import Optional

BEST_FILE = "best.json"
BEST_NAME = "best"  # RUN/best: the best checkpoint of RUN


def read_best(outputs) -> Optional[dict]:
    """The run's ``best.json`` (``metric``, ``history`` [{step, value}], ``best`` {step, value, checkpoint}), or
    None when the run keeps none."""
    path = Path(outputs) / BEST_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _write(outputs, record: dict) -> None:
    path = Path(outputs) / BEST_FILE
    tmp = path.with_name(f".{BEST_FILE}.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)  # a crash leaves the old file or the new one, never half of one


def _with_best(metric: str, history: list) -> dict:
    best = None
    for entry in history:  # oldest first: a later step that ties the best replaces it
        if best is None or entry["value"] >= best["value"]:
            best = entry
    if best is not None:  # the path inside the run, as checkpoint_layout.checkpoint_dir names it (which imports
        # this module to resolve RUN/best, so the name is spelt here; tests/test_best_checkpoint.py checks both agree)
        best = dict(best, checkpoint=f"checkpoints/step-{best['step']:07d}")
    return dict(metric=metric, best=best, history=history)


def note_value(outputs, metric: str, step: int, value: float) -> dict:
    """Record ``metric`` = ``value`` at ``step`` (replacing an earlier value at that step) and return the record."""
    old = read_best(outputs)
    noted = old["history"] if old is not None and old["metric"] == metric else []  # another metric: a new record
    history = [e for e in noted if e["step"] != step] + [dict(step=int(step), value=float(value))]
    history.sort(key=lambda e: e["step"])
    record = _with_best(metric, history)
    _write(outputs, record)
    return record


def forget_after(outputs, step: int) -> None:
    """On resume from ``step``: drop the values noted after it (their steps are trained again)."""
    old = read_best(outputs)
    if old is None:
        return
    kept = [e for e in old["history"] if e["step"] <= step]
    if len(kept) != len(old["history"]):
        _write(outputs, _with_best(old["metric"], kept))


def best_step(outputs) -> Optional[int]:
    record = read_best(outputs)
    return None if record is None or record["best"] is None else int(record["best"]["step"])


def best_checkpoint_of(run) -> Path:
    """The best checkpoint directory of run directory ``run``; a ``FileNotFoundError`` that says what to do when
    the run keeps no best checkpoint (or lost it)."""
    record = read_best(run)
    if record is None or record["best"] is None:
        raise FileNotFoundError(
            f"{Path(run) / BEST_NAME}: run {run} has no best checkpoint ({BEST_FILE} is written by validation with "
            "validation.best_metric set, e.g. 'val/all_acc'); pass the run directory (its newest checkpoint) or one "
            "of its checkpoints/step-* instead"
        )
    path = Path(run) / record["best"]["checkpoint"]
    if not path.is_dir():
        raise FileNotFoundError(
            f"{Path(run) / BEST_NAME}: {BEST_FILE} names {path} ({record['metric']} {record['best']['value']:.4g} at "
            f"step {record['best']['step']}), which does not exist; pass one of the run's checkpoints instead"
        )
    return path
