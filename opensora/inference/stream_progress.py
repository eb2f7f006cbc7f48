"""The ``--streaming`` progress bar and per-chunk report.

The bar ticks once per decoded chunk over every batch of prompts, so tqdm's ETA counts the whole run (chunks cost
about the same, the first one a little more). ``StreamReport`` keeps what each chunk of a batch cost and ran under --
its seconds, the re-cache before it (``--kv-recache`` / a prompt switch: reason, frames, seconds) and the prompt in
force -- shows the latest re-cache and prompt on the bar, and hands the lot to the samples' sidecars."""

import math
from typing import List, Optional

from tqdm import tqdm


def stream_progress_bar(latent_frames: int, chunk_frames: int, num_prompts: int, batch_size: int, enabled: bool):
    chunks = math.ceil(int(latent_frames) / max(1, int(chunk_frames)))
    batches = math.ceil(int(num_prompts) / max(1, int(batch_size)))
    return tqdm(total=chunks * batches, unit="chunk", desc="streaming", disable=not enabled, dynamic_ncols=True)


class StreamReport:
    """Per-chunk records of one batch's stream (``chunk`` after each ``StreamChunk``), ticking ``bar``."""

    def __init__(self, bar=None):
        self.bar = bar
        self.chunks: List[dict] = []
        self.prompts: Optional[list] = None

    def chunk(self, chunk) -> None:
        row = dict(index=chunk.index, start_frame=chunk.start_frame, seconds=round(chunk.seconds, 4))
        recache = getattr(chunk, "recache", None)
        if recache is not None:
            row["recache"] = dict(recache, seconds=round(recache["seconds"], 4))
        switched = chunk.prompts is not None and self.prompts is not None and chunk.prompts != self.prompts
        if chunk.prompts is not None and (self.prompts is None or switched):
            row["prompts"] = list(chunk.prompts)  # the first chunk's and each switch's
        self.prompts = chunk.prompts
        self.chunks.append(row)
        if self.bar is not None:
            if recache is not None or switched:
                self.bar.set_postfix_str(self.postfix(row), refresh=False)
            self.bar.update(1)

    @staticmethod
    def postfix(row: dict) -> str:
        parts = []
        if "recache" in row:
            r = row["recache"]
            parts.append(f"re-cache ({r['reason']}) {r['frames']} frames {1000 * r['seconds']:.1f} ms")
        if "prompts" in row:
            parts.append(f"prompt: {row['prompts'][0][:40]}")
        return "; ".join(parts)

    @property
    def recaches(self) -> List[dict]:
        return [row for row in self.chunks if "recache" in row]

    def record(self) -> dict:
        """What a sample's sidecar keeps: ``chunk_seconds`` (every chunk), and with re-caches or a prompt switch
        ``chunks``: per chunk its seconds, the re-cache before it and the prompts from it on (where they changed)."""
        record = dict(chunk_seconds=[row["seconds"] for row in self.chunks])
        if self.recaches or sum("prompts" in row for row in self.chunks) > 1:
            record["chunks"] = self.chunks
        return record

    def summary(self) -> str:
        """One line: how many re-caches ran, the frames they recomputed and their time."""
        rows = self.recaches
        frames = sum(row["recache"]["frames"] for row in rows)
        seconds = sum(row["recache"]["seconds"] for row in rows)
        reasons = sorted({row["recache"]["reason"] for row in rows})
        return (
            f"{len(rows)} KV re-cache(s) ({', '.join(reasons)}) over {len(self.chunks)} chunks: {frames} latent "
            f"frames recomputed in {seconds:.3f} s"
        )
