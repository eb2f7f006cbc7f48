"""Method framework: role checks, alternating optimizer/scheduler schedules, adapters through the registry,
and the trainer staying algorithm-agnostic. Runs in one process with real tiny networks (no booster needed:
roles get colossalai's plain ``OptimizerWrapper``)."""

import re
from pathlib import Path

import pytest
import torch
from colossalai.interface import OptimizerWrapper

from opensora.methods.base import MissingRoleError
from opensora.models.mmdit import mmdit_config
from opensora.registry import ADAPTERS, METHODS, MODELS, build_module
from opensora.roles import Components, Role
from opensora.training.role_builder import build_optimizer, warmup_lambda

REPO = Path(__file__).resolve().parents[1]

TINY_MMDIT = mmdit_config(
    "tiny",
    in_channels=48,
    cond_channels=49,
    hidden_size=32,
    num_heads=2,
    depth_double=1,
    depth_single=1,
    mlp_ratio=2.0,
    axes_dims=(4, 6, 6),
)  # PatchVAE(4) latents, a smaller net


pytestmark = pytest.mark.usefixtures("one_thread")  # fixture in conftest.py


def make_components() -> Components:
    vae = build_module(dict(type="PatchVAE", patch_size=4, temporal_patch_size=1), MODELS).eval()
    text = build_module(dict(type="TextConditioner", seed=0), MODELS)
    return Components(
        vae=vae, text_encoder=text, device=torch.device("cpu"), dtype=torch.float32, null_text=text.null_embeddings(1)
    )


def make_role(name, network, trainable, lr=1e-3, warmup=0) -> Role:
    if not trainable:
        return Role(name=name, model=network.eval().requires_grad_(False), trainable=False)
    optimizer = build_optimizer(network.parameters(), dict(lr=lr))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_lambda(warmup))
    return Role(
        name=name,
        model=network,
        trainable=True,
        optimizer=OptimizerWrapper(optimizer),
        lr_scheduler=scheduler,
        grad_clip=1.0,
    )


def make_dmd2_roles(student_warmup=4, critic_warmup=20, seed=0):
    torch.manual_seed(seed)
    teacher = build_module(TINY_MMDIT, MODELS)
    with torch.no_grad():  # the output layers start at zero (a fresh MMDiT predicts v = 0): perturb them
        for param in teacher.parameters():
            param.add_(0.05 * torch.randn_like(param))
    student, critic = build_module(TINY_MMDIT, MODELS), build_module(TINY_MMDIT, MODELS)
    student.load_state_dict(teacher.state_dict())
    critic.load_state_dict(teacher.state_dict())
    return dict(
        student=make_role("student", student, True, lr=1e-3, warmup=student_warmup),
        teacher=make_role("teacher", teacher, False),
        critic=make_role("critic", critic, True, lr=2e-3, warmup=critic_warmup),
    )


def tiny_batch(batch_size=1):
    # video [B, 3, 4, 16, 16] -> PatchVAE(4) latent [B, 48, 4, 4, 4]: 16 tokens
    return dict(
        video=torch.rand(batch_size, 3, 4, 16, 16) * 2 - 1,
        text=["a red circle moves left", "a blue square moves up"][:batch_size],
    )


def trainer_like_step(method, roles, batch, iteration):
    """What the trainer does per iteration: one backward per optimizer, restricted to that role's parameters."""
    loss_map, outputs = method.single_train_step(batch, iteration)
    optimizers = method.get_optimizers(iteration)
    for i, optimizer in enumerate(optimizers):
        owner = next(role for role in roles.values() if role.optimizer is optimizer)
        params = [p for p in owner.unwrap().parameters() if p.requires_grad]
        loss_map["total_loss"].backward(inputs=params, retain_graph=i + 1 < len(optimizers))
    grad_norms = method.optimizers_schedulers_step(iteration)
    method.optimizers_zero_grad(iteration)
    return loss_map, outputs, grad_norms


# ---- role checks -------------------------------------------------------------------------------------------------
def test_missing_role_error_names_the_role():
    roles = make_dmd2_roles()
    del roles["critic"]
    with pytest.raises(MissingRoleError, match=r"missing \['critic'\]"):
        build_module(dict(type="DMD2"), METHODS, roles=roles, components=make_components())


def test_frozen_role_cannot_be_trained_and_teacher_must_be_frozen():
    roles = make_dmd2_roles()
    roles["critic"] = make_role("critic", build_module(TINY_MMDIT, MODELS), False)
    with pytest.raises(MissingRoleError, match="critic"):
        build_module(dict(type="DMD2"), METHODS, roles=roles, components=make_components())
    roles = make_dmd2_roles()
    roles["teacher"] = make_role("teacher", build_module(TINY_MMDIT, MODELS), True)
    with pytest.raises(MissingRoleError, match="teacher.*frozen"):
        build_module(dict(type="DMD2"), METHODS, roles=roles, components=make_components())


def test_methods_and_adapters_resolve_through_registries():
    assert METHODS.get("DMD2") is not None and METHODS.get("FlowMatching") is not None
    assert ADAPTERS.get("MMDiTAdapter") is not None
    with pytest.raises(KeyError, match="NoSuchAdapter"):
        build_module(
            dict(type="DMD2", adapter=dict(type="NoSuchAdapter")),
            METHODS,
            roles=make_dmd2_roles(),
            components=make_components(),
        )


# ---- two-time-scale schedule: optimizers and schedulers stay aligned -----------------------------------------
def test_alternation_keeps_schedulers_aligned_over_50_iterations():
    torch.manual_seed(0)
    roles = make_dmd2_roles(student_warmup=4, critic_warmup=20)
    method = build_module(
        dict(type="DMD2", student_update_every=5, step_list=[1.0, 0.5], guidance_scale=2.0),
        METHODS,
        roles=roles,
        components=make_components(),
    )
    teacher_before = {k: v.clone() for k, v in roles["teacher"].unwrap().state_dict().items()}
    batch = tiny_batch()
    lrs = {"student": [], "critic": []}
    for iteration in range(50):
        student_before = [p.detach().clone() for p in roles["student"].unwrap().parameters()]
        loss_map, outputs, grad_norms = trainer_like_step(method, roles, batch, iteration)
        student_turn = iteration % 5 == 0
        assert set(grad_norms) == ({"critic", "student"} if student_turn else {"critic"})
        assert ("generator_loss" in loss_map) == student_turn and "critic_loss" in loss_map
        assert torch.isfinite(loss_map["total_loss"])
        changed = any(not torch.equal(a, b) for a, b in zip(student_before, roles["student"].unwrap().parameters()))
        assert changed == student_turn, f"iteration {iteration}: student changed={changed}"
        for name in lrs:
            lrs[name].append(roles[name].lr_scheduler.get_last_lr()[0])

    assert roles["critic"].lr_scheduler.last_epoch == 50
    assert roles["student"].lr_scheduler.last_epoch == 10
    # each lr follows its own warmup, counted in its own optimizer steps
    critic_steps = range(1, 51)
    assert lrs["critic"] == pytest.approx([2e-3 * warmup_lambda(20)(s) for s in critic_steps])
    student_steps = [iteration // 5 + 1 for iteration in range(50)]
    assert lrs["student"] == pytest.approx([1e-3 * warmup_lambda(4)(s) for s in student_steps])
    # the frozen teacher never moves
    for key, value in roles["teacher"].unwrap().state_dict().items():
        assert torch.equal(value, teacher_before[key]), key


def test_each_loss_reaches_only_its_role():
    """On a student iteration the summed total loss carries the generator loss to the student only and the
    critic loss to the critic only (the two terms touch disjoint parameters)."""
    torch.manual_seed(1)
    roles = make_dmd2_roles()
    method = build_module(dict(type="DMD2", student_update_every=2), METHODS, roles=roles, components=make_components())
    student_params = list(roles["student"].unwrap().parameters())
    critic_params = list(roles["critic"].unwrap().parameters())
    loss_map, _ = method.single_train_step(tiny_batch(2), iteration=0)
    generator_grads = torch.autograd.grad(loss_map["total_loss"], student_params, retain_graph=True, allow_unused=True)
    assert any(g is not None and g.abs().sum() > 0 for g in generator_grads)
    # critic gradient of the total loss == critic gradient of the critic loss alone: recompute from scratch
    torch.manual_seed(2)
    loss_map, _ = method.single_train_step(tiny_batch(2), iteration=1)  # critic-only iteration
    assert "generator_loss" not in loss_map
    assert all(
        g is None
        for g in torch.autograd.grad(loss_map["total_loss"], student_params, retain_graph=True, allow_unused=True)
    )
    assert any(g is not None for g in torch.autograd.grad(loss_map["total_loss"], critic_params, allow_unused=True))


# ---- adapters see handles, never role names; trainer never sees methods --------------------------------------
def test_adapter_source_has_no_role_names():
    source = (REPO / "opensora/adapters/mmdit.py").read_text().lower()
    for word in ("teacher", "critic", "student", "dmd"):
        assert word not in source, f"opensora/adapters/mmdit.py mentions '{word}'"


def test_trainer_has_no_method_specific_branches():
    source = (REPO / "opensora/training/trainer.py").read_text()
    found = sorted(set(re.findall(r"dmd|critic|teacher|student", source, flags=re.IGNORECASE)))
    assert not found, f"opensora/training/trainer.py names method-specific things: {found}"


def test_adapter_predictions_match_flow_matching_identities():
    comp = make_components()
    handle = make_dmd2_roles(seed=3)["teacher"]  # perturbed: a fresh MMDiT predicts v = 0
    network = handle.model
    adapter = build_module(dict(type="MMDiTAdapter"), ADAPTERS, components=comp)
    batch = adapter.prepare_batch(tiny_batch(2))
    assert batch.latent_shape == (2, 48, 4, 4, 4)
    assert batch.null_text["text_emb"].shape[0] == 2
    x0, noise = torch.randn(batch.latent_shape), torch.randn(batch.latent_shape)
    t = torch.tensor([0.3, 0.8])
    noisy = adapter.add_noise(x0, noise, t)
    with torch.no_grad():
        v = adapter.predict_velocity(handle, noisy, t, batch)
        pred_x0 = adapter.predict_x0(handle, noisy, t, batch)
        v_null = adapter.predict_velocity(handle, noisy, t, batch, conditional=False)
        text = batch.text
        cond = torch.zeros(2, 49, 4, 4, 4)
        v_direct = network(
            noisy, timestep=t, text_emb=text["text_emb"], text_mask=text["text_mask"], pooled=text["pooled"], cond=cond
        )
    torch.testing.assert_close(v, v_direct)
    torch.testing.assert_close(pred_x0, noisy - t.view(-1, 1, 1, 1, 1) * v)
    assert not torch.allclose(v, v_null)  # the null text is really a different condition
    # timestep mechanics: index / N, shifted, clamped into [min_time, 1]
    index = torch.tensor([0, 500, 1000])
    batch.shift_alpha = 3.0
    expected = 3.0 * 0.5 / (1 + 2.0 * 0.5)
    torch.testing.assert_close(
        adapter.shift_and_clamp_timestep(index, batch), torch.tensor([adapter.min_time, expected, 1.0])
    )
