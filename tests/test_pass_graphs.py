"""The bidirectional sampler's pass graphs (``VideoSampler.set_cuda_graphs``, pass_graphs.py) on a CPU: with the
capture swapped for an eager re-run of the captured body, the static-buffer plumbing (inputs copied per step, text
copied only when it changes, the velocity cloned out of the shared buffer) gives the eager videos bit for bit, one
"graph" per pass shape, and the cases a graph cannot take run eagerly."""

import pytest
import torch
from test_streaming import PROMPTS, random_causal_checkpoint, tiny_sampler

from opensora.inference.pass_graphs import PassGraphs
from opensora.inference.sampler import VideoSampler

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py


class EagerReplay(PassGraphs):
    """``PassGraphs`` whose "capture" runs the body once and whose replay runs it again (no CUDA needed)."""

    @staticmethod
    def usable(x):
        return True

    def _record(self, body):
        body()
        return body, None


def sampler(seed=0) -> VideoSampler:
    """The streaming tests' tiny sampler with a bidirectional model (no causal chunks)."""
    return tiny_sampler(seed, causal_chunk_frames=0)


def videos(s, prompts=PROMPTS, frames=4, size=16, **kwargs):
    return s.generate(prompts, list(range(len(prompts))), frames, size, size, num_steps=3, **kwargs)


def test_graphed_passes_give_the_eager_videos_bitwise_and_are_reused_across_videos():
    s = sampler()
    eager = videos(s)
    s.pass_graphs = EagerReplay()
    first = videos(s)
    assert torch.equal(first, eager)
    assert s.pass_graphs.summary == dict(graphs=1, captures=1, replays=3, eager=0, failures=[])
    # other prompts, same shapes: the same graph, its text buffers reloaded (a stale copy would change the video)
    other = ["a green triangle moving right", "a yellow circle moving down"]
    s.pass_graphs, graphs = None, s.pass_graphs
    reference = videos(s, other)
    s.pass_graphs = graphs
    assert torch.equal(videos(s, other), reference)
    assert graphs.captures == 1 and graphs.replays == 6
    # another shape (one prompt, CFG off: batch 1): a second graph; the first one still replays
    single = videos(s, PROMPTS[:1], guidance_scale=1.0)
    s.pass_graphs = None
    assert torch.equal(single, videos(s, PROMPTS[:1], guidance_scale=1.0))
    assert graphs.captures == 2 and len(graphs.graphs) == 2


def test_weights_moved_to_new_tensors_get_a_new_graph():
    s = sampler()
    s.pass_graphs = graphs = EagerReplay()
    videos(s)
    # same values in new parameter tensors; the old ones are kept alive so the allocator cannot hand their addresses
    # back (an address reused for the new weights would be read correctly by a real graph anyway)
    old = [p.data for p in s.model.parameters()]
    s.model.to(torch.float64).to(torch.float32)
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(s.model.parameters(), old))
    assert torch.equal(videos(s), videos(sampler()))
    assert graphs.captures == 2


def test_passes_a_graph_cannot_take_run_eagerly():
    s = sampler()
    graphs = EagerReplay()
    x = torch.randn(2, 48, 2, 8, 8)
    text, _ = s.encode_text(PROMPTS)
    args = dict(timestep=torch.full((2,), 0.5), text_emb=text["text_emb"], pooled=text["pooled"])
    with torch.no_grad():
        # unknown padding: the model would read the mask on the host, which a capture cannot do
        graphs(s.model, x, text_mask=text["text_mask"], text_mask_has_padding=None, **args)
        assert (graphs.eager, graphs.captures) == (1, 0)
        graphs(s.model, x, text_mask=text["text_mask"], text_mask_has_padding=True, **args)
        assert graphs.captures == 1
    with torch.enable_grad():  # training: never graphed
        graphs(s.model, x, text_mask=text["text_mask"], text_mask_has_padding=True, **args)
    assert graphs.eager == 2


def test_a_failed_capture_leaves_that_shape_eager_with_the_reason():
    class Failing(EagerReplay):
        def _record(self, body):
            raise RuntimeError("capture refused")

    s = sampler()
    eager = videos(s)
    s.pass_graphs = Failing()
    with pytest.warns(UserWarning, match="capture refused"):
        out = videos(s)
    assert torch.equal(out, eager)
    assert s.pass_graphs.captures == 0 and s.pass_graphs.eager == 3 and "capture refused" in s.pass_graphs.failures[0]


def test_set_cuda_graphs_is_a_no_op_off_the_gpu():
    s = sampler()
    s.set_cuda_graphs(True)
    assert s.pass_graphs is None


def test_cli_refuses_an_unknown_cuda_graphs_choice_and_takes_the_known_ones_on_a_cpu(tmp_path):
    from opensora.cli_errors import UserInputError
    from opensora.inference import cli

    config, ckpt = random_causal_checkpoint(tmp_path)
    common = [str(config), "--ckpt", str(ckpt), "--device", "cpu", "--num-steps", "2", "--num-frames", "4"]
    with pytest.raises(UserInputError, match="--cuda-graphs must be one of auto, on, off"):
        cli.main([*common, "--cuda-graphs", "maybe"])
    paths = cli.main([*common, "--cuda-graphs", "on", "--save-dir", str(tmp_path / "out"), "--prompt", "a red circle"])
    assert len(paths) == 1  # on a CPU "on" samples eagerly
