"""Sampling: ``VideoSampler`` (pipeline.py), prompt files (prompts.py), outputs (io.py), the CLI (cli.py), the Jano
region cache and a whole-step baseline (jano.py), cache stores with the prefetching ``PackedOffloadManager`` /
``OffloadManager`` (offload.py), CUDA graphs of the region cache's step levels (region_graphs.py)."""
