"""Padded prompts on the GPU in bf16 (head size 128): the trimmed text with ``PackedRows`` (flash variable-length
attention) or ``KeyRanges`` (cuDNN per row) is as close to the fp32 masked reference as the old bf16 dense-mask path,
on the output and every gradient, eager and with compiled blocks (no, full and selective checkpointing), for a LoRA
network and for the causal student; and a stream of batches with fresh prompt lengths settles on a few compiled graphs,
at batch 4 and at batch 1 (exact trim)."""

import copy

import pytest
import torch
from test_text_padding import dense_masked_forward

from opensora.models.mmdit import MMDiT, mmdit_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
TEXT_DIM, POOLED_DIM, TEXT_LEN = 64, 16, 300


def gpu_model(dtype=torch.bfloat16, **overrides):
    cfg = mmdit_config(
        "tiny",
        hidden_size=256,
        num_heads=2,  # head size 128, as in the 1B and 11B presets
        axes_dims=(32, 48, 48),
        depth_double=2,
        depth_single=2,
        text_dim=TEXT_DIM,
        pooled_dim=POOLED_DIM,
        in_channels=4,
        cond_channels=None,
    )
    cfg.pop("type")
    cfg.update(overrides)
    model = MMDiT(**cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.cuda().to(dtype).train()


def padded_batch(lengths, seed=1, frames=4):
    gen = torch.Generator().manual_seed(seed)
    size = len(lengths)
    data = dict(
        x=torch.randn(size, 4, frames, 16, 16, generator=gen),
        timestep=torch.rand(size, generator=gen),
        text_emb=torch.randn(size, TEXT_LEN, TEXT_DIM, generator=gen),
        pooled=torch.randn(size, POOLED_DIM, generator=gen),
    )
    data = {k: v.cuda() for k, v in data.items()}
    data["text_mask"] = (torch.arange(TEXT_LEN)[None] < torch.tensor(lengths)[:, None]).cuda()
    return data


def cast(data, dtype):
    return {k: v.to(dtype) if v.is_floating_point() and k != "timestep" else v for k, v in data.items()}


def loss_and_grads(model, out):
    loss = out.float().square().mean()
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return loss.detach(), {n: g.float() for n, g in zip(names, grads)}


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def compare_to_fp32_masked(model_bf16, data, reference, baseline):
    """Errors of the model's own forward (trim + PackedRows / KeyRanges) against the fp32 reference must stay within twice
    those of the bf16 dense-mask baseline (plus a small floor): the new path may not be less accurate."""
    out = model_bf16(**cast(data, torch.bfloat16))
    loss, grads = loss_and_grads(model_bf16, out)
    ref_out, ref_loss, ref_grads = reference
    base_out, base_grads = baseline
    assert torch.isfinite(out).all()
    assert rel(out, ref_out) <= 2 * rel(base_out, ref_out) + 2e-3
    assert abs(loss.item() - ref_loss.item()) <= 2e-2 * abs(ref_loss.item())
    for name, ref in ref_grads.items():
        assert torch.isfinite(grads[name]).all(), name
        limit = 2 * rel(base_grads[name], ref) + 5e-3
        assert rel(grads[name], ref) <= limit, f"{name}: {rel(grads[name], ref):.3g} > {limit:.3g}"


@pytest.fixture(scope="module")
def references():
    """fp32 masked reference and the bf16 dense-mask baseline for one padded batch (lengths 20, 77, 120, 3)."""
    data = padded_batch([20, 77, 120, 3])
    fp32 = gpu_model(torch.float32)
    out = dense_masked_forward(fp32, data)
    reference = (out.detach(), *loss_and_grads(fp32, out))
    bf16 = gpu_model()
    base = dense_masked_forward(bf16, cast(data, torch.bfloat16))
    baseline = (base.detach(), loss_and_grads(bf16, base)[1])
    return data, reference, baseline


@pytest.mark.parametrize(
    "compiled, ckpt, how",
    [(False, 0, "dense"), (True, 0, "dense"), (True, 2, "dense"), (True, 1, "dense"), (False, 0, "packed"),
     (True, 2, "packed"), (True, 1, "packed"), (False, 0, "rows"), (True, 2, "rows"), (False, 0, "flex"),
     (True, 0, "flex"), (True, 2, "flex"), (True, 1, "flex"), (False, 0, "bias-channel"), (True, 2, "bias-channel"),
     (True, 1, "bias-channel"), (False, 0, "zero-keys"), (True, 0, "zero-keys"), (True, 2, "zero-keys"),
     (True, 1, "zero-keys")],
)  # fmt: skip
def test_padded_text_in_bf16_is_as_close_to_the_fp32_masked_reference_as_the_masked_path(
    references, compiled, ckpt, how
):
    data, reference, baseline = references
    model = gpu_model(grad_ckpt_double=ckpt, grad_ckpt_single=ckpt, padded_text_attention=how)  # ckpt 1: selective
    model.set_compile_blocks(compiled)
    compare_to_fp32_masked(model, data, reference, baseline)


@pytest.mark.parametrize("ckpt, how", [(2, "zero-keys"), (1, "zero-keys"), (2, "dense")])
def test_checkpointing_around_the_compiled_block_is_as_close_to_the_fp32_masked_reference(references, ckpt, how):
    """``checkpoint_in_graph=False``: ``torch.utils.checkpoint`` around each compiled block (the test above runs the
    default, each checkpointed call one graph with its recompute inside, graph_checkpoint.py)."""
    data, reference, baseline = references
    model = gpu_model(
        grad_ckpt_double=ckpt, grad_ckpt_single=ckpt, padded_text_attention=how, checkpoint_in_graph=False
    )
    model.set_compile_blocks(True)
    compare_to_fp32_masked(model, data, reference, baseline)


@pytest.mark.parametrize("how", ["packed", "flex", "bias-channel", "zero-keys"])
def test_packed_flash_and_flex_attention_with_a_row_that_fills_the_trimmed_text(how):
    """Lengths 64, 10, 64: trimmed to 64 (multiples of 32), so rows 0 and 2 have an empty padding run (a zero-length sequence for the
    variable-length flash kernel; no padded key block for flex)."""
    data = padded_batch([64, 10, 64])
    fp32 = gpu_model(torch.float32)
    out = dense_masked_forward(fp32, data)
    reference = (out.detach(), *loss_and_grads(fp32, out))
    bf16 = gpu_model()
    base = dense_masked_forward(bf16, cast(data, torch.bfloat16))
    packed = gpu_model(padded_text_attention=how, text_length_multiple=32)
    compare_to_fp32_masked(packed, data, reference, (base.detach(), loss_and_grads(bf16, base)[1]))


@pytest.mark.parametrize("backend", ["cudnn", "flash"])
def test_zero_key_kernels_equal_the_fp32_masked_attention(backend):
    """The zero-key path at the real configuration's attention shape (head 128, 2304 video + 128 text tokens, 20-120
    valid) on each kernel: output and q/k/v gradients as close to the fp32 masked attention as bf16 masked SDPA is;
    this also pins the kernels' log-sum-exp convention (natural log, over the scaled scores) that the correction
    relies on."""
    from opensora.models.mmdit.attention import attention
    from opensora.models.mmdit.zero_key_attention import ZeroKeyRows, zero_key_kernel

    if backend == "cudnn" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("cuDNN attention is the zero-key kernel on sm90+")
    lengths, num_text, num_video = [20, 77, 120, 3], 128, 2304
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(4, 2, num_text + num_video, 128, generator=gen).cuda() for _ in range(3))
    rows = ZeroKeyRows(lengths, num_text, num_video, "cuda")
    leaves32 = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = attention(*leaves32, rows.dense(num_text + num_video, "cuda"), "math")
    grad = torch.randn(ref.shape, generator=gen).cuda()
    ref_grads = torch.autograd.grad(ref, leaves32, grad)
    results = {}
    for how in (rows, rows.dense(num_text + num_video, "cuda")):
        leaves = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
        out = attention(*leaves, how, backend if how is rows else "auto")
        results[how is rows] = (out, torch.autograd.grad(out, leaves, grad.to(torch.bfloat16)))
    assert zero_key_kernel(q.to(torch.bfloat16), backend) == backend
    (out, grads), (base_out, base_grads) = results[True], results[False]
    assert rel(out, ref) <= 2 * rel(base_out, ref) + 1e-3, (rel(out, ref), rel(base_out, ref))
    for name, got, base, want in zip("qkv", grads, base_grads, ref_grads):
        assert torch.isfinite(got).all(), name
        assert rel(got, want) <= 2 * rel(base, want) + 2e-3, (name, rel(got, want), rel(base, want))


@pytest.mark.parametrize("zero_keys_first", [False, True])
def test_zero_key_and_plain_cudnn_backwards_at_one_shape_in_one_process_are_both_right(zero_keys_first):
    """PyTorch caches cuDNN's attention backward graph by the q / k / v layout alone, keeping the grad_out strides of
    the call that built it. The zero-key path and plain SDPA at the same shape must therefore hand grad_out in one
    layout, or whichever runs second gets wrong gradients silently (0.63 relative error in a weight gradient on an
    H200 before ``cudnn_grad_layout``). Both orders, each at a token count no other test uses, against fp32 math."""
    from opensora.models.mmdit.attention import attention
    from opensora.models.mmdit.zero_key_attention import ZeroKeyRows

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("cuDNN attention is the zero-key kernel on sm90+")
    num_text, num_video = 24, 200 if zero_keys_first else 264  # a shape of its own per order: a fresh cache entry
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 2, num_text + num_video, 128, generator=gen).cuda() for _ in range(3))
    grad = torch.randn(2, num_text + num_video, 256, generator=gen).cuda()  # attention()'s [B, N, heads * D]
    rows = ZeroKeyRows([24, 9], num_text, num_video, "cuda")

    def grads(mask, backend, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = attention(*leaves, mask, backend)
        return torch.autograd.grad(out, leaves, grad.to(dtype))

    dense = rows.dense(num_text + num_video, "cuda")
    runs = [("zero-keys", rows), ("plain", None)]
    for name, mask in runs[:: 1 if zero_keys_first else -1]:
        got = grads(mask, "cudnn", torch.bfloat16)
        want = grads(dense if mask is not None else None, "math", torch.float32)
        base = grads(dense if mask is not None else None, "math", torch.bfloat16)  # bf16's own error: the yardstick
        for axis, g, w, b in zip("qkv", got, want, base):
            assert rel(g, w) <= 2 * rel(b, w) + 2e-3, (name, axis, rel(g, w), rel(b, w))


def test_a_stream_of_fresh_prompt_lengths_settles_on_a_few_graphs_and_matches_eager():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()  # reset() keeps the counters: earlier tests' graphs would count here (33 after this file's others)
    eager = gpu_model(grad_ckpt_double=2, grad_ckpt_single=2)
    compiled = copy.deepcopy(eager)
    compiled.set_compile_blocks(True)
    gen = torch.Generator().manual_seed(5)
    graphs = []
    for step in range(7):
        lengths = torch.randint(20, 121, (4,), generator=gen).tolist()
        if step == 3:
            lengths[1] = 1  # the null prompt of text dropout: one valid token
        data = cast(padded_batch(lengths, seed=step), torch.bfloat16)
        got = loss_and_grads(compiled, compiled(**data))
        want = loss_and_grads(eager, eager(**data))
        assert abs(got[0].item() - want[0].item()) <= 1e-2 * abs(want[0].item())
        for name, ref in want[1].items():
            assert rel(got[1][name], ref) < 5e-2, (step, name)
        graphs.append(counters["stats"]["unique_graphs"])
    print("unique graphs after each step:", graphs)
    # bounded: each trimmed length (a multiple of 32 up to 128) compiles at most once before the text length turns
    # symbolic (an H200 gave [6, 6, 6, 6, 6, 6, 8] with the packed path: a new trimmed length at the last step)
    assert graphs[-1] <= 10, graphs


@pytest.mark.parametrize("in_graph", [False, True], ids=["ckpt_around", "ckpt_in_graph"])
def test_batch_1_prompts_from_a_pinning_loader_compile_few_graphs_and_match_eager(in_graph):
    """Batch 1 (the case whose compiled backward once failed in Inductor) is cut to exactly its valid text, so it runs
    without a mask or per-row calls: fresh lengths cost one symbolic recompile (plus one graph for the one-token null
    prompt), not one graph per length. The lengths come through a DataLoader with ``pin_memory``, whose pin thread
    sets the process-wide thread count to 1; with checkpointing around the compiled block (``in_graph`` False) the
    blocks' recompute runs on the autograd device thread, so without ``model.call_with_thread_count`` the blocks
    recompile there ("GLOBAL_STATE changed: num_threads"); the default (``in_graph``) recomputes inside the compiled
    backward, which no guard checks. Run alone (a fresh process, the around case first) to see that case: the
    autograd thread starts after the loader."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    eager = gpu_model(grad_ckpt_double=2, grad_ckpt_single=2)
    compiled = copy.deepcopy(eager)
    compiled.checkpoint_in_graph = in_graph
    compiled.set_compile_blocks(True)
    lengths = [7, 20, 1, 77, 120, 33, 64, 5]
    loader = torch.utils.data.DataLoader(lengths, batch_size=None, num_workers=1, pin_memory=True)
    start, graphs = counters["stats"]["unique_graphs"], []
    for step, length in enumerate(loader):
        data = cast(padded_batch([int(length)], seed=step), torch.bfloat16)
        got = loss_and_grads(compiled, compiled(**data))
        want = loss_and_grads(eager, eager(**data))
        assert abs(got[0].item() - want[0].item()) <= 1e-2 * abs(want[0].item()), step
        for name, ref in want[1].items():
            assert torch.isfinite(got[1][name]).all() and rel(got[1][name], ref) < 5e-2, (step, name)
        graphs.append(counters["stats"]["unique_graphs"] - start)
    print("unique graphs after each step:", graphs)
    assert graphs[-1] == graphs[2], graphs  # after 7, 20 and 1 nothing new: 77 ... 5 reuse the symbolic graphs
    # both kinds at the first length and symbolic, the double block at length 1: 5 on the CPU; an H200 (torch
    # 2.11) gave [2, 5, 6, 6, 6, 6, 6, 6]: one more, and nothing new after the third length
    assert graphs[-1] <= 6, graphs


@pytest.mark.parametrize("in_graph", [False, True], ids=["ckpt_around", "ckpt_in_graph"])
def test_compiled_lora_network_with_padded_text_matches_eager(in_graph):
    from opensora.lora import add_lora, lora_settings

    eager = add_lora(
        gpu_model(grad_ckpt_double=2, grad_ckpt_single=2), lora_settings(dict(rank=4, target_modules=["qkv", "proj"]))
    )
    with torch.no_grad():
        for name, p in eager.named_parameters():
            if "lora_B" in name:  # peft starts B at zero: give it values so the adapter's path matters
                p.normal_(0, 0.05)
    compiled = copy.deepcopy(eager)
    compiled.checkpoint_in_graph = in_graph
    compiled.set_compile_blocks(True)
    data = cast(padded_batch([20, 77, 120, 3]), torch.bfloat16)
    got, want = loss_and_grads(compiled, compiled(**data)), loss_and_grads(eager, eager(**data))
    assert set(got[1]) == set(want[1]) and all("lora_" in n for n in got[1])
    for name, ref in want[1].items():
        assert torch.isfinite(got[1][name]).all() and rel(got[1][name], ref) < 5e-2, name


@pytest.mark.parametrize("in_graph", [False, True], ids=["ckpt_around", "ckpt_in_graph"])
def test_compiled_causal_student_with_padded_text_matches_eager(in_graph):
    eager = gpu_model(causal_chunk_frames=2, grad_ckpt_double=2, grad_ckpt_single=2)
    compiled = copy.deepcopy(eager)
    compiled.checkpoint_in_graph = in_graph
    compiled.set_compile_blocks(True)
    data = cast(padded_batch([20, 77, 120, 3]), torch.bfloat16)
    got, want = loss_and_grads(compiled, compiled(**data)), loss_and_grads(eager, eager(**data))
    assert abs(got[0].item() - want[0].item()) <= 1e-2 * abs(want[0].item())
    for name, ref in want[1].items():
        assert torch.isfinite(got[1][name]).all() and rel(got[1][name], ref) < 5e-2, name
