"""Checkpoint reading, export and key-layout conversion (used by inference and tools/convert_checkpoint.py).

weights.py: read a role's weights (EMA or raw) from a checkpoint or an exported file. export.py: export to one
safetensors file with metadata, import foreign layouts, inspect. keymap.py: table-driven key renaming;
opensora2.py / diffusers_flux.py: the Open-Sora 2.0 MMDiT and diffusers FluxTransformer2DModel tables.
"""
