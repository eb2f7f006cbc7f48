#!/usr/bin/env python
"""Train: ``colossalai run --nproc_per_node N scripts/diffusion/train.py CONFIG [--outputs DIR] [--max-steps N]
[--ckpt-every N] [--load DIR | --resume auto] [--any.config.key VALUE]`` (also works under torchrun and plain python)."""

import sys

from opensora.cli_errors import run_cli
from opensora.training.launch import main

if __name__ == "__main__":
    sys.exit(run_cli(main, sys.argv[1:], prog="train.py"))
