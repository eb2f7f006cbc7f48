"""The ``--streaming`` progress bar: one tick per decoded chunk over every batch of prompts, so tqdm's ETA counts
the whole run (chunks cost about the same, the first one a little more)."""

import math

from tqdm import tqdm


def stream_progress_bar(latent_frames: int, chunk_frames: int, num_prompts: int, batch_size: int, enabled: bool):
    chunks = math.ceil(int(latent_frames) / max(1, int(chunk_frames)))
    batches = math.ceil(int(num_prompts) / max(1, int(batch_size)))
    return tqdm(total=chunks * batches, unit="chunk", desc="streaming", disable=not enabled, dynamic_ncols=True)
