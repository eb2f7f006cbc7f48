"""What a run survives: damaged checkpoints, two runs on one outputs directory, preemption signals, pickles that
would run code, a full disk, shapes the model cannot take, and a ``--max-steps`` that trains nothing.

Each case goes through the real command line (``train.py``, ``inference.py``, ``convert_checkpoint.py``) and asserts
the one line and exit code the user sees, and that nothing on disk was lost or half-written. The two-rank preemption
case lives in ``test_train.py`` (it compares with that module's uninterrupted two-rank run).
"""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_bad_inputs import assert_refused, run, snapshot
from test_train import by_step, read_metrics, write_config

from opensora.checkpoint_manifest import MANIFEST_FILE, verify_checkpoint, write_manifest

ROOT = Path(__file__).resolve().parents[1]
TRAIN_CONFIG = ROOT / "configs" / "diffusion" / "train" / "demo.py"
SAMPLE_CONFIG = ROOT / "configs" / "diffusion" / "inference" / "demo.py"
TRAIN, SAMPLE, CONVERT = "scripts/diffusion/train.py", "scripts/diffusion/inference.py", "tools/convert_checkpoint.py"


def in_process(script: str, *args, capsys) -> subprocess.CompletedProcess:
    """``script ARGS`` through its ``main`` in this process: the same parsing and one-line error handling as the
    script, without an interpreter start and the imports per call (refusals and short runs)."""
    import importlib
    import importlib.util

    from opensora.cli_errors import run_cli

    capsys.readouterr()
    argv = [str(a) for a in args]
    if script == CONVERT:
        spec = importlib.util.spec_from_file_location("convert_checkpoint", ROOT / CONVERT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        code = module.main(argv)
    else:
        module = "opensora.training.launch" if script == TRAIN else "opensora.inference.cli"
        code = run_cli(importlib.import_module(module).main, argv, prog=Path(script).name)
    out = capsys.readouterr()
    return subprocess.CompletedProcess([sys.executable, script, *argv], code, out.out, out.err)


@pytest.fixture(autouse=True)
def _keep_environment():
    """An in-process run sets the torchrun variables (a free MASTER_PORT its process group keeps listening on): a
    later subprocess must not inherit them."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def forbid_building_the_trainer(monkeypatch) -> None:
    """Fail the test if the refusal under test comes only after the trainer (models, data) was built."""
    import opensora.training.trainer

    def built(*args, **kwargs):
        raise AssertionError("the trainer was built before the refusal")

    monkeypatch.setattr(opensora.training.trainer.Trainer, "__init__", built)


def start(script: str, *args) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return subprocess.Popen(
        [sys.executable, str(ROOT / script), *map(str, args)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(condition, timeout: float = 120.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def metrics_rows(outputs: Path) -> int:
    path = outputs / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


# ---- one trained run: checkpoints at steps 2 and 4 -------------------------------------------------------------------
@pytest.fixture(scope="module")
def work(tmp_path_factory):
    from opensora.datasets.moving_shapes import write_dataset

    root = tmp_path_factory.mktemp("reliability")
    csv = Path(write_dataset(root / "data", num=4, seed=0, height=32, width=32, num_frames=4, progress=False))
    tiny = write_config(
        root / "tiny.py",
        TRAIN_CONFIG,
        dataset=dict(data_path=str(csv)),
        num_workers=0,
        bucket_config={"_delete_": True, "32x32": {4: (1.0, 2)}},
        keep_last=3,
    )
    trained = root / "trained"
    result = run(TRAIN, tiny, "--outputs", trained, "--max-steps", 4, "--ckpt-every", 2, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (trained / "checkpoints" / "step-0000004" / MANIFEST_FILE).is_file()
    return dict(root=root, tiny=tiny, trained=trained, csv=csv)


def copy_run(work, name: str) -> Path:
    target = work["root"] / name
    shutil.copytree(work["trained"], target)
    return target


def truncate(path: Path, size: int = 100) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


# ---- damaged checkpoints ---------------------------------------------------------------------------------------------
def test_resume_auto_skips_a_damaged_checkpoint_and_continues_exactly(work):
    """The issue's case: the newest checkpoint's model shard and EMA truncated, its marker kept. ``--resume auto``
    warns naming it, resumes from step 2 (steps 3-4 equal the original ones bit for bit) and leaves it in place."""
    outputs = copy_run(work, "damaged_auto")
    newest = outputs / "checkpoints" / "step-0000004"
    truncate(next((newest / "model" / "model").glob("*.safetensors")))
    truncate(newest / "model" / "ema.safetensors")
    original = by_step(read_metrics(work["trained"]))

    result = run(TRAIN, work["tiny"], "--outputs", outputs, "--max-steps", 4, "--resume", "auto", timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    warning = [line for line in result.stderr.splitlines() if "skipping a damaged checkpoint" in line]
    assert len(warning) == 1 and "step-0000004" in warning[0] and "has 100 bytes" in warning[0], result.stderr[-3000:]
    assert "resumed from" in result.stderr and "step-0000002 at step 2" in result.stderr
    resumed = by_step(read_metrics(outputs))
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (3, 4):
        assert (
            resumed[step]["loss"] == original[step]["loss"]
            and resumed[step]["grad_norm"] == original[step]["grad_norm"]
        )
    assert verify_checkpoint(outputs / "checkpoints" / "step-0000002", checksums=True)


def test_damaged_load_is_one_line_and_the_run_dir_is_untouched(work, capsys, monkeypatch):
    """``--load`` of a damaged checkpoint into an existing run: one line naming the file, nothing written first
    (no config.py rewrite, no new tensorboard file, no metrics truncation)."""
    outputs = copy_run(work, "damaged_load")
    checkpoint = outputs / "checkpoints" / "step-0000004"
    flip_a_byte(checkpoint / "model" / "ema.safetensors")  # same size: only the checksum can tell
    before = snapshot(outputs)
    forbid_building_the_trainer(monkeypatch)
    result = in_process(
        TRAIN, work["tiny"], "--outputs", outputs, "--max-steps", 6, "--load", checkpoint, capsys=capsys
    )
    assert_refused(result, "is damaged", "ema.safetensors", "does not match its manifest's checksum")
    assert snapshot(outputs) == before


def test_sampling_and_converting_a_damaged_checkpoint_name_the_file(work, tmp_path, capsys):
    outputs = copy_run(work, "damaged_readers")
    checkpoint = outputs / "checkpoints" / "step-0000004"
    ema = checkpoint / "model" / "ema.safetensors"
    truncate(ema)
    before = snapshot(outputs)
    save_dir = tmp_path / "samples"
    result = run(SAMPLE, SAMPLE_CONFIG, "--ckpt", checkpoint, "--prompt", "a red circle", "--save-dir", save_dir)
    assert_refused(result, f"{ema} has 100 bytes")
    # the run whose newest checkpoint it is; the converter
    result = in_process(
        SAMPLE, SAMPLE_CONFIG, "--ckpt", outputs, "--prompt", "a", "--save-dir", save_dir, capsys=capsys
    )
    assert_refused(result, f"{ema} has 100 bytes")
    assert not save_dir.exists()
    assert_refused(in_process(CONVERT, checkpoint, tmp_path / "out.safetensors", capsys=capsys), f"{ema} has 100 bytes")
    assert not (tmp_path / "out.safetensors").exists()
    shutil.copy2(work["trained"] / "checkpoints" / "step-0000004" / "model" / "ema.safetensors", ema)
    before = snapshot(outputs)
    flip_a_byte(checkpoint / "model" / "arch.json")  # same size: sampling checks checksums only when asked
    result = in_process(
        SAMPLE,
        SAMPLE_CONFIG,
        "--ckpt",
        checkpoint,
        "--prompt",
        "a",
        "--save-dir",
        save_dir,
        "--verify-checkpoint",
        capsys=capsys,
    )
    assert_refused(result, "arch.json does not match its manifest's checksum")
    assert not save_dir.exists()
    assert {k: v for k, v in snapshot(outputs).items() if not k.endswith("arch.json")} == {
        k: v for k, v in before.items() if not k.endswith("arch.json")
    }


def test_a_checkpoint_without_manifest_still_loads_and_says_so(work, tmp_path):
    """Saved before manifests: it converts (with a log line saying it is not verified); a truncated safetensors file
    in it is still one line naming the file (its header and size disagree), never a SafetensorError traceback."""
    outputs = copy_run(work, "old_format")
    checkpoint = outputs / "checkpoints" / "step-0000004"
    (checkpoint / MANIFEST_FILE).unlink()
    result = run(CONVERT, checkpoint, tmp_path / "old.safetensors")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "has no manifest.json (saved by an older version): its files are not verified" in result.stderr
    ema = checkpoint / "model" / "ema.safetensors"
    truncate(ema, ema.stat().st_size - 100)
    result = run(CONVERT, checkpoint, tmp_path / "truncated.safetensors")
    assert_refused(result, f"{ema} is damaged", "its header describes", "truncated")
    assert not (tmp_path / "truncated.safetensors").exists()


# ---- pickles that would run code -------------------------------------------------------------------------------------
class _CreatesAFile:
    """Unpickling this calls ``open(marker, 'w')``: code run by loading a file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("victim", ["model/lr_scheduler.pt", "model/optimizer/pytorch_optim_group.bin"])
def test_code_bearing_pickle_is_refused_even_with_weights_only_forced_off(work, tmp_path, victim, capsys, monkeypatch):
    """ColossalAI loads these two files with a bare ``torch.load``; with ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` that
    would unpickle anything. A crafted file (its manifest rewritten to match, as an attacker would) is refused."""
    outputs = copy_run(work, f"pickle_{Path(victim).stem}")
    checkpoint = outputs / "checkpoints" / "step-0000004"
    marker = tmp_path / "code_ran"
    torch.save({"payload": _CreatesAFile(marker)}, checkpoint / victim)
    probe = tmp_path / "probe_ran"  # the file really runs code when loaded without weights_only
    torch.save({"payload": _CreatesAFile(probe)}, tmp_path / "probe.pt")
    torch.load(tmp_path / "probe.pt", weights_only=False)
    assert probe.exists()
    write_manifest(checkpoint)
    before = snapshot(outputs)

    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    result = in_process(TRAIN, work["tiny"], "--outputs", outputs, "--max-steps", 6, "--resume", "auto", capsys=capsys)
    assert_refused(result, str(checkpoint / victim), "holds code-bearing pickle data")
    assert "weights_only=False" not in result.stderr
    assert not marker.exists(), "loading the checkpoint ran code"
    assert snapshot(outputs) == before


# ---- one run per outputs directory, graceful stop, stale lock --------------------------------------------------------
def test_a_live_run_holds_its_outputs_and_a_signal_stops_it_with_a_checkpoint(work, capsys):
    """A second run and ``--overwrite`` are refused while a run is live (naming its host and pid); SIGTERM makes it
    finish its step, save and exit with code 75; a lock left by a dead process is taken over."""
    outputs = work["root"] / "live"
    live = start(TRAIN, work["tiny"], "--outputs", outputs, "--max-steps", 100000, "--ckpt-every", 100000)
    try:
        wait_for(lambda: metrics_rows(outputs) >= 2 or live.poll() is not None, what="the first steps")
        assert live.poll() is None, live.stderr.read()[-3000:]
        lock = json.loads((outputs / ".run.lock").read_text())
        assert lock["pid"] == live.pid
        for extra in (["--resume", "auto"], ["--overwrite"]):
            result = in_process(TRAIN, work["tiny"], "--outputs", outputs, "--max-steps", 4, *extra, capsys=capsys)
            line = assert_refused(result, "in use by another run", f"pid {live.pid}", f"host {lock['host']}")
            assert line.startswith("train.py: error: --overwrite refused") == ("--overwrite" in extra)
        assert not list(work["root"].glob("live.replaced-*")), "--overwrite moved a live run's directory"
        live.send_signal(signal.SIGTERM)
        _, stderr = live.communicate(timeout=120)
    finally:
        if live.poll() is None:
            live.kill()
    assert live.returncode == 75, stderr[-3000:]
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("train.py: stopped by SIGTERM after step ") and "continue with --resume auto" in last
    step = int(last.split("after step ")[1].split(":")[0])
    checkpoint = outputs / "checkpoints" / f"step-{step:07d}"
    assert verify_checkpoint(checkpoint, checksums=True)
    assert [r["step"] for r in read_metrics(outputs)] == list(range(1, step + 1))
    assert not (outputs / ".run.lock").exists()

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = dict(host=lock["host"], pid=int(dead.stdout), started=time.time() - 60)
    (outputs / ".run.lock").write_text(json.dumps(stale) + "\n")
    # taken over (else "in use"); the run is finished at that --max-steps (a requeue): nothing to do, exit 0
    before = {name: entry for name, entry in snapshot(outputs).items() if name != ".run.lock"}
    result = in_process(
        TRAIN, work["tiny"], "--outputs", outputs, "--max-steps", step, "--resume", "auto", capsys=capsys
    )
    assert result.returncode == 0 and "already finished" in result.stderr and "nothing to train" in result.stderr
    assert not (outputs / ".run.lock").exists()
    assert snapshot(outputs) == before
    # below the newest step: refused, saying what to pass
    result = in_process(
        TRAIN, work["tiny"], "--outputs", outputs, "--max-steps", step - 1, "--resume", "auto", capsys=capsys
    )
    assert_refused(result, f"the newest checkpoint {checkpoint} is at step {step}", f"pass --max-steps {2 * step - 1}")
    assert not (outputs / ".run.lock").exists()


_SLOW_DISK_TRAIN = """
import sys, time
import opensora.training.checkpoint as checkpoint
real = checkpoint.write_manifest
checkpoint.write_manifest = lambda directory: (time.sleep(120), real(directory))[1]  # a save that takes long
from opensora.cli_errors import run_cli
from opensora.training.launch import main
sys.exit(run_cli(main, sys.argv[1:], prog="train.py"))
"""


def test_a_second_signal_stops_at_once_and_removes_the_partial_checkpoint(work):
    """The first SIGTERM asks for a checkpoint at the end of the step; a second one (past the 2 s in which a
    launcher's forwarded copy counts as the same request) arrives while that checkpoint is being written (a slow
    disk, injected): the run exits at once with 128 + 15 and leaves no checkpoint, not even a partial one."""
    outputs = work["root"] / "twice"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    args = [work["tiny"], "--outputs", outputs, "--max-steps", 100000, "--ckpt-every", 100000]
    live = subprocess.Popen(
        [sys.executable, "-c", _SLOW_DISK_TRAIN, *map(str, args)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    checkpoints = outputs / "checkpoints"
    try:
        wait_for(lambda: metrics_rows(outputs) >= 1 or live.poll() is not None, what="the first step")
        live.send_signal(signal.SIGTERM)
        first = time.monotonic()
        wait_for(lambda: list(checkpoints.glob(".tmp-step-*")) or live.poll() is not None, what="the save")
        assert live.poll() is None
        time.sleep(max(0.0, first + 2.2 - time.monotonic()))
        live.send_signal(signal.SIGTERM)
        _, stderr = live.communicate(timeout=30)
    finally:
        if live.poll() is None:
            live.kill()
    assert live.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("train.py: second SIGTERM: stopped at once without a new checkpoint; removed the partial")
    assert list(checkpoints.iterdir()) == []


def test_a_second_signal_during_a_save_removes_the_partial_checkpoint(tmp_path):
    """The helper thread acts even while the main thread is busy: the partial ``.tmp-step-*`` directory goes, the
    complete checkpoints stay."""
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "step-0000002").mkdir(parents=True)
    (checkpoints / "step-0000002" / "COMPLETE").write_text("{}\n")
    (checkpoints / ".tmp-step-0000004" / "model").mkdir(parents=True)
    script = (
        "import os, signal, time\n"
        "from opensora.training.preemption import Preemption\n"
        f"with Preemption({str(checkpoints)!r}, window_s=0.0) as p:\n"
        "    os.kill(os.getpid(), signal.SIGUSR1)\n"
        "    time.sleep(0.5)\n"
        "    assert p.requested and p.signal_name == 'SIGUSR1'\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    sum(i * i for i in range(10**9))  # busy: a Python handler would not run before this ends\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 128 + signal.SIGINT, result.stderr
    assert "removed the partial save .tmp-step-0000004" in result.stderr
    assert not (checkpoints / ".tmp-step-0000004").exists() and (checkpoints / "step-0000002" / "COMPLETE").is_file()


def test_a_process_whose_loader_workers_ignore_sigterm_still_exits(tmp_path):
    """Loader workers ignore stop signals (graceful preemption); at interpreter exit multiprocessing terminates its
    daemonic children with SIGTERM and then joins them without a timeout, so an open loader once hung every GPU
    training run after its last step. The loader shuts its workers down itself at exit."""
    script = (
        "import time\n"
        "from opensora.datasets.dataloader import build_dataloader\n"
        "from opensora.datasets.moving_shapes_dataset import MovingShapesDataset\n"
        "dataset = MovingShapesDataset(num=16, seed=0, height=32, width=32, num_frames=8)\n"
        "loader, _ = build_dataloader(dataset, {'32x32': {8: (1.0, 2)}}, num_workers=3, persistent_workers=True,\n"
        "                             multiprocessing_context='fork', world_size=1, rank=0)\n"
        "batches = loader.batches_forever()\n"
        "next(batches)\n"
        "print(time.time(), flush=True)\n"
    )
    start = time.time()
    result = subprocess.run(
        [sys.executable, "-c", PINNED_WORKER_EXIT_HOOKS + script],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    last_step = float(result.stdout.split()[-1])
    # torch's per-worker hooks alone would take 5 s a worker (15 s) before the workers are told to stop
    assert time.time() - max(last_step, start) < 4.0, "the loader's workers were not shut down first at exit"


# What torch (up to 2.12) does when it builds an iterator over persistent workers with pinned memory (a GPU run): one
# exit hook per worker that joins it for 5 s, then sends SIGTERM. A CPU-only torch never pins, so the test adds them.
PINNED_WORKER_EXIT_HOOKS = """
import atexit
from torch.utils.data import dataloader as _torch_loader
def _join_then_terminate(worker):
    try:
        worker.join(timeout=5.0)
    finally:
        if worker.is_alive():
            worker.terminate()
_original_init = _torch_loader._MultiProcessingDataLoaderIter.__init__
def _init_with_pinned_exit_hooks(self, loader):
    _original_init(self, loader)
    for worker in self._workers:
        atexit.register(_join_then_terminate, worker)
_torch_loader._MultiProcessingDataLoaderIter.__init__ = _init_with_pinned_exit_hooks
"""


# ---- a full disk, however the serializer says it ---------------------------------------------------------------------
FULL_DISK_ERRORS = {
    "torch zip writer": lambda: RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 2688 vs 2574"),
    "errno": lambda: OSError(errno.ENOSPC, "No space left on device"),
    "safetensors": lambda: __import__("safetensors").SafetensorError(
        'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
    ),
}


@pytest.mark.parametrize("kind", sorted(FULL_DISK_ERRORS))
def test_disk_full_reads_the_same_however_the_serializer_reports_it(work, tmp_path, monkeypatch, capsys, kind):
    """The second save fails inside the serializer (fault injected at torch.save / safetensors' save_file): one
    line saying no space is left, the earlier checkpoint intact and verified, no temporary directory left."""
    import safetensors.torch

    outputs = tmp_path / "run"
    real = {"torch": torch.save, "safetensors": safetensors.torch.save_file}
    library = "safetensors" if kind == "safetensors" else "torch"

    def failing(obj, target, *args, **kwargs):
        if "step-0000004" in str(target):
            raise FULL_DISK_ERRORS[kind]()
        return real[library](obj, target, *args, **kwargs)

    if library == "torch":
        monkeypatch.setattr(torch, "save", failing)
    else:
        monkeypatch.setattr(safetensors.torch, "save_file", failing)
        monkeypatch.setattr("opensora.training.ema.save_file", failing, raising=False)
    result = in_process(TRAIN, work["tiny"], "--outputs", outputs, "--max-steps", 6, "--ckpt-every", 2, capsys=capsys)
    assert_refused(result, "step-0000004 failed: no space left on device", "earlier checkpoints are untouched")
    checkpoints = outputs / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-0000002"]
    assert verify_checkpoint(checkpoints / "step-0000002", checksums=True)
    assert not (outputs / ".run.lock").exists()


# ---- shapes the model cannot take, refused before anything is built --------------------------------------------------
HUNYUAN = dict(
    _delete_=True,
    type="HunyuanVideoVAE",
    config=dict(block_out_channels=(8, 8, 8, 8), layers_per_block=1, latent_channels=4, norm_num_groups=4),
)


@pytest.mark.parametrize(
    "settings, phrases",
    [
        (
            dict(vae=HUNYUAN, bucket_config={"_delete_": True, "32x32": {7: (1.0, 2)}}),
            ["bucket_config['32x32'][7]", "1 + 4*k frames", "use 5 or 9"],
        ),
        (
            dict(bucket_config={"_delete_": True, "33x33": {4: (1.0, 2)}}),
            ["bucket_config['33x33'] gives 33x33 pixels", "multiples of 8"],
        ),
        (
            dict(model=dict(patch_size=(1, 8, 8)), bucket_config={"_delete_": True, "36px": {4: (1.0, 2)}}),
            ["bucket_config['36px'] at aspect ratio", "multiples of 32"],
        ),
    ],
)
def test_training_refuses_bucket_shapes_before_building_anything(
    work, tmp_path, capsys, monkeypatch, settings, phrases
):
    config = write_config(tmp_path / "bad.py", work["tiny"], **settings)
    outputs = tmp_path / "run"
    forbid_building_the_trainer(monkeypatch)
    assert_refused(in_process(TRAIN, config, "--outputs", outputs, "--max-steps", 2, capsys=capsys), *phrases)
    assert not outputs.exists()


def test_sampling_refuses_bad_shapes_and_references_before_building(work, tmp_path, capsys):
    checkpoint = work["trained"] / "checkpoints" / "step-0000004"
    causal = write_config(tmp_path / "causal.py", SAMPLE_CONFIG, vae=HUNYUAN)
    unreadable = tmp_path / "frame.png"
    unreadable.write_bytes(os.urandom(300))
    save_dir = tmp_path / "samples"
    common = ["--ckpt", checkpoint, "--prompt", "a red circle", "--save-dir", save_dir]
    cases = [
        ([causal, *common, "--num-frames", 7], ["--num-frames: HunyuanVideoVAE needs 1 + 4*k frames", "use 5 or 9"]),
        (
            [SAMPLE_CONFIG, *common, "--resolution", "27x27"],
            ["--resolution 27x27 gives 27x27 pixels", "use e.g. 24x24"],
        ),
        ([SAMPLE_CONFIG, *common, "--resolution", "20x36"], ["--resolution 20x36 gives", "use e.g. 16x32"]),
        ([SAMPLE_CONFIG, *common, "--cond-type", "i2v_head"], ["--cond-type i2v_head needs a reference: pass --ref"]),
        ([SAMPLE_CONFIG, *common, "--cond-type", "i2v_head", "--ref", unreadable], ["cannot be read as an image"]),
        ([SAMPLE_CONFIG, *common, "--ref", unreadable], ["is only used by a reference condition"]),
    ]
    for argv, phrases in cases:
        assert_refused(in_process(SAMPLE, *argv, capsys=capsys), *phrases)
        assert not save_dir.exists(), argv
    result = run(SAMPLE, SAMPLE_CONFIG, *common, "--resolution", "27x27")  # and as a user types it
    assert_refused(result, "--resolution 27x27 gives 27x27 pixels")


def test_unwritable_outputs_and_save_dir_are_one_line(work, tmp_path, capsys, monkeypatch):
    """A read-only filesystem (simulated: the probe file cannot be created, as on EROFS even for root)."""
    import opensora.writable

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(opensora.writable.tempfile, "mkstemp", read_only)
    checkpoint = work["trained"] / "checkpoints" / "step-0000004"
    result = in_process(
        SAMPLE, SAMPLE_CONFIG, "--ckpt", checkpoint, "--prompt", "a", "--save-dir", tmp_path / "samples", capsys=capsys
    )
    assert_refused(result, f"--save-dir {tmp_path / 'samples'} is not writable (Read-only file system")
    result = in_process(TRAIN, work["tiny"], "--outputs", tmp_path / "run", "--max-steps", 2, capsys=capsys)
    assert_refused(result, f"--outputs {tmp_path / 'run'} is not writable (Read-only file system")
    result = in_process(CONVERT, checkpoint, tmp_path / "out" / "model.safetensors", capsys=capsys)
    assert_refused(result, f"DST's folder {tmp_path / 'out'} is not writable (Read-only file system")
    assert not any((tmp_path / name).exists() for name in ("samples", "run", "out"))


def test_load_with_max_steps_at_or_below_its_step_says_what_to_pass(work, tmp_path):
    checkpoint = work["trained"] / "checkpoints" / "step-0000004"
    result = run(TRAIN, work["tiny"], "--outputs", tmp_path / "more", "--load", checkpoint, "--max-steps", 3)
    assert_refused(result, "is at step 4", "--max-steps 3 is not past it", "pass --max-steps 7 to train 3 more")
    assert not (tmp_path / "more").exists()


def test_resume_auto_refuses_when_every_checkpoint_is_damaged(work, capsys):
    """A fresh start would drop the run's records: one line instead, and the run directory as it was."""
    outputs = copy_run(work, "all_damaged")
    for checkpoint in (outputs / "checkpoints").iterdir():
        truncate(checkpoint / "extra_state.pt", 10)
    before = snapshot(outputs)
    result = in_process(TRAIN, work["tiny"], "--outputs", outputs, "--max-steps", 6, "--resume", "auto", capsys=capsys)
    assert_refused(result, "--resume auto: every checkpoint under", "is damaged")
    assert snapshot(outputs) == before


def test_the_lock_itself_two_claims_stale_records_and_a_half_written_one(tmp_path):
    """The O_EXCL claim that two runs started together race for (the pre-check cannot see a lock not yet written)."""
    import socket

    from opensora.training.run_lock import LOCK_FILE, RunLock, RunLockedError

    outputs = tmp_path / "run"
    first = RunLock(outputs).acquire()
    with pytest.raises(RunLockedError, match=f"host {socket.gethostname()}, pid {os.getpid()}"):
        RunLock(outputs).acquire()
    first.release()
    assert not outputs.exists(), "a lock that created the directory removes it when the run left nothing"

    outputs.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock = outputs / LOCK_FILE
    lock.write_text(json.dumps(dict(host=socket.gethostname(), pid=int(dead.stdout), started=time.time())) + "\n")
    RunLock(outputs).acquire().release()  # a dead holder: taken over
    lock.write_text(json.dumps(dict(host=socket.gethostname(), pid=os.getpid(), started=time.time() - 10**6)))
    RunLock(outputs).acquire().release()  # our pid, but this process started after that lock: a reused pid
    lock.write_text("")  # a holder that died between creating and writing the file, long ago
    os.utime(lock, (time.time() - 60, time.time() - 60))
    RunLock(outputs).acquire().release()
    lock.write_text(json.dumps(dict(host="another-node", pid=1, started=time.time())))
    with pytest.raises(RunLockedError, match="host another-node, pid 1"):  # alive until its heartbeat stops
        RunLock(outputs).acquire()
    os.utime(lock, (time.time() - 3600, time.time() - 3600))
    RunLock(outputs).acquire().release()
    assert outputs.is_dir() and not lock.exists()


def test_a_rank_that_reads_the_lock_while_its_rank_0_writes_it_is_not_refused(tmp_path, monkeypatch):
    """Rank 0 creates the lock file, then writes its record: a rank of the same launch that reads it in between
    found it empty and refused its own run (a 2-rank CI run). The check waits for the record; an empty lock that
    stays empty (a writer that just died) is still refused while fresh."""
    import threading

    from opensora.training.run_lock import LOCK_FILE, RunLockedError, _job, check_not_in_use

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "41234")
    outputs = tmp_path / "run"
    outputs.mkdir()
    lock = outputs / LOCK_FILE
    lock.write_text("")
    record = dict(host="this-launch", pid=1, started=time.time(), job=_job())
    writer = threading.Timer(0.3, lambda: lock.write_text(json.dumps(record) + "\n"))
    writer.start()
    check_not_in_use(outputs)  # the record arrives within the grace time and names this launch
    writer.join()

    lock.write_text("")
    with pytest.raises(RunLockedError, match="is in use by another run"):
        check_not_in_use(outputs)
