"""Streaming generation with a causal MMDiT: ``generator.StreamingGenerator`` (chunk by chunk with a KV cache),
``rules`` (the step rule, noise order and padding decision every chunk loop shares), ``chunk_graphs`` (CUDA graphs of
the chunk passes), ``decode_ahead`` (a chunk decoded on a side stream), ``recache`` (KV re-cache of the rolling
window, the re-rendered switch), ``prompt_schedule`` (a prompt that changes at given
frames), ``writer`` (mp4 files appended chunk by chunk). Importing the package loads nothing heavy."""

ROLLOUTS = ("renoise", "euler")  # the step rules (rules.rollout_step); the --rollout flag
KV_RECACHE = (
    "off",
    "shift",
)  # --kv-recache: when the window rolls, recompute the kept frames' keys/values (recache.py)
ROPE_ANCHORS = ("absolute", "window")  # --rope-anchor: where the text and sink frames sit in RoPE time (KVCache)
