"""The trainer's compile-time log: a step after which torch.compile worked says how long, other steps say nothing."""

import logging

import torch

from opensora.training import compile_time
from opensora.training.compile_time import CompileLog, compile_seconds


def test_a_compiling_step_is_logged_with_its_compile_seconds(caplog, monkeypatch):
    clock = iter([10.0, 10.0, 52.5, 52.6])
    monkeypatch.setattr(compile_time, "compile_seconds", lambda: next(clock))
    log = CompileLog()
    with caplog.at_level(logging.INFO, logger="opensora.training.compile_time"):
        log.after_step(1, 3.0)  # nothing compiled
        log.after_step(2, 45.0)  # 42.5 s compiling
        log.after_step(3, 0.2)  # 0.1 s: noise, not logged
    assert [r.getMessage() for r in caplog.records] == [
        "step 2 took 45.0 s, 42.5 s of it compiling (torch.compile, 52.5 s so far in this run)"
    ]


def test_compile_seconds_grows_when_something_compiles():
    torch._dynamo.reset()  # it also clears the counters: read them after it (other tests in this process compiled)
    before = compile_seconds()
    compiled = torch.compile(lambda x: x.sin() * 2, backend="eager")
    compiled(torch.randn(3))
    assert compile_seconds() > before
