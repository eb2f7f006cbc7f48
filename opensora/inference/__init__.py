"""Sampling: ``VideoSampler`` (pipeline.py), prompt files (prompts.py), outputs (io.py), the CLI (cli.py)."""
