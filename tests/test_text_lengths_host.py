"""The host-side text lengths a trainer hands the model (``FlowMatching.text_length_bound``): the tokenizer's
count equals the mask ``encode`` returns, for short, empty and over-long prompts, and the bound covers the null
text CFG dropout may swap in."""

from types import SimpleNamespace

import pytest
import torch

from opensora.methods.flow_matching import FlowMatching
from opensora.models.text.conditioner import TextConditioner

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py


def test_text_lengths_equal_the_mask_that_encode_returns():
    encoder = TextConditioner(seed=0, cache_size=0)
    prompts = ["a red circle moving left", "", "word " * (encoder.max_length + 20), "a blue square"]
    mask = encoder.encode(prompts)["text_mask"]
    assert encoder.text_lengths(prompts) == mask.sum(-1).tolist()
    assert encoder.text_lengths(prompts)[2] == encoder.max_length  # cut at the limit, as encode cuts it
    assert encoder.text_lengths("a blue square") == encoder.text_lengths(["a blue square"])


def test_text_lengths_of_encoded_prompts_are_remembered_not_tokenized_again(monkeypatch):
    encoder = TextConditioner(seed=0, cache_size=4)
    prompts = ["a red circle moving left", "a blue square moving up"]
    want = encoder.encode(prompts)["text_mask"].sum(-1).tolist()

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(encoder._t5_encoder, "tokenizer", no_tokenizing)
    assert encoder.text_lengths(prompts) == want


def test_a_left_padding_tokenizer_gives_no_counts_and_the_model_reads_the_mask_instead():
    """Left padding puts the valid tokens at the end of each row: a count is not where the text can be cut, so no
    host bound is given (the model's own check finds no prefix and cuts nothing)."""
    encoder = TextConditioner(seed=0, cache_size=0)
    encoder._t5_encoder.tokenizer.padding_side = "left"
    assert encoder.text_lengths(["a red circle moving left", "ab"]) is None
    method = _method(null_length=1, dropout=0.1, encoder=encoder)
    assert method.text_length_bound(dict(text=["a red circle moving left", "ab"])) is None


def _method(null_length: int, dropout: float, encoder=None):
    """A FlowMatching method's bound logic alone (no roles): its components and dropout."""
    method = FlowMatching.__new__(FlowMatching)
    null_mask = torch.zeros(1, 16, dtype=torch.bool)
    null_mask[:, :null_length] = True
    null = dict(text_emb=torch.zeros(1, 16, 4), text_mask=null_mask, pooled=torch.zeros(1, 3))
    object.__setattr__(method, "components", SimpleNamespace(text_encoder=encoder, null_text=null))
    object.__setattr__(method, "text_dropout", dropout)
    object.__setattr__(method, "_null_text_length", None)
    return method


def test_the_bound_is_the_longest_row_raised_to_the_null_text_under_dropout():
    """The cache path's bound is the last valid column (its rows are prefixes, so the longest row's count), raised to
    the null text's length when dropout may swap it in; no mask gives no bound."""
    mask = torch.zeros(3, 16, dtype=torch.bool)
    for row, length in enumerate((3, 9, 5)):
        mask[row, :length] = True
    cached = dict(text_emb=torch.zeros(3, 16, 4), text_mask=mask)
    assert _method(null_length=2, dropout=0.1).text_length_bound(cached) == 9
    assert _method(null_length=12, dropout=0.1).text_length_bound(cached) == 12  # a dropped row may be longer
    assert _method(null_length=12, dropout=0.0).text_length_bound(cached) == 9  # no dropout, no null rows
    assert _method(null_length=2, dropout=0.1).text_length_bound(dict(text_emb=cached["text_emb"])) is None
    suffix = torch.zeros(2, 16, dtype=torch.bool)
    suffix[0, 10:], suffix[1, 14:] = True, True  # not prefixes: the cut must keep the last valid column
    assert (
        _method(null_length=1, dropout=0.1).text_length_bound(dict(text_emb=cached["text_emb"], text_mask=suffix)) == 16
    )
    encoder = TextConditioner(seed=0, cache_size=0)
    prompts = ["a red circle moving left", "a blue square"]
    longest = max(encoder.encode(prompts)["text_mask"].sum(-1).tolist())
    assert _method(null_length=1, dropout=0.1, encoder=encoder).text_length_bound(dict(text=prompts)) == longest
