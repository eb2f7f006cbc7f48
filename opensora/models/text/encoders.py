"""Load the two frozen text encoders: T5 (per-token features) and CLIP (one pooled vector).

Each comes from a local transformers checkpoint (``from_pretrained``, never downloads) or, when no path is
given, from a tiny random config with the byte-level ``ByT5Tokenizer`` (needs no files): this is what the CPU
demo and the tests use.
"""

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

# ByT5: 3 special ids + 256 bytes + 125 sentinel ids.
BYTE_VOCAB_SIZE = 384

TINY_T5_CONFIG = dict(
    vocab_size=BYTE_VOCAB_SIZE, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, dropout_rate=0.0
)
TINY_CLIP_CONFIG = dict(
    vocab_size=BYTE_VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    attention_dropout=0.0,
)


@dataclass
class LoadedEncoder:
    tokenizer: Any
    model: nn.Module
    max_length: int


def byte_tokenizer():
    from transformers import ByT5Tokenizer

    return ByT5Tokenizer()


def _check_vocab(config_vocab_size: int, tokenizer, name: str) -> None:
    if config_vocab_size < len(tokenizer):
        raise ValueError(
            f"{name} config vocab_size={config_vocab_size} is smaller than the byte tokenizer's {len(tokenizer)} ids"
        )


def _load_pretrained(model_cls, path: str, tokenizer_path: Optional[str], dtype: torch.dtype):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or path, local_files_only=True)
    model = model_cls.from_pretrained(path, local_files_only=True, dtype=dtype)
    return tokenizer, model


def load_t5(spec: dict, dtype: torch.dtype) -> LoadedEncoder:
    """spec: from_pretrained (path or None), tokenizer (path, defaults to from_pretrained), config (tiny kwargs),
    max_length."""
    from transformers import T5Config, T5EncoderModel

    _reject_unknown_keys(spec, {"from_pretrained", "tokenizer", "config", "max_length"}, "t5")
    max_length = int(spec.get("max_length", 64))
    if spec.get("from_pretrained"):
        tokenizer, model = _load_pretrained(T5EncoderModel, spec["from_pretrained"], spec.get("tokenizer"), dtype)
    else:
        tokenizer = byte_tokenizer()
        config = T5Config(**{**TINY_T5_CONFIG, **(spec.get("config") or {})})
        _check_vocab(config.vocab_size, tokenizer, "t5")
        model = T5EncoderModel(config).to(dtype)
    return LoadedEncoder(tokenizer, model, max_length)


def load_clip(spec: dict, dtype: torch.dtype) -> LoadedEncoder:
    """spec as for ``load_t5``; max_length defaults to the model's position count (77 for real CLIP)."""
    from transformers import CLIPTextConfig, CLIPTextModel

    _reject_unknown_keys(spec, {"from_pretrained", "tokenizer", "config", "max_length"}, "clip")
    if spec.get("from_pretrained"):
        tokenizer, model = _load_pretrained(CLIPTextModel, spec["from_pretrained"], spec.get("tokenizer"), dtype)
        max_length = int(spec.get("max_length", model.config.max_position_embeddings))
    else:
        tokenizer = byte_tokenizer()
        max_length = int(spec.get("max_length", 77))
        overrides = dict(spec.get("config") or {})
        eos_id = overrides.setdefault("eos_token_id", tokenizer.eos_token_id)
        if eos_id != tokenizer.eos_token_id:
            # CLIP pools the hidden state at the first eos_token_id: any other id pools the wrong token.
            raise ValueError(
                f"clip config eos_token_id={eos_id} must be the tokenizer's EOS id {tokenizer.eos_token_id}"
            )
        overrides.setdefault("pad_token_id", tokenizer.pad_token_id)
        overrides.setdefault("bos_token_id", None)  # the byte tokenizer adds no BOS
        overrides.setdefault("max_position_embeddings", max_length)
        config = CLIPTextConfig(**{**TINY_CLIP_CONFIG, **overrides})
        _check_vocab(config.vocab_size, tokenizer, "clip")
        model = CLIPTextModel(config).to(dtype)
    if max_length > model.config.max_position_embeddings:
        raise ValueError(
            f"clip max_length={max_length} exceeds its max_position_embeddings={model.config.max_position_embeddings}"
        )
    return LoadedEncoder(tokenizer, model, max_length)


def _reject_unknown_keys(spec: dict, known: set, name: str) -> None:
    unknown = set(spec) - known
    if unknown:
        raise KeyError(f"unknown {name} option(s) {sorted(unknown)}; known: {sorted(known)}")
