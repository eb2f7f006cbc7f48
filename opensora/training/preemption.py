"""Graceful preemption: SIGTERM (Slurm, Kubernetes), SIGINT (Ctrl-C) and SIGUSR1 (Slurm's ``--signal``) stop a run
at the next optimizer step with a checkpoint; a second signal stops it at once.

The first signal only sets a flag. The trainer sends the flag to every rank inside the all-reduce it already does once
per step (its non-finite / time-budget verdict), so every rank stops after the same optimizer step without an extra
collective, saves a checkpoint at that settled step and exits with ``EXIT_PREEMPTED``.

A second signal exits at once with ``128 + signal`` (the shell's convention for "killed by"), after removing the
temporary directory of a checkpoint being written (``.tmp-step-*``: never a checkpoint, but not left behind either).
It works even while the main thread is blocked in a collective or in a write: the signals are read by a helper thread
from ``signal.set_wakeup_fd`` (Python runs handlers in the main thread only, between bytecodes). A repeat of the
signal within ``SAME_SIGNAL_WINDOW_S`` of the first is the same request: a launcher (torchrun, ``colossalai run``)
forwards the SIGINT / SIGTERM it received to workers that the terminal or Slurm already signalled.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)

EXIT_PREEMPTED = 75  # sysexits' EX_TEMPFAIL: "temporary failure, try again" (resume with --resume auto)
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
SAME_SIGNAL_WINDOW_S = 2.0


class Preemption:
    """Signal handling for one training run; a context manager (handlers restored on exit).

    ``requested``: a stop signal arrived (read by the trainer once per step). ``checkpoints``: the directory whose
    ``.tmp-step-*`` sub-directories a second signal removes before exiting.
    """

    def __init__(self, checkpoints: str | os.PathLike, prog: str = "train.py", window_s: float = SAME_SIGNAL_WINDOW_S):
        self.checkpoints = Path(checkpoints)
        self.prog = prog
        self.window_s = float(window_s)
        self.signal_name: str | None = None
        self._first_at: float | None = None
        self._previous = {}
        self._previous_fd = -1
        self._reader = self._writer = None

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    @property
    def signal_number(self) -> int:
        """The first stop signal's number, 0 before any (what the trainer all-reduces)."""
        return 0 if self.signal_name is None else int(signal.Signals[self.signal_name])

    def __enter__(self) -> "Preemption":
        if threading.current_thread() is not threading.main_thread():
            return self  # signals can only be caught in the main thread: leave them alone
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, _ignore)  # the helper thread acts; this keeps the process alive
        self._previous_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="preemption-signals", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        if not self._previous:
            return
        signal.set_wakeup_fd(self._previous_fd)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        self._writer.close()  # ends the helper thread (its recv returns b"")

    def _watch(self) -> None:
        with self._reader:
            while True:
                try:
                    data = self._reader.recv(64)
                except OSError:
                    return
                if not data:  # the writer was closed: the run is over
                    return
                for number in data:
                    if number in {int(s) for s in SIGNALS}:
                        self.receive(signal.Signals(number))

    def receive(self, sig: signal.Signals) -> None:
        """One stop signal: the first asks for a graceful stop, a later one (after the window) exits now."""
        now = time.monotonic()
        if self._first_at is None:
            self._first_at = now
            self.signal_name = sig.name
            logger.warning(
                "%s received: finishing this optimizer step, then saving a checkpoint (send it again to stop at once)",
                sig.name,
            )
            return
        if now - self._first_at < self.window_s:
            return  # the same request, forwarded by a launcher
        self._exit_now(sig)

    def _exit_now(self, sig: signal.Signals) -> None:
        removed = []
        if self.checkpoints.is_dir():
            for child in self.checkpoints.iterdir():
                if child.name.startswith(".tmp-step-") and child.is_dir():
                    shutil.rmtree(child, ignore_errors=True)
                    removed.append(child.name)
        note = f"; removed the partial save {', '.join(removed)}" if removed else ""
        print(
            f"{self.prog}: second {sig.name}: stopped at once without a new checkpoint{note}; earlier checkpoints are "
            "intact (continue with --resume auto)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(128 + int(sig))


def _ignore(signum, frame) -> None:
    """The Python-level handler: nothing (``Preemption._watch`` sees the signal through the wakeup fd)."""
