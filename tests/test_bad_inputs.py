"""Bad input gets one clear line and exit code 2, never a hang, a lost run or code run from a checkpoint (issue 11).

The CLI cases run the real scripts in subprocesses, as a user types them, and assert: exit code 2, the last stderr line
is ``{script}: error: ...`` naming the problem, no traceback (``--debug`` keeps it), and every file that was on disk
before is still there, unchanged. Cases that need a failing disk or the logging of one call run in this process.
"""

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_train import write_config

ROOT = Path(__file__).resolve().parents[1]
DEMO_CONFIG = ROOT / "configs" / "diffusion" / "train" / "demo.py"
SAMPLE_CONFIG = ROOT / "configs" / "diffusion" / "inference" / "demo.py"
TRAIN, SAMPLE, CONVERT = "scripts/diffusion/train.py", "scripts/diffusion/inference.py", "tools/convert_checkpoint.py"
TINY = dict(
    in_channels=16,
    hidden_size=64,
    num_heads=2,
    depth_double=1,
    depth_single=1,
    text_dim=32,
    pooled_dim=24,
    axes_dims=(8, 12, 12),
)


# ---- helpers --------------------------------------------------------------------------------------------------------
def run(script: str, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    try:
        return subprocess.run(
            [sys.executable, str(ROOT / script), *map(str, args)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"{script} {args} hung: no result within {timeout} s\n{(expired.stderr or b'')[-3000:]}")


@pytest.fixture
def convert(capsys):
    """``convert_checkpoint.py ARGS`` called in this process (its ``main``: the same parsing and error handling as the
    script, without paying a Python start-up per call); returns what ``run`` returns."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_checkpoint", ROOT / CONVERT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def call(*args):
        capsys.readouterr()
        code = module.main([str(a) for a in args])
        out = capsys.readouterr()
        return subprocess.CompletedProcess([sys.executable, CONVERT, *args], code, out.out, out.err)

    return call


def assert_refused(result: subprocess.CompletedProcess, *phrases: str) -> str:
    """Exit code 2, no traceback, and one ``prog: error:`` line on stderr holding every phrase."""
    log = result.stderr[-4000:]
    assert result.returncode == 2, f"exit code {result.returncode}:\n{log}"
    assert "Traceback" not in result.stderr, log
    prog = Path(result.args[1]).name
    lines = [text for text in result.stderr.splitlines() if text.startswith(f"{prog}: error: ")]
    assert len(lines) == 1, log
    line = lines[0]
    for phrase in phrases:
        assert phrase in line, f"{phrase!r} not in {line!r}"
    return line


def snapshot(root: Path) -> dict:
    """Every file under ``root`` with its bytes' size and modification time: equal snapshots = nothing touched."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


# ---- shared data: a tiny dataset, a tiny config and one trained run ---------------------------------------------------
@pytest.fixture(scope="module")
def work(tmp_path_factory):
    from opensora.datasets.moving_shapes import write_dataset

    root = tmp_path_factory.mktemp("bad_inputs")
    csv = Path(write_dataset(root / "data", num=4, seed=0, height=32, width=32, num_frames=4, progress=False))
    header, *rows = csv.read_text().splitlines()
    tables = {"one_clip": [rows[0]], "header_only": []}
    broken_rows = []
    for i, row in enumerate(rows):  # metadata says "4 frames of 32x32", the files are garbage
        (root / "data" / f"broken{i}.mp4").write_bytes(os.urandom(2000))
        broken_rows.append(",".join([f"broken{i}.mp4"] + row.split(",")[1:]))
    tables["broken"] = broken_rows
    for name, lines in tables.items():
        (root / "data" / f"{name}.csv").write_text("\n".join([header, *lines]) + "\n")
    tiny = write_config(
        root / "tiny.py",
        DEMO_CONFIG,
        dataset=dict(data_path=str(csv)),
        num_workers=0,
        bucket_config={"_delete_": True, "32x32": {4: (1.0, 2)}},
        tensorboard=False,
    )
    # the one trained run: started with --overwrite over an earlier (fake) run, which must be moved aside whole
    run_dir = root / "run"
    (run_dir / "checkpoints" / "step-0000005").mkdir(parents=True)
    (run_dir / "checkpoints" / "step-0000005" / "COMPLETE").write_text("{}\n")
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 5, "loss": 1.0}) + "\n")
    old_run = snapshot(run_dir)
    result = run(TRAIN, tiny, "--outputs", run_dir, "--max-steps", "1", "--overwrite", timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return dict(root=root, csv=csv, tiny=tiny, run=run_dir, data=root / "data", old_run=old_run)


# ---- train.py ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "flags, phrases",
    [
        (["--max-steps", "-5"], ["--max-steps must be >= 1", "-5"]),
        (["--ckpt-every", "-1"], ["--ckpt-every must be >= 0"]),
        (["--seed", "-3"], ["--seed must be >= 0 and <= 4294967295"]),
        (["--grad-accum", "0"], ["--grad-accum must be >= 1"]),
        (["--no-such-key", "1"], ["unknown config key 'no-such-key'"]),
    ],
)
def test_train_flag_out_of_range_is_one_line(work, tmp_path, flags, phrases):
    assert_refused(run(TRAIN, work["tiny"], "--outputs", tmp_path / "out", *flags), *phrases)
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_missing_config_file_and_debug_keeps_the_traceback(tmp_path):
    assert_refused(run(TRAIN, tmp_path / "nope.py"), "config file not found", "nope.py")
    debug = run(TRAIN, tmp_path / "nope.py", "--debug")
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "FileNotFoundError" in debug.stderr


def test_fresh_run_into_a_run_dir_is_refused_and_nothing_is_touched(work):
    before = snapshot(work["run"])
    line = assert_refused(
        run(TRAIN, work["tiny"], "--outputs", work["run"], "--max-steps", "2"),
        "already holds a run",
        "step-0000001",
        "--resume auto",
        "--outputs",
        "--overwrite",
    )
    assert "--outputs" in line
    assert snapshot(work["run"]) == before


def test_overwrite_moves_the_old_run_aside(work):
    aside = [p for p in work["root"].iterdir() if p.name.startswith("run.replaced-")]
    assert len(aside) == 1 and snapshot(aside[0]) == work["old_run"]  # the old run, whole, under its new name
    assert [json.loads(line)["step"] for line in (work["run"] / "metrics.jsonl").read_text().splitlines()] == [1]
    assert sorted(p.name for p in (work["run"] / "checkpoints").iterdir()) == ["step-0000001"]


def test_load_of_a_run_dir_lists_its_checkpoints(work, tmp_path):
    before = snapshot(work["run"])
    assert_refused(
        run(TRAIN, work["tiny"], "--outputs", tmp_path / "out", "--load", work["run"]),
        "is a run (outputs) directory",
        "step-0000001",
    )
    assert_refused(
        run(TRAIN, work["tiny"], "--outputs", tmp_path / "out", "--load", tmp_path / "missing"),
        "no such checkpoint directory",
    )
    assert snapshot(work["run"]) == before


def test_load_with_other_shapes_names_the_first_mismatching_tensor(work, tmp_path):
    checkpoint = work["run"] / "checkpoints" / "step-0000001"
    line = assert_refused(
        run(
            TRAIN,
            work["tiny"],
            "--outputs",
            tmp_path / "out",
            "--load",
            checkpoint,
            "--model.mlp_ratio",
            "2.0",
            timeout=300,
        ),
        "does not fit",
        "has shape [512, 128] in the checkpoint but [256, 128] in the model",
    )
    assert "mlp" in line


@pytest.mark.parametrize(
    "table, phrases",
    [
        ("one_clip", ["no full global batch", "1 usable sample(s) of 1", "batch size 2 x 1 rank(s) = 2 samples"]),
        ("broken", ["epoch 0 yielded no batch", "4 bad file(s)", "broken"]),
    ],
)
def test_dataset_without_a_full_batch_stops_instead_of_hanging(work, tmp_path, table, phrases):
    result = run(
        TRAIN,
        work["tiny"],
        "--outputs",
        tmp_path / "out",
        "--max-steps",
        "3",
        "--dataset.data_path",
        work["data"] / f"{table}.csv",
        timeout=180,
    )  # a hang fails at the timeout
    assert_refused(result, *phrases)
    assert not list((tmp_path / "out").glob("checkpoints/step-*"))


def test_bad_tables_name_the_file(work, tmp_path):
    """Header-only, empty and text-less tables through the dataset class the trainer builds (the CLI path of its
    errors is covered above); ``allow_empty_text`` accepts a table without captions on purpose."""
    from opensora.cli_errors import UserInputError
    from opensora.datasets import VideoTextDataset

    with pytest.raises(UserInputError, match="header_only.csv has a header but no rows"):
        VideoTextDataset(str(work["data"] / "header_only.csv"))
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(UserInputError, match="empty.csv is empty"):
        VideoTextDataset(str(empty))
    notext = work["data"] / "notext.csv"
    notext.write_text(
        "\n".join(",".join(line.split(",")[:1] + line.split(",")[2:6]) for line in work["csv"].read_text().splitlines())
        + "\n"
    )
    with pytest.raises(UserInputError, match="notext.csv has no 'text'.*allow_empty_text=True"):
        VideoTextDataset(str(notext))
    assert VideoTextDataset(str(notext), allow_empty_text=True).texts == [""] * 4


def test_too_few_clips_for_the_ranks_names_what_a_global_batch_needs():
    """Two ranks, batch size 2, three clips: one batch exists but a global batch needs two (one per rank)."""
    import numpy as np

    from opensora.cli_errors import UserInputError
    from opensora.datasets.sampler import BucketBatchSampler

    class Table:
        heights, widths = np.full(3, 32), np.full(3, 32)

        def usable_frames(self):
            return np.full(3, 4)

    for rank in range(2):
        sampler = BucketBatchSampler(Table(), {"32x32": {4: (1.0, 2)}}, num_replicas=2, rank=rank)
        with pytest.raises(
            UserInputError,
            match=r"3 usable sample\(s\) of 3 .* batch size 2 x 2 rank\(s\) = 4 "
            r"samples, 3 fit it",
        ):
            sampler.check_has_batches("meta.csv")


# ---- checkpoint save on a full disk -------------------------------------------------------------------------------
def test_disk_full_during_save_names_the_path_and_cleans_up(tmp_path, monkeypatch, capsys):
    from opensora.cli_errors import run_cli
    from opensora.training import checkpoint as ckpt
    from opensora.training.checkpoint_checks import CheckpointSaveError

    outputs = tmp_path / "out"
    good = ckpt.save_checkpoint(outputs, 1, {}, extra_state={"trainer": {"step": 1}})
    before = snapshot(good)
    real_save = torch.save

    def full_disk(obj, path, *args, **kwargs):  # half a file, then the disk is full
        Path(path).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointSaveError) as error:
        ckpt.save_checkpoint(outputs, 2, {}, extra_state={"trainer": {"step": 2}})
    message = str(error.value)
    assert "step-0000002" in message and "no space left on device" in message and "bytes free" in message
    assert sorted(p.name for p in (outputs / "checkpoints").iterdir()) == ["step-0000001"]  # tmp dir gone at once
    assert snapshot(good) == before

    def save_step_3(argv):
        ckpt.save_checkpoint(outputs, 3, {}, extra_state={})

    assert run_cli(save_step_3, [], prog="train.py") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("train.py: error: saving checkpoint") and "bytes free" in err[0]
    monkeypatch.setattr(torch, "save", real_save)


# ---- inference.py -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "flags, phrases",
    [
        (["--bogus-key", "1"], ["unknown config key 'bogus-key'"]),
        (["--num-steps", "0"], ["--num-steps must be >= 1"]),
        (["--batch-size", "0"], ["--batch-size must be >= 1"]),
        (["--cond-type", "i3v"], ["--cond-type 'i3v' is not one of"]),
        (["--save-dir", "FILE"], ["is a file"]),
    ],
)
def test_inference_bad_flags_are_one_line(tmp_path, flags, phrases):
    file = tmp_path / "samples.mp4"
    file.write_bytes(b"not a directory")
    flags = [str(file) if flag == "FILE" else flag for flag in flags]
    assert_refused(run(SAMPLE, SAMPLE_CONFIG, "--ckpt", tmp_path, "--prompt", "a red circle", *flags), *phrases)
    assert file.read_bytes() == b"not a directory"


def test_inference_with_other_shapes_names_the_first_mismatching_tensor(work, tmp_path):
    before = snapshot(work["run"])
    assert_refused(
        run(
            SAMPLE,
            SAMPLE_CONFIG,
            "--ckpt",
            work["run"],
            "--prompt",
            "a red circle",
            "--save-dir",
            tmp_path / "samples",
            "--model.mlp_ratio",
            "2.0",
            timeout=180,
        ),
        "does not fit",
        "has shape [512, 128] in the checkpoint but [256, 128] in the model",
    )
    assert snapshot(work["run"]) == before


def test_inference_missing_config(tmp_path):
    assert_refused(run(SAMPLE, tmp_path / "missing.py", "--prompt", "x"), "config file not found", "missing.py")


def test_long_prompt_warns_once_with_its_token_count(caplog):
    from opensora.models.text.conditioner import TextConditioner

    encoder = TextConditioner()
    with caplog.at_level("WARNING", logger="opensora.models.text.conditioner"):
        encoder.encode(["a" * 100, "short"])
        encoder.encode(["b" * 300])
    warnings = [r.getMessage() for r in caplog.records if "longer" in r.getMessage() or "more than" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "101 tokens" in warnings[0] and f"limit of {encoder.max_length}" in warnings[0]


# ---- convert_checkpoint.py: foreign files, hostile files --------------------------------------------------------------
def _tiny_model(seed=0, **overrides):
    from opensora.models.mmdit import MMDiT

    torch.manual_seed(seed)
    model = MMDiT(**{**TINY, **overrides})
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn_like(param) * 0.3 + (1.0 if name.endswith("_scale") else 0.0))
    return model


def test_converter_refuses_files_that_are_not_safetensors_and_keeps_dst(tmp_path, convert):
    bogus = tmp_path / "model.pt"
    bogus.write_bytes(b"\x80\x02not safetensors at all")
    assert_refused(run(CONVERT, bogus, tmp_path / "out.safetensors"), "model.pt is not a safetensors file")
    assert_refused(convert("inspect", bogus), "is not a safetensors file")
    assert_refused(convert(tmp_path / "missing", tmp_path / "out.safetensors"), "does not exist")
    src, dst = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file(_tiny_model().state_dict(), str(src))
    dst.write_bytes(b"precious")
    assert_refused(convert(src, dst), "already exists", "--overwrite")
    assert dst.read_bytes() == b"precious"


def test_a_checkpoint_cannot_run_code(tmp_path, convert):
    from opensora.convert.arch import arch_to_json

    marker = tmp_path / "PWNED"
    payload = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\nmodel = dict(type='MMDiT')\n"
    model = _tiny_model()
    crafted = tmp_path / "crafted.safetensors"
    save_file(model.state_dict(), str(crafted), metadata={"config": payload, "step": "3"})

    assert run(CONVERT, "inspect", crafted).returncode == 0
    assert_refused(
        run(CONVERT, crafted, tmp_path / "flux", "--to", "diffusers"), "only config text", "never run", "--config"
    )
    assert convert(crafted, tmp_path / "os2.safetensors", "--to", "opensora2").returncode == 0
    assert_refused(
        convert(tmp_path / "os2.safetensors", tmp_path / "back.safetensors", "--from", "opensora"), "--axes-dims"
    )  # no arch record: the RoPE split must be given, never guessed
    assert not marker.exists()

    # the same file with a JSON architecture converts, and still never runs its config text
    with_arch = tmp_path / "with_arch.safetensors"
    save_file(model.state_dict(), str(with_arch), metadata={"config": payload, "arch": arch_to_json(model.arch)})
    assert convert(with_arch, tmp_path / "flux2", "--to", "diffusers").returncode == 0
    assert (tmp_path / "flux2" / "config.json").is_file() and not marker.exists()

    # --config: the user's own config file gives the architecture for an old file
    own = tmp_path / "own.py"
    own.write_text(f"model = dict(type='MMDiT', **{TINY!r})\n")
    assert convert(crafted, tmp_path / "flux3", "--to", "diffusers", "--config", own).returncode == 0
    assert not marker.exists()


# ---- Open-Sora 2.0 RoPE pairing: a reference of both conventions, written from upstream's definitions ---------------
def _freqs(ids, axes_dims, theta=10000.0):
    """Angles [N, D/2]: per axis, pos * theta^(-2j/d_axis), axes concatenated (Flux ``rope`` / Open-Sora ``liger_rope``)."""
    parts = [ids[:, a, None].double() / theta ** (torch.arange(0, d, 2).double() / d) for a, d in enumerate(axes_dims)]
    return torch.cat(parts, dim=-1)


def _rope_adjacent(x, angles):
    """use_liger_rope=False (Flux ``apply_rope``): pair (2j, 2j+1) -> (x0 cos - x1 sin, x0 sin + x1 cos)."""
    x0, x1 = x[..., 0::2].double(), x[..., 1::2].double()
    cos, sin = angles.cos(), angles.sin()
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)


def _rope_half_split(x, angles):
    """use_liger_rope=True: cos/sin repeated twice along D, x * cos + rotate_half(x) * sin (pairs j, j + D/2)."""
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1).double()
    return x.double() * cos + rotated * sin


def _attention(x, wq, bq, wk, bk, wv, bv, q_scale, k_scale, heads, rope, angles):
    """Upstream's attention before the output projection: per-head q/k RMSNorm (eps 1e-6) with scales, RoPE, SDPA."""
    n = x.shape[0]
    split = lambda t: t.view(n, heads, -1).transpose(0, 1).double()  # noqa: E731  [H, N, D]
    q, k, v = split(x @ wq.T + bq), split(x @ wk.T + bk), split(x @ wv.T + bv)
    norm = lambda t, s: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * s.double()  # noqa: E731
    q, k = rope(norm(q, q_scale), angles), rope(norm(k, k_scale), angles)
    weights = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
    return (weights @ v).transpose(0, 1).reshape(n, -1)


def _block_params(state, prefix, single, hidden, theirs):
    """(wq, bq, wk, bk, wv, bv, q_scale, k_scale) of one attention, from our state or from an Open-Sora 2.0 one."""
    if not theirs:
        rows = "linear1" if single else "qkv"
        w, b = state[f"{prefix}.{rows}.weight"], state[f"{prefix}.{rows}.bias"]
        return (
            w[:hidden],
            b[:hidden],
            w[hidden : 2 * hidden],
            b[hidden : 2 * hidden],
            w[2 * hidden : 3 * hidden],
            b[2 * hidden : 3 * hidden],
            state[f"{prefix}.norm.query_scale"],
            state[f"{prefix}.norm.key_scale"],
        )
    v = "v_mlp" if single else "v_proj"
    return (
        state[f"{prefix}.q_proj.weight"],
        state[f"{prefix}.q_proj.bias"],
        state[f"{prefix}.k_proj.weight"],
        state[f"{prefix}.k_proj.bias"],
        state[f"{prefix}.{v}.weight"][:hidden],
        state[f"{prefix}.{v}.bias"][:hidden],
        state[f"{prefix}.norm.query_norm.scale"],
        state[f"{prefix}.norm.key_norm.scale"],
    )


@pytest.mark.parametrize("pairing", ["half-split", "adjacent"])
def test_opensora2_export_computes_upstreams_attention(tmp_path, pairing):
    from opensora.convert.arch import arch_to_json
    from opensora.convert.export import export_weights, import_weights
    from opensora.models.mmdit.rope import video_position_ids

    model = _tiny_model(seed=1)
    ours = {k: v.detach() for k, v in model.state_dict().items()}
    src = tmp_path / "ours.safetensors"
    save_file(ours, str(src), metadata={"arch": arch_to_json(model.arch)})
    dst = tmp_path / "os2.safetensors"
    export_weights(src, dst, to="opensora2", rope_pairing=pairing)
    theirs = load_file(str(dst))

    hidden, heads = TINY["hidden_size"], TINY["num_heads"]
    ids = torch.cat([torch.zeros(3, 3, dtype=torch.long), video_position_ids(2, 3, 4)])  # 3 text tokens, then video
    angles = _freqs(ids, TINY["axes_dims"])
    x = torch.randn(ids.shape[0], hidden, generator=torch.Generator().manual_seed(2))
    upstream_rope = _rope_half_split if pairing == "half-split" else _rope_adjacent
    for prefix, single in [("double_blocks.0.img_attn", False), ("single_blocks.0", True)]:
        want = _attention(x, *_block_params(ours, prefix, single, hidden, False), heads, _rope_adjacent, angles)
        got = _attention(x, *_block_params(theirs, prefix, single, hidden, True), heads, upstream_rope, angles)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
        if pairing == "half-split":  # without the reordering upstream would compute something else (the bug)
            plain = _attention(x, *_block_params(ours, prefix, single, hidden, False), heads, _rope_half_split, angles)
            assert (plain - want).norm() > 1e-2 * want.norm()

    # import: a foreign file (no metadata) in the same pairing comes back to exactly our weights
    foreign = tmp_path / "foreign.safetensors"
    save_file(theirs, str(foreign))
    back = import_weights(
        foreign, tmp_path / "back.safetensors", "opensora", axes_dims=TINY["axes_dims"], rope_pairing=pairing
    )
    restored = load_file(str(back.path))
    assert set(restored) == set(ours) and all(torch.equal(restored[k], ours[k]) for k in ours)


# ---- the other tools take bad input the same way ------------------------------------------------------------------
def test_dataset_and_eval_tools_refuse_in_one_line(work, tmp_path):
    assert_refused(run("tools/make_demo_dataset.py", "--out", tmp_path / "d", "--num", "0"), "need num >= 1")
    assert_refused(run("tools/eval_moving_shapes.py", tmp_path / "samples.csv"), "samples.csv")
    assert_refused(
        run("tools/eval_moving_shapes.py", work["data"] / "header_only.csv", "--no-progress"),
        "header_only.csv lists no videos",
    )


# ---- README launch lines work after `make venv` -------------------------------------------------------------------
def test_readme_activates_the_venv_before_colossalai_run(tmp_path):
    """The README's first command block activates .venv before any launch line; with only the activation on PATH,
    ``colossalai run`` finds torchrun and reaches our script (which then reports its own one-line error)."""
    from dist_utils import find_free_port

    block = (ROOT / "README.md").read_text().split("## Everyday commands", 1)[1].split("```bash", 1)[1].split("```")[0]
    lines = [line for line in block.splitlines() if line and not line.startswith("#")]
    assert lines[0].startswith(". .venv/bin/activate"), lines[0]
    venv_bin = Path(sys.executable).parent
    if not (venv_bin / "activate").is_file() or not (venv_bin / "colossalai").is_file():
        pytest.skip("not running from a venv with the colossalai CLI")
    command = (
        f". {venv_bin / 'activate'} && cd {ROOT} && colossalai run --nproc_per_node 1 --master_port "
        f"{find_free_port()} {TRAIN} {tmp_path / 'missing.py'}"
    )
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": os.environ.get("HOME", str(tmp_path)),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
    }
    result = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, timeout=180)
    output = result.stdout + result.stderr
    assert "command not found" not in output, output[-3000:]
    assert "train.py: error: config file not found" in output, output[-3000:]
