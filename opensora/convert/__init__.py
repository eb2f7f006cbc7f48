"""Checkpoint reading, export and key-layout conversion (used by inference and tools/convert_checkpoint.py)."""
