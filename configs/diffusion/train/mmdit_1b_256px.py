# 1B MMDiT text-to-video at 256px: the config a GPU user starts from (Open-Sora 2.0 stage-1 style, smaller model).
#   colossalai run --nproc_per_node 8 scripts/diffusion/train.py configs/diffusion/train/mmdit_1b_256px.py \
#       --dataset.data_path data/train.csv --outputs outputs/mmdit_1b_256px
# Weights are read from local folders (nothing downloads): point the three paths below at your copies of
#   HunyuanVideo's VAE (diffusers layout, e.g. hunyuanvideo-community/HunyuanVideo with its "vae" subfolder),
#   google/t5-v1_1-xxl (text_dim 4096) and openai/clip-vit-large-patch14 (pooled_dim 768).
# Without those weights, configs/diffusion/train/mmdit_1b_synthetic.py measures the same model step.
from opensora.models.mmdit.configs import mmdit_config

outputs = "outputs/mmdit_1b_256px"
seed = 42
max_steps = 100_000
ckpt_every = 1000
keep_last = 3
grad_accum = 1
precision = "bf16"

# ---- data ---------------------------------------------------------------------------------------------------
# a csv/parquet with path, text (and ideally num_frames, height, width, fps: saves probing every file)
dataset = dict(type="VideoTextDataset", data_path="data/train.csv", frame_interval=1)
# 256px = 65,536-pixel area in the nearest aspect-ratio bucket; frame counts are 1 + 4k for the causal VAE.
# num_frames -> (keep probability, batch size per GPU); the largest frame count a clip can fill is tried first.
bucket_config = {
    "256px": {
        1: (1.0, 32),  # single frames (images or one frame of a video): text-to-image keeps the model sharp
        33: (1.0, 8),
        65: (0.5, 4),
        129: (0.5, 2),
    },
}
num_workers = 8

# ---- frozen components --------------------------------------------------------------------------------------
vae = dict(
    type="HunyuanVideoVAE",
    from_pretrained="ckpts/HunyuanVideo",
    subfolder="vae",
    dtype="bf16",
    use_slicing=True,  # encode one clip at a time: the 129-frame bucket would not fit otherwise
)
text_encoder = dict(
    type="TextConditioner",
    t5=dict(from_pretrained="ckpts/t5-v1_1-xxl", max_length=512),
    clip=dict(from_pretrained="ckpts/clip-vit-large-patch14", max_length=77),
    dtype="bf16",
)

# ---- the trained network: the 1B preset (8 double + 16 single blocks, 1536 wide), 16-channel latents ---------
model = mmdit_config(
    "1b",
    in_channels=16,
    attn_backend="auto",
    grad_ckpt_double=8,  # recompute every block in backward: 65/129-frame buckets need it at these batch sizes
    grad_ckpt_single=16,
    # torch.compile per block (one graph per block kind; the log says how long the first steps compile). GPU tests
    # (H200, torch 2.11) show the compiled blocks equal to eager with padded text at batch 1 and 4, with no, full and
    # selective checkpointing and for the causal student; the trainer runs them with no recompile (0 in a 25-step
    # run: the thread count a checkpointed recompute meets is pinned) at 233 ms against the bare compiled step's 214.
    # Padded prompts: trimmed to multiples of 128 T5 tokens and a key mask (the model's padded_text_attention).
    compile_blocks=True,
    # Long runs: inductor_options=dict(coordinate_descent_tuning=True) tunes each compiled kernel's launch config (a
    # 3.7% faster padded step on an H200, 154.2 against 160.1 ms) for ~200 s at the first step instead of ~7 s.
)

# ---- optimisation ---------------------------------------------------------------------------------------------
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
    shift=dict(base_tokens=256, base_shift=1.0),  # alpha = sqrt(tokens / 256): sqrt(latent frames) at 256px
    text_dropout=0.1,
    condition_probs=dict(t2v=1.0),  # text-to-video only: the 1B preset has no condition input
)

tensorboard = True
wandb = dict(enable=False, mode="offline", project="opensora-mmdit-1b")
