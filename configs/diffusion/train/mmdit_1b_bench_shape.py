# The real trainer at exactly the shape of the bare step of benchmarks/train_step.py, with loading that costs nothing:
# 1B preset (8 double + 16 single blocks, 12 x 128 heads), latent [16, 11, 48, 64] -> 11 x 24 x 32 = 8448 video tokens
# + 512 text tokens (no padding, so no attention mask, as in the bare step), batch 1, bf16, full checkpointing.
# Latents and text features come from memory (SyntheticLatentDataset): no VAE, no text encoder, no decoding.
#   python -m benchmarks.train_step --runs "trainer@full;ours-eager@full"      # trainer vs bare step, one call
#   torchrun --nproc_per_node 1 scripts/diffusion/train.py configs/diffusion/train/mmdit_1b_bench_shape.py
# What differs from the bare step is what the trainer adds: the ZeRO-2 bf16 optimizer (fp32 master weights, grad
# clipping), the lr scheduler, the EMA on rank 0, the loss-finite check, metrics and the data loader.
from opensora.models.mmdit.configs import mmdit_config

outputs = "outputs/mmdit_1b_bench_shape"
seed = 42
max_steps = 30
ckpt_every = 0
save_at_end = False
grad_accum = 1
precision = "bf16"

dataset = dict(type="SyntheticLatentDataset", num=4096, latent_frames=11, latent_height=48, latent_width=64)
bucket_config = {"384x512": {41: (1.0, 1)}}  # the pixel shape those latents stand for (8x space, 4x causal time)
num_workers = 2
persistent_workers = True
prefetch_factor = 4

vae = None  # latents are pre-extracted
text_encoder = None  # so are the text features

model = mmdit_config("1b", in_channels=16, attn_backend="auto", grad_ckpt_double=8, grad_ckpt_single=16)

lr = 1e-4
optimizer = dict(type="AdamW", betas=(0.9, 0.999), eps=1e-15, weight_decay=0.0)
warmup_steps = 1000
grad_clip = 1.0
ema_decay = 0.9999
ema_start_step = 0
max_consecutive_nonfinite = 5
plugin = dict(type="LowLevelZeroPlugin", stage=2, reduce_bucket_size_in_m=128, overlap_communication=True)

method = dict(
    type="FlowMatching",
    timestep_kind="logit_normal",
    shift=dict(base_tokens=256, base_shift=1.0),
    text_dropout=0.0,  # no text encoder, so no null text
)

tensorboard = False
wandb = None
