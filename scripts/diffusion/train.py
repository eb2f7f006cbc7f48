#!/usr/bin/env python
"""Train: ``colossalai run --nproc_per_node N scripts/diffusion/train.py CONFIG [--outputs DIR] [--max-steps N]
[--ckpt-every N] [--load DIR | --resume auto] [--any.config.key VALUE]`` (also works under torchrun and plain python)."""

import sys

from opensora.training.launch import run_train_script

if __name__ == "__main__":
    sys.exit(run_train_script(sys.argv[1:]))
