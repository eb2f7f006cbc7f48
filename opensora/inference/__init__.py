"""Sampling, laid out by feature (each folder owns one feature; nothing here imports the training stack).

* ``sampler.py``: ``VideoSampler``, the multi-step sampler (text/VAE encode, Euler + CFG, decode); ``pass_graphs.py``
  replays its whole model passes as CUDA graphs.
* ``streaming/``: chunk-by-chunk generation with a causal (block-causal) MMDiT and its KV cache: the generator, the
  chunk decoder, CUDA graphs of the chunk passes, the incremental video writer.
* ``pipeline_parallel/``: the two-GPU pipeline (the only thing called "pipeline"): the pure schedule and its
  simulator, the runtime that issues it on two devices, the model cut into stages, the split choice, its CLI glue.
* ``cache/``: the Jano region-aware cache (plan, region forward, CUDA graphs of its levels), the whole-step
  baseline, and the stores that hold cache entries on the device or offloaded to the host.
* ``cli.py`` (``scripts/diffusion/inference.py``), ``prompts.py`` (prompt files, seeds, file stems), ``io.py`` (reference
  frames, saved videos, sidecars).
"""
