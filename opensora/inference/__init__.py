"""Sampling, laid out by feature (each folder owns one feature; nothing here imports the training stack).

* ``sampler.py``: ``VideoSampler``, the multi-step sampler (text/VAE encode, Euler + CFG, decode); ``pass_graphs.py``
  replays its whole model passes as CUDA graphs; ``graphs.py``: what every family of graphs here shares.
* ``streaming/``: chunk-by-chunk generation with a causal (block-causal) MMDiT and its KV cache: the generator, the
  rules every chunk loop shares (step rule, noise order, padding decision), the chunk decoder, CUDA graphs of the
  chunk passes, the incremental video writer.
* ``pipeline_parallel/``: the two-GPU pipeline (the only thing called "pipeline"): the pure schedule and its
  simulator, the runtime that issues it on two devices, the model cut into stages (bidirectional and streaming),
  stage times and the split choice, its CLI glue.
* ``cache/``: the Jano region-aware cache (config, plan, region forward over the model's own pieces, CUDA graphs of
  its levels, the policy), the whole-step baseline, and the stores behind the ``CacheStore`` protocol.
* ``options.py`` (the CLI's settings, one dataclass per feature), ``cli.py`` (``scripts/diffusion/inference.py``),
  ``sample_writer.py`` (the one place samples are written), ``prompts.py`` (prompt files, seeds, file stems),
  ``io.py`` (reference frames, saved videos, sidecars).
"""
