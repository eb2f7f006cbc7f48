"""Command-line tools (checkpoint conversion, datasets, evaluation, the demo), run as ``python tools/NAME.py``."""
