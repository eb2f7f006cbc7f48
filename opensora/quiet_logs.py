"""Keep third-party start-up notices that tell a user of this project nothing out of its command-line output.

Every training run printed about seven such lines before its first step: bitsandbytes' "kernels-community" CPU notice,
ColossalAI's advice to install tensornvme (async checkpoint saves, which we do not use) and apex (a fused RMSNorm
for its own shardformer layers, which our model does not use), the FutureWarning torch raises about an argument
ColossalAI's DDP plugin passes, and ColossalAI's INFO lines on every checkpoint save that the model and optimizer are
"going to be split to checkpoint shards". Each is matched by its own text, so every other warning of the same
libraries still shows. ``quiet_third_party()`` is called first thing by the command-line entry points (not on
``import opensora``: a library must not change the warning filters of a program that imports it).
"""

import logging
import warnings

# (category, start of the message) of warnings.warn calls that carry no information for our users
_WARNINGS = (
    (UserWarning, r"Please install the latest tensornvme"),
    (UserWarning, r"Please install apex from source"),
    (FutureWarning, r"`broadcast_buffers` is deprecated"),
)
# (logger name, substring) of log records to drop. A logger's filters see the records logged on that very logger,
# so the name is the emitting module's; "root" is ColossalAI's plain logging.info() of checkpoint shards.
_LOG_RECORDS = (
    ("bitsandbytes.backends.cpu.ops", "kernels-community"),
    ("root", "is going to be split to checkpoint shards"),
)


class _DropMatching(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def quiet_third_party() -> None:
    """Install the filters (idempotent)."""
    for category, message in _WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, text in _LOG_RECORDS:
        logger = logging.getLogger() if name == "root" else logging.getLogger(name)
        if not any(isinstance(f, _DropMatching) and f.text == text for f in logger.filters):
            logger.addFilter(_DropMatching(text))
