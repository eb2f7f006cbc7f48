"""``MMDiT(checkpoint_in_graph=True)``, the default: with compiled blocks, each checkpointed block call is compiled as
one graph whose recompute lives in the compiled backward (graph_checkpoint.py). Against ``checkpoint_in_graph=False``
(``torch.utils.checkpoint`` around the compiled block), on padded text with zero keys, full and selective
checkpointing: the same output and gradients (CPU fp32), the same activations kept for the backward (parameters are
kept by reference and not counted), and one compiled graph per block kind and shape regime however many blocks share
it. The GPU test compares the two in bf16 at head size 128, with peak memory. On a host with a GPU the around path
initialises CUDA before its checkpoint (``MMDiT.run_block``): simulated on CPU, and met for real by the first test
when this file runs alone on a GPU machine (CUDA not yet initialised when its first block compiles)."""

import copy

import pytest
import torch
import torch._dynamo
from test_text_padding import padded_batch, perturb, tiny_kwargs

from opensora.models.mmdit.graph_checkpoint import checkpointed_in_graph

pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py


def step(model, data):
    """Output and every gradient of one training step; the non-parameter bytes saved for the backward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = []

    def pack(t):
        saved.append(0 if t.untyped_storage().data_ptr() in params else t.numel() * t.element_size())
        return t

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**data, text_mask_has_padding=True)
    out.float().pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads, sum(saved)


def test_the_recompute_in_the_graph_equals_checkpointing_around_the_compiled_block():
    """Selective checkpointing (the first double and the first two single blocks) runs both paths in one model: the
    checkpointed blocks in the graph, the others as plain compiled blocks."""
    from opensora.models.mmdit import MMDiT

    torch._dynamo.reset()
    base = MMDiT(**tiny_kwargs(text_length_multiple=32, depth_double=2, depth_single=3)).train()
    perturb(base)
    models = {}
    for name, in_graph in (("around", False), ("in-graph", True), ("none", False)):
        model = copy.deepcopy(base)
        model.checkpoint_in_graph = in_graph
        model.set_grad_ckpt(*((1, 2) if name != "none" else (0, 0)))
        model.set_compile_blocks(name != "none")  # the reference for what no checkpointing keeps: eager blocks
        models[name] = model
    graphs = []
    for lengths in ([5, 37], [3, 60], [5, 37]):  # fresh trims: one static, then one dynamic, graph per kind
        data = padded_batch(lengths)
        results = {name: step(model, data) for name, model in models.items()}
        out, grads, saved = results["in-graph"]
        ref_out, ref_grads, ref_saved = results["around"]
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
        for name, grad in ref_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
        # what the backward keeps: the blocks' inputs, as torch.utils.checkpoint keeps; far from keeping everything
        assert saved <= 1.25 * ref_saved and saved < 0.5 * results["none"][2]
        graphs.append(
            sum(len(torch._dynamo.eval_frame._debug_get_cache_entry_list(fn.__code__)) for fn in in_graph_functions())
        )
    assert graphs[-1] == graphs[-2] and graphs[-1] <= 4  # two kinds x (first length, dynamic); nothing per block


def in_graph_functions():
    from opensora.models.mmdit import graph_checkpoint

    return [graph_checkpoint._checkpointed_double, graph_checkpoint._checkpointed_single]


def test_checkpointing_around_a_compiled_block_initialises_cuda_before_the_checkpoint(monkeypatch):
    """On a host with a GPU, a block's first compile initialises CUDA (Dynamo reads the CUDA RNG state), and inside a
    non-reentrant checkpoint over CPU tensors torch refuses that ("device state was initialized in the forward pass of
    a Checkpoint"): CPU training there with ``checkpoint_in_graph=False`` failed at its first step. Simulated without a
    GPU or a compile: CUDA "available", each block call standing in for the compiled call that initialises it."""
    import opensora.models.mmdit.model as model_module
    from opensora.models.mmdit import MMDiT

    def fake_cuda_host():
        # checkpointing over CPU tensors takes the device module of the host's accelerator: CUDA's there
        monkeypatch.setattr(torch.utils.checkpoint.DefaultDeviceType, "_default_device_type", "cuda")
        monkeypatch.setattr(torch.cuda, "_initialized", False)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: torch.cuda._initialized)
        monkeypatch.setattr(torch.cuda, "init", lambda: setattr(torch.cuda, "_initialized", True))

    def compiled_call(block):  # what block.compile() leaves, minus the compile
        def call(*args):
            torch.cuda._initialized = True
            return block.forward(*args)

        return call

    model = MMDiT(**tiny_kwargs(depth_double=1, depth_single=1, checkpoint_in_graph=False)).train()
    model.set_grad_ckpt(1, 1)
    for block in [*model.double_blocks, *model.single_blocks]:
        block._compiled_call_impl = compiled_call(block)
    model.compile_blocks = True
    data = padded_batch([5, 37])
    fake_cuda_host()
    model(**data).pow(2).mean().backward()
    assert torch.cuda._initialized

    fake_cuda_host()  # the failure the guard prevents
    monkeypatch.setattr(model_module, "init_cuda_before_checkpointed_compile", lambda: None)
    with pytest.raises(RuntimeError, match="device state was initialized in the forward pass"):
        model(**data)


def test_an_unknown_block_kind_is_refused():
    with pytest.raises(ValueError, match="kind"):
        checkpointed_in_graph("triple", {})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_the_recompute_in_the_graph_matches_and_keeps_the_memory_of_checkpointing():
    from test_text_padding_gpu import gpu_model
    from test_text_padding_gpu import padded_batch as gpu_batch

    torch._dynamo.reset()
    models = {}
    for in_graph in (False, True):
        model = gpu_model(grad_ckpt_double=2, grad_ckpt_single=2)
        model.checkpoint_in_graph = in_graph
        model.set_compile_blocks(True)
        models[in_graph] = model
    data = {k: v.to(torch.bfloat16) if v.is_floating_point() and k != "timestep" else v
            for k, v in gpu_batch([40, 170, 90, 7], frames=8).items()}  # fmt: skip
    results, peaks = {}, {}
    for in_graph, model in models.items():
        step(model, data)  # compile
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        results[in_graph] = step(model, data)
        torch.cuda.synchronize()
        peaks[in_graph] = torch.cuda.max_memory_allocated() - before
    (out, grads, _), (ref_out, ref_grads, _) = results[True], results[False]
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=2e-2, atol=2e-2)
    for name, grad in ref_grads.items():
        scale = grad.float().abs().max().clamp_min(1e-6)
        assert (grads[name].float() - grad.float()).abs().max() / scale < 0.05, name
    assert peaks[True] <= 1.15 * peaks[False], peaks
