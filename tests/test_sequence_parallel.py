"""Sequence parallelism (all-to-all) on 2 and 4 gloo processes: the same output and, after the world-wide gradient
average DDP/ZeRO apply, the same gradients as one process running the whole sample."""

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from opensora.models.mmdit import MMDiT, mmdit_config
from opensora.parallel.sequence_parallel import SequenceGroup, build_sequence_groups

TEXT_DIM, POOLED_DIM = 24, 16


def model_and_inputs(padded_text: bool, cond: bool, grad_ckpt: int, uneven: bool = False):
    cfg = mmdit_config(
        "tiny",
        text_dim=TEXT_DIM,
        pooled_dim=POOLED_DIM,
        in_channels=4,
        cond_channels=5,
        hidden_size=64,
        num_heads=4,
        axes_dims=(4, 6, 6),
        depth_double=2,
        depth_single=2,
        grad_ckpt_double=grad_ckpt,
        grad_ckpt_single=grad_ckpt,
    )
    cfg.pop("type")
    torch.manual_seed(0)
    model = MMDiT(**cfg)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():  # zero-initialised layers too, so every parameter gets a gradient
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    # padded text (even case): 40 columns with 5 and 3 valid, which the model trims to 32 before splitting
    batch, text_len = 2, (7 if uneven else 40 if padded_text else 8)
    frames, size = (3, 6) if uneven else (2, 8)  # uneven: 7 text and 3x3x3 = 27 video tokens, padded per rank
    mask = torch.ones(batch, text_len, dtype=torch.bool)
    if padded_text:
        mask[0, 5:] = False
        mask[1, 3:] = False
    inputs = dict(
        x=torch.randn(batch, 4, frames, size, size, generator=gen),
        timestep=torch.rand(batch, generator=gen),
        text_emb=torch.randn(batch, text_len, TEXT_DIM, generator=gen),
        text_mask=mask,
        pooled=torch.randn(batch, POOLED_DIM, generator=gen),
    )
    if cond:
        inputs["cond"] = torch.randn(batch, 5, frames, size, size, generator=gen)
    target = torch.randn(inputs["x"].shape, generator=gen)
    return model.train(), inputs, target


def loss_and_grads(model, inputs, target):
    out = model(**inputs)
    loss = (out - target).square().mean()
    model.zero_grad(set_to_none=True)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), loss.detach(), grads


def _sp_body(rank, world_size, padded_text, cond, grad_ckpt, uneven=False, cuda=False):
    if cuda:
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group("nccl" if cuda else "gloo")
    torch.set_num_threads(1)
    model, inputs, target = model_and_inputs(padded_text, cond, grad_ckpt, uneven)
    if cuda:
        model = model.cuda()
        inputs = {k: v.cuda() for k, v in inputs.items()}
        target = target.cuda()
    ref_out, ref_loss, ref_grads = loss_and_grads(model, inputs, target)  # whole sample, this process alone
    model.set_sequence_parallel(build_sequence_groups(world_size))
    assert model.sp.size == world_size and all(b.sp is model.sp for b in model.double_blocks)
    out, loss, grads = loss_and_grads(model, inputs, target)
    # each rank saw only its tokens: its own gradients are partial until averaged over the ranks
    partial = max(
        ((grads[n] - ref_grads[n]).norm() / ref_grads[n].norm()).item() for n in ("img_in.weight", "txt_in.weight")
    )
    assert set(grads) == set(ref_grads) and len(grads) >= len(list(model.parameters())) - 2  # cond_in unused w/o cond
    for g in grads.values():  # what DDP / ZeRO do with the gradients of replicated parameters
        dist.all_reduce(g)
        g /= world_size
    errors = {n: ((grads[n] - ref_grads[n]).norm() / ref_grads[n].norm().clamp_min(1e-12)).item() for n in grads}
    return dict(
        out_err=(out - ref_out).abs().max().item(),
        out_scale=ref_out.abs().max().item(),
        loss=loss.item(),
        ref_loss=ref_loss.item(),
        partial=partial,
        worst_grad=max(errors.items(), key=lambda kv: kv[1]),
    )


@pytest.mark.parametrize(
    "world_size, padded_text, cond, grad_ckpt, uneven",
    [
        (2, False, False, 0, False),
        (2, True, True, 1, False),
        (4, True, False, 0, False),
        (4, False, True, 1, True),
        (2, True, False, 0, True),
    ],
)
def test_sequence_parallel_matches_one_process(world_size, padded_text, cond, grad_ckpt, uneven):
    """uneven: token counts the group does not divide (7 text, 27 video tokens) are padded and masked."""
    results = run_distributed(_sp_body, world_size=world_size, args=(padded_text, cond, grad_ckpt, uneven))
    for r in results:
        # the one-process reference attends a padded batch row by row (KeyRanges), the ranks with a mask: rounding
        assert r["out_err"] < 1e-6 * max(10.0, r["out_scale"]), r
        assert r["partial"] > 0.1, r
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-6), r
        name, error = r["worst_grad"]
        assert error < 1e-5, f"{name}: relative gradient error {error:.2e}"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_sequence_parallel_matches_one_process_on_two_gpus_with_nccl():
    results = run_distributed(_sp_body, world_size=2, args=(True, True, 1, True), kwargs=dict(cuda=True))
    for r in results:
        assert r["out_err"] < 1e-4 and r["partial"] > 0.1, r
        name, error = r["worst_grad"]
        assert error < 1e-4, f"{name}: relative gradient error {error:.2e}"


def test_sequence_group_slices_and_rejects_uneven_splits():
    sp = SequenceGroup(group=None, size=4, rank=2)
    assert sp.local_slice(16, "tokens") == slice(8, 12)  # the model pads to a multiple first
    with pytest.raises(ValueError, match="divisible by 4"):
        sp.local_slice(10, "the video token count")
    model = MMDiT(
        **{
            k: v
            for k, v in mmdit_config("tiny", num_heads=2, hidden_size=32, axes_dims=(4, 6, 6)).items()
            if k != "type"
        }
    )
    with pytest.raises(ValueError, match="num_heads"):
        model.set_sequence_parallel(SequenceGroup(group=None, size=4, rank=0))
    model.set_sequence_parallel(SequenceGroup(group=None, size=2, rank=0))
    with pytest.raises(ValueError, match="compile_blocks"):
        model.set_compile_blocks(True)
    # either order: compiled blocks (so checkpoint_in_graph, which acts only on them) never meet sequence parallelism
    model.set_sequence_parallel(None)
    model.set_compile_blocks(True)  # lazy: nothing compiles until a call
    with pytest.raises(ValueError, match="compile_blocks"):
        model.set_sequence_parallel(SequenceGroup(group=None, size=2, rank=0))
    model.set_compile_blocks(False)


def _row_by_row_body(rank, world_size, cuda=False):
    """The overlapped sampling exchange (row by row, async) against the batched one, on this rank's slice."""
    from opensora.models.mmdit.attention import attention
    from opensora.parallel.process_group import init_process_group_from_env
    from opensora.parallel.sequence_parallel import attention_row_by_row, heads_to_tokens, tokens_to_heads

    _, _, device = init_process_group_from_env("cuda" if cuda else "cpu")
    sp = build_sequence_groups(world_size)
    gen = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(3, 4, 6, 8, generator=gen).to(device) for _ in range(3))  # rows, heads, tokens/S, dim
    mask = torch.rand(3, 1, 1, 6 * world_size, generator=torch.Generator().manual_seed(7)).to(device) > 0.3
    with torch.no_grad():
        batched = heads_to_tokens(attention(*tokens_to_heads(q, k, v, sp=sp), mask=mask), sp)
        rows = attention_row_by_row(q, k, v, sp, lambda q, k, v, r: attention(q, k, v, mask=mask[r : r + 1]))
    return dict(shape=list(rows.shape), diff=(rows - batched).abs().max().item(), scale=batched.abs().max().item())


@pytest.mark.parametrize("cuda", [False, pytest.param(True, marks=[pytest.mark.gpu])])
def test_row_by_row_sampling_exchange_equals_the_batched_one(cuda):
    if cuda and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    for r in run_distributed(_row_by_row_body, world_size=2, kwargs=dict(cuda=cuda)):
        assert r["shape"] == [3, 6, 32] and r["scale"] > 0.1, r
        assert r["diff"] == 0, r  # each row's attention is the batched path's row: bit-identical


def _without_all_to_all_body(rank, world_size):
    """The exchanges with gloo's all-to-all, then with a backend that has none (torch before 2.12 on the CPU):
    point-to-point sends must give the same tensors, in both directions, for every group."""
    import opensora.parallel.sequence_parallel as sequence_parallel
    from opensora.parallel.process_group import init_process_group_from_env

    init_process_group_from_env("cpu")
    sp = build_sequence_groups(2)  # groups of 2 in a world of 4: peers are not the global ranks 0 and 1
    gen = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(3, 4, 6, 8, generator=gen, requires_grad=True) for _ in range(3))

    def exchange():
        heads = sequence_parallel.tokens_to_heads(q, k, v, sp=sp)
        out = sequence_parallel.heads_to_tokens(heads[0].transpose(1, 2).flatten(2), sp)
        grads = torch.autograd.grad(sum((h * (i + 1)).sum() for i, h in enumerate(heads)), (q, k, v))
        pending = sequence_parallel._Exchange((q.detach(), v.detach()), sp, 1, 2, async_op=True).finish()
        return [t.detach().clone() for t in (*heads, out, *grads, *pending)]

    reference = exchange()
    real = dist.all_to_all

    def unsupported(*args, **kwargs):
        raise RuntimeError("Backend gloo does not support alltoall")

    dist.all_to_all = unsupported
    try:
        fallback = exchange()
    finally:
        dist.all_to_all = real
        sequence_parallel._BACKENDS_WITHOUT_ALL_TO_ALL.clear()
    return [torch.equal(a, b) for a, b in zip(reference, fallback)]


def test_sequence_parallel_exchanges_work_where_the_backend_has_no_all_to_all():
    for equal in run_distributed(_without_all_to_all_body, world_size=4):
        assert equal and all(equal), equal
