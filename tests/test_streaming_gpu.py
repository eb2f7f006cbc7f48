"""Streaming on a GPU: the merged refill pass and its CUDA graphs, the graphed chunk decode, and captures that leave
no memory behind. Skipped without CUDA."""

import gc

import pytest
import torch
from test_streaming import PROMPTS, tiny_sampler

from opensora.inference.streaming import StreamingGenerator

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def gpu_sampler():
    sampler = tiny_sampler()
    sampler.model.to("cuda")
    sampler.vae.to("cuda")
    sampler.device = torch.device("cuda")
    return sampler


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_merged_refill_with_graphs_matches_the_eager_separate_passes(guidance):
    sampler = gpu_sampler()
    kwargs = dict(step_list=[1.0, 0.5], guidance_scale=guidance, window_frames=4)
    reference = StreamingGenerator(sampler, **kwargs)
    graphed = StreamingGenerator(sampler, cuda_graphs=True, merge_refill=True, **kwargs)
    for _ in range(2):  # the second video replays the graphs the first captured
        a = list(reference.stream(PROMPTS, [0, 1], 12, 16, 16))
        b = list(graphed.stream(PROMPTS, [0, 1], 12, 16, 16))
        for x, y in zip(a, b):
            torch.testing.assert_close(y.latents, x.latents, rtol=1e-3, atol=1e-3)
            assert (x.frames.int() - y.frames.int()).abs().max() <= 1
    assert graphed.merged_graphs.summary["replays"] > 0 and not graphed.merged_graphs.failures
    assert graphed.decode_graphs.graphs and not graphed.decode_graphs.failures
    assert graphed.passes < reference.passes


def test_graph_captures_leave_no_memory_behind():
    """Generators with CUDA graphs, made and dropped one after another, do not leave allocated memory behind (a fresh
    capture stream per graph used to leave a cuBLAS workspace each time)."""
    sampler = gpu_sampler()
    kwargs = dict(step_list=[1.0, 0.5], window_frames=4, cuda_graphs=True, merge_refill=True)
    left = []
    for _ in range(3):
        gen = StreamingGenerator(sampler, **kwargs)
        list(gen.stream(PROMPTS, [0, 1], 12, 16, 16))
        del gen
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        left.append(torch.cuda.memory_allocated())
    assert left[2] - left[1] < 2**20 and left[1] - left[0] < 16 * 2**20  # a cuBLAS workspace is 32 MiB on Hopper
