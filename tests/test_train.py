"""Acceptance tests of the trainer (issue 3) on CPU: real data (mp4 MovingShapes clips), the demo config shrunk to
4-frame 32x32 clips, real ColossalAI plugins.

Two-rank runs go through the real launchers in subprocesses (``colossalai run`` and ``torchrun``, gloo); the
fault-injection, NaN-guard and gradient-accumulation cases run one rank in this process so they can monkeypatch.
Runs are shared between assertions through module-scoped fixtures to keep the file fast.

Note on ``colossalai run``: it joins the script arguments with spaces into one shell command without quoting, so
an argument holding spaces or shell characters (``--bucket_config '{"32x32": {4: (1.0, 2)}}'``) breaks it; put
such overrides in a config file (as these tests do) or use torchrun. It also needs ``torchrun`` on ``PATH``.
"""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dist_utils import find_free_port

ROOT = Path(__file__).resolve().parents[1]
DEMO_CONFIG = ROOT / "configs" / "diffusion" / "train" / "demo.py"
TRAIN_SCRIPT = ROOT / "scripts" / "diffusion" / "train.py"
BIN = Path(sys.executable).parent
TIMEOUT_S = 240
RECORD_FIELDS = ("step", "loss", "lr", "grad_norm", "samples_per_s", "tokens_per_s")
# the torchrun variables an in-process run leaves in os.environ: a launcher must set its own
_LAUNCHER_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "ROLE_RANK",
    "TORCHELASTIC_RUN_ID",
)


# ---- helpers ----------------------------------------------------------------------------------------------------
def write_config(path: Path, base: Path, **values) -> Path:
    """A config file inheriting ``base`` and setting ``values`` (dicts merge unless they carry ``_delete_``)."""
    lines = [f"_base_ = [{str(base)!r}]"] + [f"{key} = {value!r}" for key, value in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def read_metrics(outputs: Path) -> list:
    return [json.loads(line) for line in (Path(outputs) / "metrics.jsonl").read_text().splitlines() if line]


def by_step(records: list) -> dict:
    return {record["step"]: record for record in records}


def launcher_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"  # colossalai run calls `torchrun` by name
    env["OMP_NUM_THREADS"] = "1"  # two ranks on a 2-core machine
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def launch(launcher: str, config: Path, outputs: Path, *flags: str) -> subprocess.CompletedProcess:
    """Train on 2 local ranks through ``colossalai run`` or ``torchrun``; fail with the log tail on error."""
    port = str(find_free_port())
    if launcher == "colossalai":
        command = [str(BIN / "colossalai"), "run", "--nproc_per_node", "2", "--master_port", port]
    else:
        command = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", port]
    command += [str(TRAIN_SCRIPT), str(config), "--outputs", str(outputs), *flags]
    result = subprocess.run(command, cwd=ROOT, env=launcher_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    log = (result.stdout + result.stderr)[-6000:]
    assert result.returncode == 0, f"{launcher} failed ({result.returncode}):\n{log}"
    # colossalai run reports a failed node in its output but may still exit 0 on some versions
    assert "failure" not in result.stdout.split("Training on All Nodes")[-1], log
    return result


def build_trainer(config: Path, outputs: Path, *flags: str):
    """A one-rank Trainer in this process, configured exactly as ``train.py CONFIG --outputs ... FLAGS`` would."""
    from opensora.config import load_config_from_cli
    from opensora.training.launch import TRAIN_FLAGS
    from opensora.training.trainer import Trainer

    cfg, _ = load_config_from_cli([str(config), "--outputs", str(outputs), *flags], script_flags=TRAIN_FLAGS)
    return Trainer(cfg)


def assert_same_records(got: dict, want: dict, steps, keys=("loss", "grad_norm", "lr")) -> None:
    """Bit-for-bit equality of the logged values (JSON keeps a float's full repr)."""
    for step in steps:
        for key in keys:
            assert got[step][key] == want[step][key], f"step {step} {key}: {got[step][key]!r} != {want[step][key]!r}"


def safetensors_weights(checkpoint: Path) -> dict:
    """The model role's weights in a checkpoint directory (``.../step-NNNNNNN``); fails if it holds none (a wrong
    path would otherwise compare two empty dicts and pass)."""
    from safetensors.torch import load_file

    weights = {}
    for shard in sorted((checkpoint / "model" / "model").glob("*.safetensors")):
        weights.update(load_file(str(shard)))
    assert weights, f"no model weights under {checkpoint / 'model' / 'model'}"
    return weights


def ema_weights(checkpoint: Path) -> dict:
    """The model role's EMA file in a checkpoint directory."""
    from safetensors.torch import load_file

    return load_file(str(checkpoint / "model" / "ema.safetensors"))


# ---- shared data and configs --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """16 real mp4 clips of 4 frames, a 4-clip subset, and a tiny config on top of the demo config."""
    from opensora.datasets.moving_shapes import write_dataset

    root = tmp_path_factory.mktemp("train")
    csv = write_dataset(root / "data", num=16, seed=0, height=32, width=32, num_frames=4, progress=False)
    rows = Path(csv).read_text().splitlines()
    subset = Path(csv).with_name("meta4.csv")
    subset.write_text("\n".join(rows[:5]) + "\n")  # header + 4 clips (paths are relative to the csv's folder)
    tiny = write_config(
        root / "tiny.py",
        DEMO_CONFIG,
        dataset=dict(data_path=str(csv)),
        bucket_config={"_delete_": True, "32x32": {4: (1.0, 2)}},  # 4 frames, 2 clips per rank and step
        num_workers=0,
        warmup_steps=5,  # so that the loss visibly falls within 12 steps
        keep_last=3,
    )
    return dict(root=root, csv=Path(csv), subset=subset, tiny=tiny)


@pytest.fixture(scope="module")
def zero2_run(workdir):
    """The issue's command: ``colossalai run --nproc_per_node 2 train.py CONFIG --max-steps 12 --ckpt-every 6``."""
    outputs = workdir["root"] / "zero2"
    launch("colossalai", workdir["tiny"], outputs, "--max-steps", "12", "--ckpt-every", "6")
    return outputs


@pytest.fixture(scope="module")
def inprocess_run(workdir):
    """An uninterrupted one-rank run to step 6 with a checkpoint every 2 steps, through ``launch.main``,
    with ``--resume auto`` on an empty outputs directory (must start fresh)."""
    from opensora.training.launch import main

    outputs = workdir["root"] / "uninterrupted"
    outputs.mkdir()
    # left by an earlier run that died before its first checkpoint: a fresh start must not append to it
    (outputs / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 99.0}) + "\n")
    main([str(workdir["tiny"]), "--outputs", str(outputs), "--max-steps", "6", "--ckpt-every", "2", "--resume", "auto"])
    return outputs


# ---- 2 ranks: ZeRO-2 through colossalai run, resume through torchrun, DDP parity ---------------------------------
def test_zero2_colossalai_run_trains_and_checkpoints(zero2_run):
    from opensora.training.checkpoint import list_checkpoints

    records = read_metrics(zero2_run)
    assert [r["step"] for r in records] == list(range(1, 13))
    assert all(math.isfinite(r["loss"]) for r in records)
    # loss falls: the last three steps are well below the first three
    first = sum(r["loss"] for r in records[:3]) / 3
    last = sum(r["loss"] for r in records[-3:]) / 3
    assert last < 0.9 * first, [round(r["loss"], 4) for r in records]
    steps = [step for step, _ in list_checkpoints(zero2_run)]
    assert steps == [6, 12]
    meta = json.loads((zero2_run / "checkpoints" / "step-0000006" / "meta.json").read_text())
    assert meta["world_size"] == 2
    config = (zero2_run / "checkpoints" / "step-0000006" / "config.py").read_text()
    assert "LowLevelZeroPlugin" in config


def test_metrics_config_and_tensorboard_are_written(zero2_run):
    from opensora.config import load_config

    records = read_metrics(zero2_run)
    for record in records:
        missing = [field for field in RECORD_FIELDS if field not in record]
        assert not missing, f"metrics.jsonl lacks {missing}: {record}"
        assert "mfu" not in record  # MFU is only reported against a known GPU peak
        assert record["samples_per_s"] > 0 and record["tokens_per_s"] > 0
        assert record["nonfinite_total"] == 0
    # samples per step: 2 ranks x 2 clips; tokens: 4 latent frames x (8/2)x(8/2) patches per clip
    for record in records:
        assert record["samples_per_s"] * record["step_time"] == pytest.approx(4.0)
        assert record["tokens_per_s"] * record["step_time"] == pytest.approx(4.0 * 4 * 16)

    saved = load_config(zero2_run / "config.py")
    assert saved.max_steps == 12 and saved.ckpt_every == 6
    assert saved.outputs == str(zero2_run)
    assert saved.plugin.type == "LowLevelZeroPlugin" and saved.plugin.stage == 2
    assert saved.bucket_config == {"32x32": {4: (1.0, 2)}}

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list((zero2_run / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1, "rank 0 alone writes one tensorboard event file"
    accumulator = EventAccumulator(str(events[0]))
    accumulator.Reload()
    losses = accumulator.Scalars("train/loss")
    assert [event.step for event in losses] == list(range(1, 13))
    assert losses[-1].value == pytest.approx(records[-1]["loss"])


def test_resume_with_load_under_torchrun_is_exact(zero2_run, workdir):
    """Steps 7-12 resumed from step 6's checkpoint (a fresh 2-rank torchrun process) equal the uninterrupted ones."""
    outputs = workdir["root"] / "resumed"
    launch(
        "torchrun",
        workdir["tiny"],
        outputs,
        "--max-steps",
        "12",
        "--load",
        str(zero2_run / "checkpoints" / "step-0000006"),
    )
    resumed = by_step(read_metrics(outputs))
    assert sorted(resumed) == list(range(7, 13))
    assert_same_records(resumed, by_step(read_metrics(zero2_run)), range(7, 13))
    final, reference = (safetensors_weights(path / "checkpoints" / "step-0000012") for path in (outputs, zero2_run))
    assert final.keys() == reference.keys()
    for name in final:
        assert torch.equal(final[name], reference[name]), name
    # the EMA, sharded over the two ZeRO ranks and gathered into one file, resumes exactly too
    final_ema, reference_ema = (ema_weights(path / "checkpoints" / "step-0000012") for path in (outputs, zero2_run))
    assert final_ema.keys() == final.keys()
    for name in final_ema:
        assert torch.equal(final_ema[name], reference_ema[name]), name


def test_ddp_and_zero2_give_the_same_losses_in_fp32(zero2_run, workdir):
    config = write_config(
        workdir["root"] / "ddp.py", workdir["tiny"], plugin=dict(_delete_=True, type="TorchDDPPlugin")
    )
    outputs = workdir["root"] / "ddp"
    launch("torchrun", config, outputs, "--max-steps", "6")
    ddp, zero = by_step(read_metrics(outputs)), by_step(read_metrics(zero2_run))
    assert sorted(ddp) == list(range(1, 7))
    assert ddp[1]["loss"] == zero[1]["loss"]  # same initial weights, data and noise
    for step in range(1, 7):
        assert ddp[step]["loss"] == pytest.approx(zero[step]["loss"], rel=1e-5, abs=1e-6)
        assert ddp[step]["grad_norm"] == pytest.approx(zero[step]["grad_norm"], rel=1e-5)
        assert ddp[step]["lr"] == zero[step]["lr"]
    # DDP's EMA is rank 0's over the whole weights, ZeRO's is sharded over the masters: the same average
    ddp_ema, zero_ema = (ema_weights(path / "checkpoints" / "step-0000006") for path in (outputs, zero2_run))
    assert ddp_ema.keys() == zero_ema.keys()
    for name in ddp_ema:
        torch.testing.assert_close(ddp_ema[name], zero_ema[name], rtol=1e-5, atol=1e-6)


def test_sequence_parallel_over_two_ranks_trains_like_one_rank(inprocess_run, workdir):
    """--sequence-parallel-size 2 on 2 ranks: one data-parallel rank whose samples are split over 2 processes, so
    the same batches, noise and (up to float summation order) losses and gradients as the 1-rank run."""
    outputs = workdir["root"] / "sp2"
    result = launch("torchrun", workdir["tiny"], outputs, "--max-steps", "6", "--sequence-parallel-size", "2")
    assert "sequence parallel: 2 ranks per sample (roles model), 1 data-parallel ranks" in result.stdout + result.stderr
    sp, one = by_step(read_metrics(outputs)), by_step(read_metrics(inprocess_run))
    assert sorted(sp) == list(range(1, 7))
    for step in range(1, 7):
        assert sp[step]["loss"] == pytest.approx(one[step]["loss"], rel=1e-5, abs=1e-6), step
        assert sp[step]["grad_norm"] == pytest.approx(one[step]["grad_norm"], rel=1e-4), step
        assert sp[step]["lr"] == one[step]["lr"]


# ---- 1 rank in this process: crash mid-save, --resume auto, NaN guard, accumulation -------------------------------
class InjectedSaveFailure(RuntimeError):
    pass


def test_crash_mid_save_then_resume_auto_is_exact(inprocess_run, workdir, monkeypatch):
    """The second save dies after the model and optimizer are written (in save_lr_scheduler); ``--resume auto``
    then picks the newest complete checkpoint (step 2), skipping an incomplete newer directory (the failed save's
    temporary directory is already gone), and the continued run matches the uninterrupted one bit for bit."""
    from colossalai.booster import Booster

    outputs = workdir["root"] / "crashed"
    real_save = Booster.save_lr_scheduler
    calls = []

    def save_lr_scheduler_failing_on_second_save(self, *args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            raise InjectedSaveFailure("fault injected in the middle of the step-4 save")
        return real_save(self, *args, **kwargs)

    monkeypatch.setattr(Booster, "save_lr_scheduler", save_lr_scheduler_failing_on_second_save)
    trainer = build_trainer(workdir["tiny"], outputs, "--max-steps", "6", "--ckpt-every", "2")
    with pytest.raises(InjectedSaveFailure):
        trainer.train()
    trainer.metrics.close()
    monkeypatch.setattr(Booster, "save_lr_scheduler", real_save)

    checkpoints = outputs / "checkpoints"
    debris = checkpoints / ".tmp-step-0000004"
    assert not debris.exists(), "a save that fails with an exception removes its temporary directory at once"
    assert not (checkpoints / "step-0000004").exists()
    assert [r["step"] for r in read_metrics(outputs)] == [1, 2, 3, 4]  # steps past the checkpoint were logged
    incomplete = checkpoints / "step-0000005"  # a newer directory without the COMPLETE marker must be ignored
    (incomplete / "model").mkdir(parents=True)

    resumed = build_trainer(workdir["tiny"], outputs, "--max-steps", "6", "--ckpt-every", "2", "--resume", "auto")
    resumed.resume(auto=True)
    assert resumed.step == 2
    resumed.train()

    records = read_metrics(outputs)
    assert [r["step"] for r in records] == list(range(1, 7))  # the crashed run's steps 3-4 were dropped
    assert_same_records(by_step(records), by_step(read_metrics(inprocess_run)), range(1, 7))
    final = safetensors_weights(checkpoints / "step-0000006")
    reference = safetensors_weights(inprocess_run / "checkpoints" / "step-0000006")
    assert all(torch.equal(final[name], reference[name]) for name in reference)


def test_resume_auto_without_checkpoint_starts_fresh(inprocess_run):
    records = read_metrics(inprocess_run)
    assert [r["step"] for r in records] == list(range(1, 7))
    assert records[0]["loss"] != 99.0, "the stale record of an earlier run was kept"
    assert (inprocess_run / "checkpoints" / "step-0000006" / "COMPLETE").is_file()


def nan_when(method, bad):
    """Wrap ``method.single_train_step``: NaN loss where ``bad(call, batch)`` (call counts from 1 in this process)."""
    real_step = method.single_train_step
    seen = {"calls": 0}

    def step(batch, iteration):
        seen["calls"] += 1
        loss_map, outputs = real_step(batch, iteration)
        if bad(seen["calls"], batch):
            loss_map = {**loss_map, "total_loss": loss_map["total_loss"] * float("nan")}
        return loss_map, outputs

    method.single_train_step = step
    return seen


def test_nonfinite_loss_is_skipped_and_counted(workdir):
    from opensora.training.trainer import NonFiniteLossError

    outputs = workdir["root"] / "nan"
    config = write_config(workdir["root"] / "nan.py", workdir["tiny"], max_consecutive_nonfinite=3)
    trainer = build_trainer(config, outputs, "--max-steps", "3", "--tensorboard", "false")
    model = trainer.roles["model"].unwrap()
    counter = nan_when(trainer.method, lambda call, batch: call == 2)
    trainer.train()
    records = read_metrics(outputs)
    assert [r["step"] for r in records] == [1, 2, 3]  # the run went on after the bad step
    assert [r["nonfinite_total"] for r in records] == [0, 1, 1]
    assert counter["calls"] == 4
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records)
    assert all(torch.isfinite(p).all() for p in model.parameters())

    # three in a row: the run stops with NonFiniteLossError instead of training on garbage
    trainer.max_steps = 10
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    nan_when(trainer.method, lambda call, batch: True)
    with pytest.raises(NonFiniteLossError, match="3 non-finite losses in a row"):
        trainer.train()
    assert trainer.step == 3 and trainer.nonfinite_total == 4
    after = dict(model.named_parameters())
    assert all(torch.equal(before[name], after[name]) for name in before), "a skipped step changed weights"


def _fixed_input_step(method, nan_on_call=None):
    """A step whose gradient is the same on every call (fixed latents, noise and t, whatever the batch): lets a
    test see exactly how many micro-steps' gradients an optimizer step used."""
    from opensora.diffusion.flow_matching import add_noise, velocity_target

    counter = {"calls": 0}

    def step(batch, iteration):
        counter["calls"] += 1
        x0, text = method.encode_batch(batch)
        generator = torch.Generator().manual_seed(0)
        x0 = torch.randn(x0.shape, generator=generator)
        noise = torch.randn(x0.shape, generator=generator)
        t = torch.full((x0.shape[0],), 0.5)
        text = method.components.null_text
        text = {k: v.expand(x0.shape[0], *v.shape[1:]) for k, v in text.items()}
        batch_size, channels, *grid = x0.shape
        cond = x0.new_zeros(batch_size, channels + 1, *grid) if method.uses_condition else None
        prediction = method.roles["model"].model(
            add_noise(x0, noise, t),
            timestep=t,
            text_emb=text["text_emb"],
            text_mask=text["text_mask"],
            pooled=text["pooled"],
            cond=cond,
        )
        loss = torch.mean((prediction - velocity_target(x0, noise)) ** 2)
        if counter["calls"] == nan_on_call:
            loss = loss * float("nan")
        return {"total_loss": loss}, dict(num_samples=batch_size, num_tokens=0)

    return step


def test_nonfinite_micro_step_discards_the_gradients_of_its_window(workdir):
    """grad_accum=2, NaN on the 2nd micro-step: the 1st micro-step's gradient (already backwarded) must be dropped,
    so the next optimizer step sees exactly one window's gradient, as a run without the NaN does."""
    config = write_config(workdir["root"] / "nan_accum.py", workdir["tiny"], grad_accum=2)
    grad_norms = {}
    for name, nan_on_call in (("clean", None), ("nan_accum", 2)):
        trainer = build_trainer(config, workdir["root"] / name, "--max-steps", "1", "--tensorboard", "false")
        trainer.method.single_train_step = _fixed_input_step(trainer.method, nan_on_call)
        trainer.train()
        records = read_metrics(workdir["root"] / name)
        assert len(records) == 1
        grad_norms[name] = records[0]["grad_norm"]
        assert records[0]["nonfinite_total"] == (0 if nan_on_call is None else 1)
    assert grad_norms["nan_accum"] == pytest.approx(grad_norms["clean"], rel=1e-6)


def _deterministic_flow_matching_step(method):
    """FlowMatching's step with noise and t drawn per sample from the sample's index (no text dropout, no
    condition), so a batch split into micro-batches sees exactly the same noise as the whole batch."""
    from opensora.diffusion.flow_matching import add_noise, velocity_target

    def step(batch, iteration):
        x0, text = method.encode_batch(batch)
        generators = [torch.Generator().manual_seed(1000 + int(i)) for i in batch["index"]]
        noise = torch.stack([torch.randn(x0.shape[1:], generator=g) for g in generators])
        t = torch.stack([torch.rand((), generator=g) for g in generators])
        # an all-zero condition (text-to-video): every parameter gets a gradient, as in FlowMatching (ZeRO's
        # sharded optimizer save fails on a parameter that never had one, since Adam then keeps no state for it)
        batch_size, channels, *grid = x0.shape
        cond = x0.new_zeros(batch_size, channels + 1, *grid) if method.uses_condition else None
        prediction = method.roles["model"].model(
            add_noise(x0, noise, t),
            timestep=t,
            text_emb=text["text_emb"],
            text_mask=text["text_mask"],
            pooled=text["pooled"],
            cond=cond,
        )
        loss = torch.mean((prediction.float() - velocity_target(x0, noise)) ** 2)
        return {"total_loss": loss}, dict(num_samples=x0.shape[0], num_tokens=0)

    return step


def _accumulation_run(workdir, name, batch_size, grad_accum, steps=3):
    config = write_config(
        workdir["root"] / f"{name}.py",
        workdir["tiny"],
        dataset=dict(data_path=str(workdir["subset"])),  # 4 clips: one window always sees all of them
        bucket_config={"_delete_": True, "32x32": {4: (1.0, batch_size)}},
        grad_accum=grad_accum,
        # Adam's eps at the default 1e-15 makes its first update sign(g) * lr for every element whose gradient is
        # above 1e-15, so an element whose true gradient is zero moves by +-lr on the sign of its fp32 rounding
        # noise, which the two batchings sum in different orders (and different CPUs in different orders again).
        # At 1e-6 the update of such an element is g / eps: continuous in g, so the weights compare at a tolerance.
        optimizer=dict(eps=1e-6),
    )
    trainer = build_trainer(config, workdir["root"] / name, "--max-steps", str(steps), "--tensorboard", "false")
    assert {g["eps"] for g in trainer.roles["model"].optimizer.param_groups} == {1e-6}
    trainer.method.single_train_step = _deterministic_flow_matching_step(trainer.method)
    trainer.train()
    weights = {k: v.detach().clone() for k, v in trainer.roles["model"].unwrap().state_dict().items()}
    return read_metrics(workdir["root"] / name), weights


def test_gradient_accumulation_matches_the_large_batch(workdir):
    """grad_accum=2 with batch 2 == grad_accum=1 with batch 4 (fp32): same losses, grad norms and weights; the
    optimizer and the warm-up schedule step once per window."""
    whole, whole_weights = _accumulation_run(workdir, "accum1", batch_size=4, grad_accum=1)
    split, split_weights = _accumulation_run(workdir, "accum2", batch_size=2, grad_accum=2)
    assert [r["step"] for r in split] == [1, 2, 3]
    for a, b in zip(split, whole):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
        assert a["lr"] == b["lr"]
        assert a["samples_per_s"] * a["step_time"] == pytest.approx(4.0)  # two micro-batches of 2 per step
    # constant_with_warmup over 5 optimizer steps of lr 1e-3: the scheduler stepped once per window
    assert [r["lr"] for r in split] == pytest.approx([1e-3 * (k + 1) / 5 for k in (1, 2, 3)])
    # Weights: the two batchings differ only by fp32 summation order (Adam's eps above keeps a zero-gradient
    # element from turning that into +-lr). atol 1e-5 is ~2% of one step's update (lr <= 6e-4); a missed micro-batch
    # moves the weights by O(lr), and a wrong scale moves the grad norms above by far more than 1e-4.
    for name, value in whole_weights.items():
        torch.testing.assert_close(split_weights[name], value, rtol=1e-5, atol=1e-5, msg=name)


# ---- the command line -------------------------------------------------------------------------------------------
def test_unknown_cli_key_names_the_nearest_key():
    result = subprocess.run(
        [sys.executable, str(TRAIN_SCRIPT), str(DEMO_CONFIG), "--model.hiden_size", "3"],
        cwd=ROOT,
        env=launcher_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "unknown config key 'model.hiden_size'" in result.stderr
    assert "did you mean 'model.hidden_size'" in result.stderr
    assert "Traceback" not in result.stderr, "a typo deserves one line, not a stack trace"


# ---- the 1B GPU configs (checked on CPU: loadable, shapes consistent, 1B parameters) --------------------------------
def test_mmdit_1b_configs_are_consistent():
    from opensora.config import load_config
    from opensora.registry import MODELS, build_module

    real = load_config(ROOT / "configs" / "diffusion" / "train" / "mmdit_1b_256px.py")
    synthetic = load_config(ROOT / "configs" / "diffusion" / "train" / "mmdit_1b_synthetic.py")
    assert real.vae.type == "HunyuanVideoVAE" and real.vae.from_pretrained
    assert real.text_encoder.t5.from_pretrained and real.text_encoder.clip.from_pretrained
    assert real.precision == "bf16" and real.plugin.type == "LowLevelZeroPlugin"
    assert real.model.grad_ckpt_double == real.model.depth_double
    assert real.model.grad_ckpt_single == real.model.depth_single
    assert synthetic.model == real.model and synthetic.plugin == real.plugin and synthetic.method == real.method
    assert synthetic.precision == "bf16" and synthetic.optimizer == real.optimizer

    vae = build_module(synthetic.vae, MODELS)
    assert vae.latent_channels == synthetic.model.in_channels == 16
    assert vae.get_latent_size((33, 256, 256)) == (9, 32, 32)  # the real VAE's compression
    assert synthetic.text_encoder.t5.config.d_model == synthetic.model.text_dim == 4096
    assert synthetic.text_encoder.clip.config.hidden_size == synthetic.model.pooled_dim == 768
    assert synthetic.text_encoder.t5.max_length == real.text_encoder.t5.max_length == 512
    with torch.device("meta"):
        model = build_module(synthetic.model, MODELS)
    assert 1.2e9 < sum(p.numel() for p in model.parameters()) < 1.3e9


# ---- GPU: the 1B-class MMDiT step with the real trainer ------------------------------------------------------------
@pytest.mark.gpu
def test_mmdit_1b_synthetic_step_time_and_mfu(tmp_path):
    """bf16 + LowLevelZero on one GPU; prints step time and MFU (steps after the first two, which compile/warm up)."""
    outputs = tmp_path / "mmdit_1b"
    config = ROOT / "configs" / "diffusion" / "train" / "mmdit_1b_synthetic.py"
    gpus = os.environ.get("OPENSORA_TEST_GPUS", "1")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        gpus,
        "--master_port",
        str(find_free_port()),
        str(TRAIN_SCRIPT),
        str(config),
        "--outputs",
        str(outputs),
        "--max-steps",
        "8",
        "--save-at-end",
        "False",
    ]  # a 1B final checkpoint is ~23 GB (model, optimizer, fp32 masters, EMA)
    env = launcher_env()
    env.pop("OMP_NUM_THREADS")
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    records = read_metrics(outputs)
    assert [r["step"] for r in records] == list(range(1, 9))
    assert all(math.isfinite(r["loss"]) for r in records)
    timed = records[2:]
    step_time = sorted(r["step_time"] for r in timed)[len(timed) // 2]
    mfu = [r["mfu"] for r in timed if "mfu" in r]
    print(
        f"\nmmdit_1b_synthetic on {torch.cuda.get_device_name()}: median step time {step_time:.3f} s, "
        f"samples/s {timed[-1]['samples_per_s']:.2f}, tokens/s {timed[-1]['tokens_per_s']:.0f}, "
        f"MFU {(sum(mfu) / len(mfu)) if mfu else float('nan'):.3f}"
    )
    if "H100" in torch.cuda.get_device_name() or "H200" in torch.cuda.get_device_name():
        assert mfu and all(0 < value < 1 for value in mfu)


def test_long_video_config_is_sequence_parallel_ready():
    """The >= 32k-token config: its VAE's latent grid, token counts and heads divide by its sequence-parallel size."""
    from opensora.config import load_config
    from opensora.registry import MODELS, build_module

    cfg = load_config(ROOT / "configs" / "diffusion" / "train" / "mmdit_1b_long_synthetic.py")
    sp = cfg.sequence_parallel_size
    vae = build_module(cfg.vae, MODELS)
    t, h, w = vae.get_latent_size((cfg.dataset.num_frames, cfg.dataset.height, cfg.dataset.width))
    pt, ph, pw = cfg.model.patch_size
    video_tokens = (t // pt) * (h // ph) * (w // pw)
    assert video_tokens >= 32_000
    assert video_tokens % sp == 0 and cfg.text_encoder.t5.max_length % sp == 0 and cfg.model.num_heads % sp == 0
    assert list(cfg.bucket_config) == ["512x512"] and cfg.bucket_config["512x512"][cfg.dataset.num_frames]


def test_compiled_blocks_train_save_and_resume_exactly(workdir):
    """``model.compile_blocks=True`` through the real trainer (one rank, ZeRO-2, fp32 on the CPU): the checkpoint has
    the eager model's parameter names, and resuming from step 2 repeats the uninterrupted compiled run bit for bit
    (issue 16: the compiled step is the fastest; this is what turning it on in a config must keep)."""
    config = write_config(workdir["root"] / "compiled.py", workdir["tiny"], model=dict(compile_blocks=True))
    whole = workdir["root"] / "compiled_whole"
    build_trainer(config, whole, "--max-steps", "4", "--ckpt-every", "2").train()
    resumed_dir = workdir["root"] / "compiled_resumed"
    resumed = build_trainer(config, resumed_dir, "--max-steps", "4", "--ckpt-every", "2")
    assert resumed.roles["model"].unwrap().compile_blocks
    resumed.resume(str(whole / "checkpoints" / "step-0000002"))
    assert resumed.step == 2
    resumed.train()
    assert_same_records(by_step(read_metrics(resumed_dir)), by_step(read_metrics(whole)), range(3, 5))
    final = safetensors_weights(resumed_dir / "checkpoints" / "step-0000004")
    reference = safetensors_weights(whole / "checkpoints" / "step-0000004")
    assert set(final) == set(reference) and all(torch.equal(final[name], reference[name]) for name in reference)
    eager = build_trainer(workdir["tiny"], workdir["root"] / "eager_names", "--max-steps", "1")
    assert set(reference) == set(eager.roles["model"].unwrap().state_dict())


# ---- preemption on 2 ranks ---------------------------------------------------------------------------------------
def test_sigterm_on_one_rank_checkpoints_both_and_resume_auto_is_exact(zero2_run, workdir):
    """SIGTERM reaches rank 1 only (as a node-local signal might): both ranks agree in their per-step all-reduce,
    finish the same optimizer step, save one checkpoint at that (settled) step and exit with code 75; ``--resume auto``
    then continues to step 12 bit-identically to the uninterrupted run."""
    import psutil

    outputs = workdir["root"] / "preempted"
    port = str(find_free_port())
    command = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", port]
    command += [str(TRAIN_SCRIPT), str(workdir["tiny"]), "--outputs", str(outputs), "--max-steps", "12"]
    command += ["--ckpt-every", "6"]
    launcher = subprocess.Popen(
        command, cwd=ROOT, env=launcher_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    metrics = outputs / "metrics.jsonl"
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not (metrics.is_file() and metrics.read_text().strip()) and launcher.poll() is None:
            assert time.monotonic() < deadline, "no step logged"
            time.sleep(0.02)
        workers = [p for p in psutil.Process(launcher.pid).children(recursive=True) if p.environ().get("RANK") == "1"]
        assert len(workers) == 1, "rank 1 not found"
        workers[0].send_signal(signal.SIGTERM)
        log, _ = launcher.communicate(timeout=TIMEOUT_S)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    stops = [line for line in log.splitlines() if "train.py: stopped by SIGTERM after step" in line]
    assert len(stops) == 1, log[-4000:]  # rank 0 says it, once
    step = int(stops[0].split("after step ")[1].split(":")[0])
    assert 1 <= step < 12, log[-4000:]
    assert "exitcode  : 75" in log or "exit code 75" in log, log[-4000:]
    checkpoints = outputs / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        f"step-{s:07d}" for s in sorted({step, 6} & set(range(1, step + 1)))
    ]
    assert [r["step"] for r in read_metrics(outputs)] == list(range(1, step + 1))

    launch("torchrun", workdir["tiny"], outputs, "--max-steps", "12", "--ckpt-every", "6", "--resume", "auto")
    resumed, reference = by_step(read_metrics(outputs)), by_step(read_metrics(zero2_run))
    assert sorted(resumed) == list(range(1, 13))
    assert_same_records(resumed, reference, range(1, 13))
    final, want = (safetensors_weights(path / "checkpoints" / "step-0000012") for path in (outputs, zero2_run))
    assert final.keys() == want.keys() and all(torch.equal(final[k], want[k]) for k in want)
