# The 11B preset (Open-Sora 2.0's size: 19 double + 38 single blocks, 3072 wide, 24 x 128 heads) on in-memory
# latents: does it train on two GPUs of one host, and how fast. 256px x 33 frames (9 latent
# frames x 16 x 16 = 2304 video tokens) + 512 text tokens, batch 1 per GPU, full checkpointing, bf16.
# Default plugin: Gemini, static placement, optimizer states (fp32 master + Adam moments, 12 bytes/param = 132 GB for
# 11B) offloaded to the host. benchmarks/gemini_check.sh also tries ZeRO-2 (LowLevelZero) with everything on GPU.
from opensora.models.mmdit.configs import mmdit_config

_base_ = ["mmdit_1b_bench_shape.py"]

outputs = "outputs/mmdit_11b_synthetic"
max_steps = 8
dataset = dict(
    _delete_=True, type="SyntheticLatentDataset", num=256, latent_frames=9, latent_height=32, latent_width=32
)
bucket_config = {"_delete_": True, "256x256": {33: (1.0, 1)}}
model = mmdit_config("11b", attn_backend="auto", grad_ckpt_double=19, grad_ckpt_single=38)
method = dict(condition_probs=dict(t2v=1.0))  # the 11B preset has a condition input; text-to-video here
optimizer = dict(type="HybridAdam", betas=(0.9, 0.999), eps=1e-15, weight_decay=0.0)
ema_decay = None
plugin = dict(_delete_=True, type="GeminiPlugin", placement_policy="static", offload_optim_frac=1.0, max_norm=1.0)
