"""TextConditioner: tiny offline T5 + CLIP, checked against the transformers models it wraps."""

import pytest
import torch

from opensora.models.text import TextConditioner
from opensora.registry import MODELS, build_module

PROMPTS = ["a red ball rolls left", "", "two squares"]
MAX_LENGTH = 24


@pytest.fixture(scope="module")
def conditioner():
    return TextConditioner(t5=dict(max_length=MAX_LENGTH), seed=0)


def _byte_count(text):
    return len(text.encode("utf-8"))


def test_shapes_dtypes_and_attributes(conditioner):
    out = conditioner.encode(PROMPTS)
    assert conditioner.max_length == MAX_LENGTH
    assert out["text_emb"].shape == (3, MAX_LENGTH, conditioner.text_dim)
    assert out["text_mask"].shape == (3, MAX_LENGTH)
    assert out["text_mask"].dtype == torch.bool
    assert out["pooled"].shape == (3, conditioner.pooled_dim)
    assert out["text_emb"].dtype == out["pooled"].dtype == torch.float32
    assert conditioner.text_dim == conditioner.t5.config.d_model
    assert conditioner.pooled_dim == conditioner.clip.config.hidden_size


def test_mask_marks_bytes_plus_eos_and_zero_padding(conditioner):
    mask = conditioner.encode(PROMPTS)["text_mask"]
    for row, prompt in zip(mask, PROMPTS):
        n_real = _byte_count(prompt) + 1  # every byte is a token, then EOS
        assert row[:n_real].all()
        assert not row[n_real:].any()


def test_long_prompt_is_truncated_and_keeps_eos(conditioner):
    long_prompt = "x" * 200
    out = conditioner.encode([long_prompt])
    assert out["text_mask"].all()
    tokenizer = conditioner._clip_encoder.tokenizer
    ids = tokenizer([long_prompt], padding="max_length", max_length=conditioner.clip_max_length, truncation=True)
    assert ids["input_ids"][0][-1] == tokenizer.eos_token_id


def test_same_seed_same_outputs_and_global_rng_untouched():
    torch.manual_seed(123)
    expected_draw = torch.rand(4)
    torch.manual_seed(123)
    a = TextConditioner(t5=dict(max_length=MAX_LENGTH), seed=7, cache_size=0)
    b = TextConditioner(t5=dict(max_length=MAX_LENGTH), seed=7, cache_size=0)
    assert torch.equal(torch.rand(4), expected_draw)
    out_a, out_b = a.encode(PROMPTS), b.encode(PROMPTS)
    for key in out_a:
        assert torch.equal(out_a[key], out_b[key]), key
    other = TextConditioner(t5=dict(max_length=MAX_LENGTH), seed=8).encode(PROMPTS)
    assert not torch.allclose(other["pooled"], out_a["pooled"])


def test_null_embeddings_equal_encode_of_empty_prompt(conditioner):
    uncached = TextConditioner(t5=dict(max_length=MAX_LENGTH), seed=0, cache_size=0)
    reference = uncached.encode([""])
    null = conditioner.null_embeddings(4)
    for key in reference:
        assert null[key].shape[0] == 4
        for i in range(4):
            assert torch.equal(null[key][i], reference[key][0]), key


def test_different_prompts_give_different_embeddings(conditioner):
    out = conditioner.encode(["a circle", "a square"])
    assert not torch.allclose(out["text_emb"][0], out["text_emb"][1])
    assert not torch.allclose(out["pooled"][0], out["pooled"][1])


def test_pooled_is_clip_state_at_the_eos_token(conditioner):
    tokenizer = conditioner._clip_encoder.tokenizer
    assert conditioner.clip.config.eos_token_id == tokenizer.eos_token_id == 1
    pooled = conditioner.encode(PROMPTS)["pooled"]
    tokens = tokenizer(
        PROMPTS, padding="max_length", max_length=conditioner.clip_max_length, truncation=True, return_tensors="pt"
    )
    with torch.no_grad():
        hidden = conditioner.clip(**tokens).last_hidden_state  # already final-layer-normed
    for i, prompt in enumerate(PROMPTS):
        eos_position = _byte_count(prompt)
        torch.testing.assert_close(pooled[i], hidden[i, eos_position], rtol=0, atol=0)


def test_wrong_clip_eos_id_is_rejected():
    with pytest.raises(ValueError, match="eos_token_id"):
        TextConditioner(clip=dict(config=dict(eos_token_id=2)))


def test_unknown_option_names_itself():
    with pytest.raises(KeyError, match="max_len"):
        TextConditioner(t5=dict(max_len=8))


def test_cache_returns_same_values_and_stays_bounded():
    conditioner = TextConditioner(t5=dict(max_length=MAX_LENGTH), cache_size=2)
    first = conditioner.encode(["a", "b"])
    again = conditioner.encode(["b", "a"])
    assert torch.equal(first["pooled"][0], again["pooled"][1])
    conditioner.encode(["c"])
    assert list(conditioner._cache) == ["a", "c"]  # "b" was least recently used


def test_frozen(conditioner):
    assert not any(p.requires_grad for p in conditioner.parameters())
    conditioner.train()
    assert not conditioner.training and not conditioner.t5.training and not conditioner.clip.training
    with torch.enable_grad():
        out = conditioner.encode(["grad?"])
    assert out["text_emb"].grad_fn is None and out["pooled"].grad_fn is None


def test_bf16():
    out = TextConditioner(t5=dict(max_length=8), clip=dict(max_length=8), dtype="bf16").encode(["hi"])
    assert out["text_emb"].dtype == out["pooled"].dtype == torch.bfloat16


def test_built_from_registry():
    conditioner = build_module(dict(type="TextConditioner", t5=dict(max_length=8), clip=dict(max_length=8)), MODELS)
    assert isinstance(conditioner, TextConditioner)
    assert conditioner.encode(["x"])["text_emb"].shape == (1, 8, conditioner.text_dim)


def test_loads_saved_pretrained_dirs(conditioner, tmp_path):
    t5_dir, clip_dir = tmp_path / "t5", tmp_path / "clip"
    conditioner.t5.save_pretrained(t5_dir)
    conditioner._t5_encoder.tokenizer.save_pretrained(t5_dir)
    conditioner.clip.save_pretrained(clip_dir)
    conditioner._clip_encoder.tokenizer.save_pretrained(clip_dir)
    loaded = TextConditioner(
        t5=dict(from_pretrained=str(t5_dir), max_length=MAX_LENGTH),
        clip=dict(from_pretrained=str(clip_dir)),
        seed=99,  # ignored for pretrained weights
    )
    assert loaded.clip_max_length == conditioner.clip_max_length
    expected, actual = conditioner.encode(PROMPTS), loaded.encode(PROMPTS)
    for key in expected:
        assert torch.equal(expected[key], actual[key]), key
