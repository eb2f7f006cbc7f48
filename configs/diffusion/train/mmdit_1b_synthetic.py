# The 1B MMDiT training step of mmdit_1b_256px.py without downloaded weights: for step-time / MFU measurements
# and smoke tests on a GPU machine that has no checkpoints.
#   torchrun --nproc_per_node 1 scripts/diffusion/train.py configs/diffusion/train/mmdit_1b_synthetic.py \
#       --outputs /tmp/mmdit_1b_synthetic --max-steps 20
# Same model (1B preset, grad checkpointing), precision, plugin, optimizer, EMA and method as the real config; only
# the inputs are stand-ins with the real shapes:
#   - MovingShapes clips rendered on the fly at 256x256, 33 frames (no files, no decoding);
#   - a tiny random HunyuanVideo VAE with the real compression (8x space, 4x causal time) and 16 latent channels:
#     latent [16, 9, 32, 32] -> 9 x 16 x 16 = 2304 video tokens, as with the real VAE (its encode is far cheaper);
#   - tiny random text encoders with the real widths: one T5 layer of d_model 4096 over 512 padded tokens (text_dim
#     4096) and one CLIP layer of width 768 (pooled_dim 768).
# What it measures is therefore the MMDiT forward/backward + optimizer + EMA step of the real trainer; the real
# run adds the HunyuanVideo VAE encode and T5-XXL (or uses pre-extracted latents). If samples_per_s looks capped by
# the data (rendering costs ~0.8 s of CPU per clip), raise num_workers.
_base_ = ["mmdit_1b_256px.py"]

outputs = "outputs/mmdit_1b_synthetic"
max_steps = 20
ckpt_every = 0  # only the final save

dataset = dict(_delete_=True, type="MovingShapesDataset", num=4096, seed=0, height=256, width=256, num_frames=33)
bucket_config = {"_delete_": True, "256px": {33: (1.0, 4)}}
num_workers = 12

vae = dict(
    _delete_=True,
    type="HunyuanVideoVAE",
    config=dict(block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4, latent_channels=16),
    seed=0,
    dtype="bf16",
)
text_encoder = dict(
    _delete_=True,
    type="TextConditioner",
    t5=dict(config=dict(d_model=4096, d_kv=128, num_heads=32, d_ff=1024, num_layers=1), max_length=512),
    clip=dict(
        config=dict(hidden_size=768, intermediate_size=1024, num_hidden_layers=1, num_attention_heads=12), max_length=77
    ),
    seed=0,
    dtype="bf16",
)
wandb = dict(project="opensora-mmdit-1b-synthetic")
