"""How long ``torch.compile`` has worked in this process, so the trainer can say what compiled blocks cost at start-up
(and when a new batch shape makes them compile again)."""

import logging

logger = logging.getLogger(__name__)

# torch's timing table: the frames Dynamo compiled (forward graphs, with Inductor), and backward graphs compiled at
# their first backward
_COMPILE_KEYS = ("_compile.compile_inner", "backward._backward_impl")


def compile_seconds() -> float:
    """Seconds spent compiling so far in this process (0.0 when nothing was compiled)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:  # a torch without Dynamo
        return 0.0
    return float(sum(sum(compilation_time_metrics.get(key, ())) for key in _COMPILE_KEYS))


class CompileLog:
    """Logs, at a step after which ``compile_seconds`` grew, how much of the wait was compiling."""

    def __init__(self):
        self.seen = compile_seconds()

    def after_step(self, step: int, step_seconds: float) -> None:
        total = compile_seconds()
        if total > self.seen + 0.5:
            logger.info(
                "step %d took %.1f s, %.1f s of it compiling (torch.compile, %.1f s so far in this run)",
                step,
                step_seconds,
                total - self.seen,
                total,
            )
        self.seen = total
