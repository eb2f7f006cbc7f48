"""Frozen text conditioner: T5 token features + CLIP pooled vector for a batch of prompts.

``encode(prompts)`` returns ``text_emb [B, L, D_t5]``, ``text_mask [B, L]`` (bool, True on real tokens, padded to
``max_length``) and ``pooled [B, D_clip]``. Results are cached per prompt (training captions repeat a lot), and
``null_embeddings`` gives the empty-prompt features used for classifier-free guidance.
"""

import logging
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from opensora.models.vae.base import resolve_dtype
from opensora.registry import MODELS

from .encoders import LoadedEncoder, load_clip, load_t5

logger = logging.getLogger(__name__)


LENGTH_CACHE_MIN = 8192  # prompts whose T5 token counts are remembered (ints: cheap), at least the feature cache's


def _tokenize(encoder: LoadedEncoder, prompts: Sequence[str], device) -> Tuple[Dict[str, torch.Tensor], List[int]]:
    """The encoder's inputs on ``device``, and each prompt's valid token count read on the host before the copy."""
    tokens = encoder.tokenizer(
        list(prompts), padding="max_length", max_length=encoder.max_length, truncation=True, return_tensors="pt"
    )
    lengths = tokens.attention_mask.sum(-1).tolist()
    return {"input_ids": tokens.input_ids.to(device), "attention_mask": tokens.attention_mask.to(device)}, lengths


@MODELS.register_module()
class TextConditioner(nn.Module):
    """Args:
    t5 / clip: dict(from_pretrained=PATH or None, tokenizer=PATH or None, config=dict(...) for the tiny random
        model, max_length=N). ``None`` or ``{}`` means the tiny default.
    seed: initialises the tiny random models (the global RNG is left untouched).
    dtype: "fp32" / "bf16" / "fp16" or a torch.dtype. device: where the encoders run.
    cache_size: how many distinct prompts to keep encoded (0 disables the cache).
    """

    def __init__(
        self,
        t5: Optional[dict] = None,
        clip: Optional[dict] = None,
        seed: int = 0,
        dtype: Union[str, torch.dtype] = "fp32",
        device: Union[str, torch.device, None] = None,
        cache_size: int = 1024,
    ):
        super().__init__()
        dtype = resolve_dtype(dtype)
        # Random tiny weights come from this seed in a forked RNG: same seed, same encoders, caller's RNG untouched.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            t5_encoder = load_t5(dict(t5 or {}), dtype)
            clip_encoder = load_clip(dict(clip or {}), dtype)
        self.t5 = t5_encoder.model
        self.clip = clip_encoder.model
        # Tokenizers and lengths are plain attributes, kept out of the module tree.
        self._t5_encoder = LoadedEncoder(t5_encoder.tokenizer, None, t5_encoder.max_length)
        self._clip_encoder = LoadedEncoder(clip_encoder.tokenizer, None, clip_encoder.max_length)
        self.text_dim = self.t5.config.d_model
        self.pooled_dim = self.clip.config.hidden_size
        self.max_length = t5_encoder.max_length
        self.clip_max_length = clip_encoder.max_length
        self.cache_size = int(cache_size)
        self._cache: "OrderedDict[str, tuple]" = OrderedDict()
        self._lengths: "OrderedDict[str, int]" = OrderedDict()  # T5 valid token counts (host), see text_lengths
        self._null: Optional[tuple] = None
        self._warned_long_prompt = False
        self.requires_grad_(False)
        self.eval()
        if device is not None:
            self.to(device)

    @property
    def device(self) -> torch.device:
        return next(self.t5.parameters()).device

    def train(self, mode: bool = True) -> "TextConditioner":
        # Frozen: a parent's .train() must not switch dropout back on.
        return super().train(False)

    def _apply(self, fn, *args, **kwargs):
        # .to()/.cuda()/.half() change the encoders, so cached features would be stale.
        self._cache.clear()
        self._null = None
        return super()._apply(fn, *args, **kwargs)

    @torch.no_grad()
    def _warn_if_cut(self, prompts: List[str]) -> None:
        """Once per conditioner: say that a prompt is longer than the T5 limit and by how much (it is cut)."""
        if self._warned_long_prompt:
            return
        lengths = [len(ids) for ids in self._t5_encoder.tokenizer(list(prompts), truncation=False).input_ids]
        longest = max(lengths, default=0)
        if longest > self.max_length:
            self._warned_long_prompt = True
            logger.warning(
                "a prompt has %d tokens, more than the text encoder's limit of %d: it is cut to %d "
                "tokens (%d prompt(s) of this batch are too long; later ones are cut without a warning)",
                longest,
                self.max_length,
                self.max_length,
                sum(n > self.max_length for n in lengths),
            )

    def _encode_uncached(self, prompts: List[str]) -> tuple:
        device = self.device
        self._warn_if_cut(prompts)
        t5_tokens, lengths = _tokenize(self._t5_encoder, prompts, device)
        self._remember_lengths(prompts, lengths)
        text_emb = self.t5(**t5_tokens).last_hidden_state
        clip_tokens, _ = _tokenize(self._clip_encoder, prompts, device)
        pooled = self.clip(**clip_tokens).pooler_output
        return text_emb, t5_tokens["attention_mask"].bool(), pooled

    @torch.no_grad()
    def encode(self, prompts: Union[str, Sequence[str]]) -> Dict[str, torch.Tensor]:
        if isinstance(prompts, str):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("encode needs at least one prompt")
        if self.cache_size <= 0:
            text_emb, text_mask, pooled = self._encode_uncached(prompts)
            return dict(text_emb=text_emb, text_mask=text_mask, pooled=pooled)

        missing = [p for p in dict.fromkeys(prompts) if p not in self._cache]
        if missing:
            text_emb, text_mask, pooled = self._encode_uncached(missing)
            for i, prompt in enumerate(missing):
                self._cache[prompt] = (text_emb[i], text_mask[i], pooled[i])
        rows = []
        for prompt in prompts:
            self._cache.move_to_end(prompt)
            rows.append(self._cache[prompt])
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        text_emb, text_mask, pooled = (torch.stack(parts) for parts in zip(*rows))
        return dict(text_emb=text_emb, text_mask=text_mask, pooled=pooled)

    def _remember_lengths(self, prompts: Sequence[str], lengths: Sequence[int]) -> None:
        for prompt, length in zip(prompts, lengths):
            self._lengths[prompt] = int(length)
            self._lengths.move_to_end(prompt)
        while len(self._lengths) > max(self.cache_size, LENGTH_CACHE_MIN):
            self._lengths.popitem(last=False)

    def text_lengths(self, prompts: Union[str, Sequence[str]]) -> Optional[List[int]]:
        """Each prompt's valid T5 token count, which is where ``encode``'s ``text_mask`` ends: a trainer learns the
        longest one on the host instead of reading the mask back from the GPU. Counts of prompts ``encode`` has seen
        are remembered (no second tokenization); others are tokenized here. None when the tokenizer pads on the left:
        the valid tokens then do not start each row, so a count is not where the text can be cut."""
        if getattr(self._t5_encoder.tokenizer, "padding_side", "right") != "right":
            return None
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        missing = [p for p in dict.fromkeys(prompts) if p not in self._lengths]
        if missing:
            ids = self._t5_encoder.tokenizer(missing, max_length=self.max_length, truncation=True).input_ids
            self._remember_lengths(missing, [len(row) for row in ids])
        return [self._lengths[p] for p in prompts]

    @torch.no_grad()
    def null_embeddings(self, batch_size: int) -> Dict[str, torch.Tensor]:
        """Empty-prompt features repeated ``batch_size`` times (the unconditional branch of CFG)."""
        if self._null is None:
            null = self._encode_uncached([""])
            self._null = tuple(t[0] for t in null)
        text_emb, text_mask, pooled = (t.unsqueeze(0).repeat(batch_size, *([1] * t.dim())) for t in self._null)
        return dict(text_emb=text_emb, text_mask=text_mask, pooled=pooled)

    def extra_repr(self) -> str:
        return (
            f"text_dim={self.text_dim}, pooled_dim={self.pooled_dim}, max_length={self.max_length}, "
            f"clip_max_length={self.clip_max_length}, cache_size={self.cache_size}"
        )
