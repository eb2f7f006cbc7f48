"""One run per outputs directory: ``{outputs}/.run.lock``, held by rank 0 for the life of the run.

The lock is a file created with ``O_CREAT | O_EXCL`` (atomic on local filesystems and on NFSv3+), holding JSON
``{host, pid, started}``; rank 0 takes it before anything else is written and removes it when the run ends (normally,
with an error, or preempted). A lock whose holder is gone is stale and is taken over:

* same host: the recorded process no longer exists (or is another process that reused the pid: its start time is
  later than the lock's);
* another host (a shared filesystem): its holder cannot be asked, so a running holder touches the file every
  ``HEARTBEAT_S`` and a lock not touched for ``STALE_AFTER_S`` is stale. Until then the error says which host and
  process hold it, and that deleting the file is safe once that process is gone.

Taking over renames the stale file away first (only one of two racing runs can), then creates a fresh one.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path

from opensora.cli_errors import UserInputError

LOCK_FILE = ".run.lock"
HEARTBEAT_S = 60.0
STALE_AFTER_S = 600.0
WRITE_GRACE_S = 2.0  # how long a reader waits for a just-created lock to get its record


class RunLockedError(UserInputError):
    """Another live run holds the outputs directory."""


def _process_started(pid: int) -> float | None:
    """Start time (epoch seconds) of process ``pid`` on this host, or None if there is none."""
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except ImportError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return 0.0
    except Exception:  # psutil.NoSuchProcess / ZombieProcess / AccessDenied
        return None


def _holder_alive(record: dict, lock: Path) -> bool:
    if not record or record.get("host") != socket.gethostname():  # (empty: being written now, or its writer died)
        try:
            return time.time() - lock.stat().st_mtime < (STALE_AFTER_S if record else 5.0)
        except FileNotFoundError:
            return False
    started = _process_started(int(record.get("pid", -1)))
    # a process that started after the lock was written reused the pid
    return started is not None and started <= float(record.get("started", 0.0)) + 1.0


def _read(lock: Path) -> dict | None:
    try:
        return json.loads(lock.read_text())
    except FileNotFoundError:
        return None
    except (ValueError, OSError):
        return {}  # half-written by a holder that died mid-write: treated as stale below (no host, no pid)


def _job() -> str:
    """The launch this process belongs to: ranks of one torchrun job share its rendezvous address and run id."""
    return ":".join(os.environ.get(k, "") for k in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"))


def _in_use(outputs: Path, lock: Path, record: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(record.get("started", 0))))
    return (
        f"--outputs {outputs} is in use by another run (host {record.get('host')}, pid {record.get('pid')}, since "
        f"{since}; lock {lock}): wait for it to end, or write elsewhere with --outputs NEW_DIR. If that process is "
        f"gone, delete {lock}"
    )


def check_not_in_use(outputs: str | os.PathLike, overwrite: bool = False) -> None:
    """Read-only, on every rank before anything else: refuse when another live run holds ``outputs`` (rank 0 takes
    the lock itself later, ``claim_outputs``; a lock of this very launch, taken by a faster rank 0, is no refusal)."""
    lock = Path(outputs) / LOCK_FILE
    record = _read(lock)
    # an empty lock is being written right now, often by this launch's own rank 0 (it creates the file, then writes
    # the record): read it again once written, instead of refusing our own run (seen on a 2-rank CI run)
    deadline = time.time() + WRITE_GRACE_S
    while record == {} and time.time() < deadline:
        time.sleep(0.02)
        record = _read(lock)
    if record is not None and record.get("job") != _job() and _holder_alive(record, lock):
        raise RunLockedError(("--overwrite refused: " if overwrite else "") + _in_use(Path(outputs), lock, record))


class RunLock:
    """``RunLock(outputs).acquire()`` ... ``release()`` (or ``with``). Creates ``outputs`` if missing and removes it
    again on release when the run left nothing in it (a refused start leaves no empty run directory)."""

    def __init__(self, outputs: str | os.PathLike):
        self.outputs = Path(outputs)
        self.path = self.outputs / LOCK_FILE
        self._record = None
        self._created_dir = False
        self._stop = threading.Event()

    def acquire(self) -> "RunLock":
        if not self.outputs.exists():
            self.outputs.mkdir(parents=True)
            self._created_dir = True
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "job": _job()}
        for _ in range(5):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(record) + "\n")
            self._record = record
            threading.Thread(target=self._heartbeat, name="run-lock-heartbeat", daemon=True).start()
            return self
        raise RunLockedError(f"--outputs {self.outputs}: could not take its lock {self.path} (contended)")

    def _take_over_if_stale(self) -> None:
        record = _read(self.path)
        if record is None:
            return  # released meanwhile: try again
        if _holder_alive(record, self.path):
            self.release()
            raise RunLockedError(_in_use(self.outputs, self.path, record))
        stale = self.path.with_name(f"{LOCK_FILE}.stale-{os.getpid()}")
        try:
            os.replace(self.path, stale)  # atomic: of two runs taking over, one moves it
        except FileNotFoundError:
            return
        if _read(stale) != record:  # moved a lock someone created after we read the stale one: put it back
            try:
                os.link(stale, self.path)
            except FileExistsError:
                pass
        stale.unlink(missing_ok=True)

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        """Remove the lock if this process holds it, and the outputs directory if this lock created it and the run
        left nothing else there."""
        self._stop.set()
        if self._record is not None and _read(self.path) == self._record:
            self.path.unlink(missing_ok=True)
        self._record = None
        if self._created_dir:
            try:
                self.outputs.rmdir()  # only succeeds when empty
            except OSError:
                pass

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _claim(outputs: Path, move_old_run: bool) -> tuple[RunLock, Path | None]:
    lock = RunLock(outputs)
    try:
        lock.acquire()
    except RunLockedError as held:
        if move_old_run:
            raise RunLockedError(f"--overwrite refused: {held}") from None
        raise
    if not move_old_run:
        return lock, None
    from .run_dir import move_run_aside

    aside = move_run_aside(outputs)  # the lock file moves with it
    (aside / LOCK_FILE).unlink(missing_ok=True)
    return RunLock(outputs).acquire(), aside


@contextlib.contextmanager
def claim_outputs(outputs: str | os.PathLike, move_old_run: bool = False):
    """Hold ``outputs`` for the life of a run: rank 0 takes the lock (and for ``--overwrite`` moves the old run aside
    while holding it, so a live run's directory is never moved); every rank gets the outcome, and a refusal is the
    same one-line error on every rank. Yields where the old run went (or None)."""
    from .distributed import broadcast_object, get_rank

    outputs = Path(outputs)
    lock, aside, error = None, None, None
    if get_rank() == 0:
        try:
            lock, aside = _claim(outputs, move_old_run)
        except RunLockedError as held:
            error = str(held)
        except OSError as failed:  # read-only filesystem, no permission, a file in the way
            error = (
                f"--outputs {outputs} is not writable ({failed.strerror or failed}: {failed.filename or outputs}); "
                "choose a writable directory with --outputs DIR"
            )
    aside, error = broadcast_object((None if aside is None else str(aside), error))
    if error is not None:
        raise UserInputError(error)
    try:
        yield None if aside is None else Path(aside)
    finally:
        if lock is not None:
            lock.release()
