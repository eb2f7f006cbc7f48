"""Training from precomputed latents and text features (``scripts/diffusion/precompute.py``'s output).

``dataset = dict(type="CachedLatentDataset", data_path=DIR)``. The sampler, drop-last rule, bad-sample handling and
resumable loader state are ``VideoTextDataset``'s: this dataset shows the sampler the source table's metadata, so
epoch plans are shuffled exactly as before, but it fixes every sample's bucket to the one its stored clip was
encoded for (``fixed_bucket_assignment``; epoch ``e`` reads the clips stored for epoch ``e % cached epochs``). A
sample that was bad when the cache was made raises ``BadSampleError`` here too, so it is replaced by a spare and
counted as in training from the videos. T5 features are stored trimmed to the prompt's tokens and padded back
(zeros past the prompt, ``text_mask`` False there; masked keys never reach a video token).

Args:
    data_path: the cache directory.
    flip_prob: chance of reading a clip's horizontally flipped copy, when the cache stores them (precompute
        ``--flip``); None = 0.5 with flipped copies, 0 without. The draw depends only on (seed, epoch, index).
    seed: for the flip draws.
"""

import logging
from typing import Dict, Optional, Tuple

import numpy as np
import torch

from opensora.cli_errors import UserInputError
from opensora.latent_cache.reader import FeatureCache
from opensora.registry import DATASETS

from .dataset import BadSampleError, VideoTextDataset

logger = logging.getLogger(__name__)


@DATASETS.register_module()
class CachedLatentDataset(VideoTextDataset):
    def __init__(self, data_path: str, flip_prob: Optional[float] = None, seed: int = 0):
        self.feature_cache = cache = FeatureCache(data_path)
        self.data_path = str(data_path)
        self.seed = int(seed)
        self.epoch = 0
        rows, made = cache.rows, cache.provenance
        self.cached_epochs = int(made["epochs"])
        self.max_text_tokens = int(made["text"]["max_length"])
        self.has_flips = bool(made["flip"])
        self.flip_prob = (0.5 if self.has_flips else 0.0) if flip_prob is None else float(flip_prob)
        if not 0.0 <= self.flip_prob <= 1.0 or (self.flip_prob > 0 and not self.has_flips):
            raise UserInputError(
                f"dataset.flip_prob={flip_prob} needs a number in [0, 1] and a cache with flipped clips "
                f"({data_path} has {'them' if self.has_flips else 'none: precompute with --flip'})"
            )
        self._rows = rows.to_dict("records")
        self._load_sample_metadata(rows, int(made["num_samples"]))
        self._ok: Dict[Tuple[int, int, bool], int] = {}  # (sample, cached epoch, flipped) -> row
        self._bad: Dict[Tuple[int, int], str] = {}  # (sample, cached epoch) -> reason
        for position, row in enumerate(self._rows):
            for slot in row["slots"] if row["status"] != "unbucketed" else ():
                if row["status"] == "ok":
                    self._ok[(row["sample"], int(slot), bool(row["flip"]))] = position
                else:
                    self._bad[(row["sample"], int(slot))] = row["reason"]
        self._slot_buckets = None  # per cached epoch: (frame bucket index, aspect index), set by check_bucket_table

    def _load_sample_metadata(self, rows, num_samples: int) -> None:
        first = rows.drop_duplicates("sample").sort_values("sample")
        if len(first) != num_samples or not np.array_equal(first["sample"].to_numpy(), np.arange(num_samples)):
            raise UserInputError(f"latent cache {self.data_path} lists {len(first)} of its {num_samples} samples")
        self.paths = first["path"].astype(str).tolist()
        self.texts = first["text"].astype(str).tolist()
        self.num_frames = first["src_num_frames"].to_numpy(np.int64)
        self.heights = first["src_height"].to_numpy(np.int64)
        self.widths = first["src_width"].to_numpy(np.int64)
        self.frame_intervals = first["frame_interval"].to_numpy(np.int64)
        self.is_image = first["is_image"].to_numpy(bool)
        self.fps = first["src_fps"].to_numpy(np.float64)
        self.num_frames_default, self.image_size = 1, (0, 0)  # plain int keys are not served (see _resolve_key)

    # -- buckets

    def check_bucket_table(self, table) -> None:
        """Refuse a bucket config that has no bucket of the shape some stored clip was encoded at."""
        index_of = {(b.resolution.name, b.num_frames): j for j, b in enumerate(table.frame_buckets)}
        slot_buckets = []
        for slot in range(self.cached_epochs):
            frame_bucket = np.full(len(self.paths), -1, dtype=np.int64)
            aspect = np.zeros(len(self.paths), dtype=np.int64)
            for row in self._rows:
                if row["status"] == "unbucketed" or row["flip"] or slot not in row["slots"]:
                    continue
                shape = (int(row["num_frames"]), int(row["height"]), int(row["width"]))
                j = index_of.get((row["resolution"], shape[0]))
                if j is None or table.bucket_shape(j, int(row["aspect"])) != shape:
                    raise UserInputError(
                        f"bucket_config cannot be served by latent cache {self.data_path}: it stores clips of "
                        f"{shape[0]} frames at {shape[1]}x{shape[2]} (bucket {row['resolution']!r}, {shape[0]} frames) "
                        f"that this bucket_config has no bucket for; the cache was made with bucket_config "
                        f"{self.feature_cache.provenance['bucket_config']} (batch sizes may differ)"
                    )
                frame_bucket[row["sample"]], aspect[row["sample"]] = j, int(row["aspect"])
            slot_buckets.append((frame_bucket, aspect))
        self._slot_buckets = slot_buckets

    def fixed_bucket_assignment(self, epoch: int, table) -> Tuple[np.ndarray, np.ndarray]:
        if self._slot_buckets is None:
            self.check_bucket_table(table)
        return self._slot_buckets[epoch % self.cached_epochs]

    # -- loading

    def _resolve_key(self, key):
        if isinstance(key, (int, np.integer)):
            raise TypeError("CachedLatentDataset serves bucket keys 'index-T-H-W-epoch' (use the bucket sampler)")
        return super()._resolve_key(key)

    def _flipped(self, index: int, epoch: int) -> bool:
        if self.flip_prob <= 0:
            return False
        return bool(np.random.default_rng([self.seed, epoch, index, 1]).random() < self.flip_prob)

    def load_sample(self, key) -> dict:
        index, num_frames, height, width, epoch = self._resolve_key(key)
        slot = epoch % self.cached_epochs
        if (index, slot) in self._bad:
            raise BadSampleError(self.paths[index], self._bad[(index, slot)])
        position = self._ok.get((index, slot, self._flipped(index, epoch)))
        if position is None:
            raise BadSampleError(self.paths[index], f"no clip stored for cached epoch {slot}")
        row = self._rows[position]
        if (int(row["num_frames"]), int(row["height"]), int(row["width"])) != (num_frames, height, width):
            raise ValueError(
                f"sample {index} is stored at {row['num_frames']}x{row['height']}x{row['width']}, "
                f"the sampler asked for {num_frames}x{height}x{width}"
            )
        cache = self.feature_cache
        tokens = cache.tensor(row["shard"], row["text_key"])
        text_emb = tokens.new_zeros(self.max_text_tokens, tokens.shape[-1])
        text_emb[: tokens.shape[0]] = tokens
        return dict(
            latents=cache.tensor(row["shard"], row["latents_key"]),
            text_emb=text_emb,
            text_mask=torch.arange(self.max_text_tokens) < tokens.shape[0],
            pooled=cache.tensor(row["shard"], row["pooled_key"]),
            text=self.texts[index],
            fps=float(row["fps"]),
            num_frames=num_frames,
            height=height,
            width=width,
            path=self.paths[index],
            index=index,
        )
