# The bench-shape 1B config (mmdit_1b_bench_shape.py: 8448 + 512 tokens, batch 1, in-memory latents) under
# ColossalAI's GeminiPlugin (ZeRO-3 with chunked parameters). Gemini needs ColossalAI's HybridAdam and shards the
# parameters, so there is no rank-0 EMA. benchmarks/gemini_check.sh runs it (static and auto placement) with a save +
# exact-resume check next to LowLevelZero.
_base_ = ["mmdit_1b_bench_shape.py"]

outputs = "outputs/mmdit_1b_gemini"
optimizer = dict(type="HybridAdam", betas=(0.9, 0.999), eps=1e-15, weight_decay=0.0)
ema_decay = None
plugin = dict(_delete_=True, type="GeminiPlugin", placement_policy="static", max_norm=1.0)
