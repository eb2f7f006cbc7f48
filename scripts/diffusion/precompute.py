#!/usr/bin/env python
"""Encode a training config's dataset once: ``python scripts/diffusion/precompute.py CONFIG --outputs DIR
[--epochs N] [--flip] [--samples-per-shard N] [--encode-batch-size N]`` (also ``torchrun --nproc_per_node N``).
Train from it with ``--dataset "{'type': 'CachedLatentDataset', 'data_path': 'DIR'}"``; a killed run continues when the
same command is run again."""

import sys

from opensora.latent_cache.precompute import main
from opensora.training.distributed import run_script

if __name__ == "__main__":
    sys.exit(run_script(main, sys.argv[1:], prog="precompute.py"))
