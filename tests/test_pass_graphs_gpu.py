"""Pass graphs of the bidirectional sampler (``VideoSampler.set_cuda_graphs``, pass_graphs.py) on a GPU in bf16.

A replay runs the model's own forward on static copies of the inputs; the kernels picked inside a capture may differ
from eager ones (cuBLAS per stream/workspace), so graphed and eager latents are compared to bf16 tolerance (2% of
the latent scale, after 8 steps of CFG); the CPU plumbing is exact (tests/test_pass_graphs.py). Replays of one graph
are deterministic: two graphed videos are bitwise equal."""

import pytest
import torch
from test_causal_gpu import ARCH  # a small MMDiT (bidirectional here: no causal chunks)

from opensora.inference.sampler import VideoSampler
from opensora.models.mmdit import MMDiT
from opensora.registry import MODELS, build_module

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = ["a red circle moving left", "a blue square moving up"]


def make_sampler(seed=0) -> VideoSampler:
    torch.manual_seed(seed)
    model = MMDiT(**ARCH, attn_backend="auto")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    # PatchVAE(2): 3 x 2 x 2 = 12 latent channels; the demo's TextConditioner: text_dim 64, pooled_dim 64
    vae = build_module(dict(type="PatchVAE", patch_size=2, temporal_patch_size=1), MODELS)
    text = build_module(dict(type="TextConditioner", seed=0), MODELS)
    model = model.cuda().to(torch.bfloat16).eval()
    return VideoSampler(model, vae.cuda().to(torch.bfloat16).eval(), text.cuda().eval(), progress=False)


def latents(sampler, prompts=PROMPTS, **kwargs):
    _, out = sampler.generate(prompts, list(range(len(prompts))), 9, 32, 32, num_steps=8, return_latents=True, **kwargs)
    return out.float()


def test_graphed_sampling_matches_eager_in_bf16_and_replays_deterministically():
    sampler = make_sampler()
    eager = latents(sampler)
    sampler.set_cuda_graphs(True)
    graphed = latents(sampler)
    again = latents(sampler)
    summary = sampler.pass_graphs.summary
    assert summary["failures"] == [] and summary["eager"] == 0
    assert summary["captures"] == 1 and summary["replays"] == 16, summary
    assert torch.equal(graphed, again)
    err = (graphed - eager).abs().max().item()
    assert err <= 0.02 * eager.abs().max().item(), f"graphed vs eager max |diff| {err}"
    # new prompts through the same graph: the text buffers are reloaded
    other = ["a green triangle moving right", "a yellow circle moving down"]
    graphed_other = latents(sampler, other)
    sampler.set_cuda_graphs(False)
    eager_other = latents(sampler, other)
    assert (graphed_other - eager_other).abs().max() <= 0.02 * eager_other.abs().max()
    assert (graphed_other - graphed).abs().max() > 0.1 * eager.abs().max()  # really other prompts
