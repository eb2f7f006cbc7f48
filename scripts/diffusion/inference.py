#!/usr/bin/env python
"""Sample: ``python scripts/diffusion/inference.py CONFIG --ckpt PATH (--prompt TEXT | --prompt-file F) --save-dir DIR
[--num-steps N] [--seed S] [--cond-type i2v_head --ref PATH] [--any.config.key VALUE]``; ``--help`` lists all flags."""

import sys

from opensora.cli_errors import run_cli
from opensora.inference.cli import main

if __name__ == "__main__":
    sys.exit(run_cli(main, sys.argv[1:], prog="inference.py"))
