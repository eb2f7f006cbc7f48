"""Prompts for sampling: read them from a txt or csv file, and turn them into file-name slugs."""

import csv
import re
from pathlib import Path
from typing import List, Sequence

PROMPT_COLUMNS = ("text", "prompt", "caption")  # csv columns accepted as the prompt, first found wins
_NON_WORD = re.compile(r"[^a-z0-9]+")


def read_prompt_file(path) -> List[str]:
    """Prompts from ``path``: a ``.csv`` with a ``text`` (or ``prompt`` / ``caption``) column, else one per line.

    Blank lines are skipped in text files; csv rows are kept in order (duplicates too, so a dataset's
    meta.csv samples every held caption once per row).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file not found: {path}")
    if path.suffix.lower() == ".csv":
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            columns = reader.fieldnames or []
            column = next((c for c in PROMPT_COLUMNS if c in columns), None)
            if column is None:
                raise ValueError(f"{path} has no prompt column: expected one of {PROMPT_COLUMNS}, found {columns}")
            prompts = [row[column] for row in reader]
    else:
        prompts = [line.strip() for line in path.read_text().splitlines()]
        prompts = [p for p in prompts if p]
    if not prompts:
        raise ValueError(f"prompt file {path} holds no prompts")
    return prompts


def resolve_prompts(prompt=None, prompt_file=None) -> List[str]:
    """The run's prompts from ``--prompt`` xor ``--prompt-file``.

    ``prompt``: one string, or a list (``--prompt`` repeated: each taken as it is, '|' included). A single string is
    split at '|' into several prompts, the older spelling of several prompts kept for existing scripts (a prompt that
    itself holds '|' goes in a --prompt-file, or is given with a second --prompt).
    """
    if (prompt is None) == (prompt_file is None):
        raise ValueError("give exactly one of --prompt TEXT or --prompt-file FILE")
    if prompt_file is not None:
        return read_prompt_file(prompt_file)
    if isinstance(prompt, (list, tuple)):
        prompts = [str(p).strip() for p in prompt]
    else:
        prompts = [p.strip() for p in str(prompt).split("|")]
    if not all(prompts):
        raise ValueError(f"empty prompt in --prompt {prompt!r}")
    return prompts


def slugify(text: str, max_length: int = 48) -> str:
    """Lower-case ascii words joined by '_' and cut at ``max_length``: safe in any file system."""
    slug = _NON_WORD.sub("_", text.lower()).strip("_")[:max_length].rstrip("_")
    return slug or "sample"


def sample_stem(index: int, prompt: str) -> str:
    """``{index:04d}_{slug}``: the file name (without suffix) of sample ``index``."""
    return f"{index:04d}_{slugify(prompt)}"


def per_sample_seeds(seed: int, count: int, start: int = 0) -> Sequence[int]:
    """Sample ``i`` of a run uses ``seed + i``, whatever the batch size."""
    return [int(seed) + i for i in range(start, start + count)]
