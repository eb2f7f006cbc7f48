"""Streaming generation with a causal MMDiT: ``generator.StreamingGenerator`` (chunk by chunk with a KV cache),
``rules`` (the step rule, noise order and padding decision every chunk loop shares), ``chunk_graphs`` (CUDA graphs of
the chunk passes), ``writer`` (mp4 files appended chunk by chunk). Importing the package loads nothing heavy."""

ROLLOUTS = ("renoise", "euler")  # the step rules (rules.rollout_step); the --rollout flag
