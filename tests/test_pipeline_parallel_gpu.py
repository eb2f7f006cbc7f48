"""Two-GPU pipeline overlap: every chunk bit-identical (max |diff| == 0) to single-GPU streaming, for every overlap
mode, on repeated runs, in bf16 with the GPU attention kernels. Needs 2 CUDA devices (skipped otherwise)."""

import copy

import pytest
import torch

from opensora.inference.pipeline_parallel import OVERLAP_MODES, Lanes, run_plan
from opensora.inference.pipeline_stages import (
    BidirectionalStages,
    CausalStreamingStages,
    place_model,
    sample_microbatched,
    stream_reference,
)
from opensora.models.mmdit.configs import mmdit_config
from opensora.registry import MODELS, build_module

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]
DEVICES = ["cuda:0", "cuda:1"]
REPEATS = 3


def gpu_model(causal_chunk_frames):
    torch.manual_seed(0)
    cfg = mmdit_config("tiny", cond_channels=None, in_channels=16, hidden_size=512, num_heads=4, depth_double=2,
                       depth_single=4, axes_dims=(16, 56, 56), causal_chunk_frames=causal_chunk_frames)
    model = build_module(cfg, MODELS)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.03)
    return model.to("cuda:0", torch.bfloat16).eval().requires_grad_(False)


def text(batch, length, seed, masked):
    g = torch.Generator().manual_seed(seed)
    mask = None
    if masked:
        mask = torch.ones(batch, length, dtype=torch.bool)
        mask[:, -3:] = False
    return dict(text_emb=torch.randn(batch, length, 64, generator=g), text_mask=mask,
                pooled=torch.randn(batch, 64, generator=g))


def decode(x):
    return (x * 20).round().clamp(-100, 100).to(torch.int8)


CASES = [
    # (groups, branches, steps, refill, window_frames)
    (1, 1, [1.0], True, None),
    (1, 1, [1.0], False, None),
    (2, 2, [1.0, 0.6, 0.3], True, None),
    (2, 1, [1.0, 0.5], False, 4),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"g{c[0]}b{c[1]}s{len(c[2])}{'r' if c[3] else ''}")
def test_two_gpu_streaming_is_bit_identical_to_one_gpu(case):
    num_groups, num_branches, steps, refill, window = case
    model = gpu_model(causal_chunk_frames=2)
    groups = [dict(seeds=[5 + g, 9 + g], branches=[text(2, 16, 7 * g + b, masked=b == 0) for b in range(num_branches)])
              for g in range(num_groups)]
    chunk_shape, num_chunks = (16, 2, 16, 16), 4
    kw = dict(refill=refill, rule="renoise", guidance_scale=4.0, decode=decode, window_frames=window)
    refs = [stream_reference(model, g, chunk_shape, num_chunks, steps, device="cuda:0", **kw) for g in groups]
    assert all(torch.isfinite(lat).all() for ref in refs for lat in ref[0])
    pp = copy.deepcopy(model)
    split = 2  # the double -> single hand-over happens on GPU1
    place_model(pp, split, DEVICES)
    for mode in OVERLAP_MODES:
        for run in range(REPEATS):
            lanes = Lanes(DEVICES, profile=run == 0)
            stages = CausalStreamingStages(pp, lanes, split, groups, chunk_shape, num_chunks, steps, **kw)
            result, _ = run_plan(stages, mode, lanes)
            for g, (latents, frames) in enumerate(refs):
                for c in range(num_chunks):
                    diff = (result.latents[(g, c)] - latents[c].cpu()).abs().max().item()
                    assert diff == 0, (mode, run, g, c, diff)
                    assert torch.equal(result.frames[(g, c)], frames[c].cpu()), (mode, run, g, c)


def test_two_gpu_bidirectional_cfg_is_bit_identical_to_one_gpu_microbatches():
    model = gpu_model(causal_chunk_frames=0)
    groups = [dict(seeds=[3 + g], branches=[text(1, 16, g, masked=True), text(1, 16, 99, masked=False)])
              for g in range(2)]
    shape, times, scale = (16, 4, 16, 16), [1.0, 0.8, 0.5, 0.2, 0.0], 5.0
    refs = [sample_microbatched(model, g, shape, times, scale, "cuda:0", decode) for g in groups]
    pp = copy.deepcopy(model)
    split = 1
    place_model(pp, split, DEVICES)
    for mode in OVERLAP_MODES:
        for run in range(REPEATS):
            lanes = Lanes(DEVICES)
            stages = BidirectionalStages(pp, lanes, split, groups, shape, times, scale, decode=decode)
            result, _ = run_plan(stages, mode, lanes)
            for g, (x0, frames) in enumerate(refs):
                assert torch.equal(result.latents[(g, 0)], x0.cpu()), (mode, run, g)
                assert torch.equal(result.frames[(g, 0)], frames.cpu()), (mode, run, g)
