# Sampling `make demo`'s model (configs/diffusion/train/demo_fast.py): demo.py's sampling settings on its clips.
# The model / vae / text_encoder / method keys repeat the training config's (a config has one _base_ chain).
_base_ = ["demo.py"]

num_steps = 30
num_frames = 4
resolution = "24x24"
batch_size = 24

vae = dict(patch_size=3)
model = dict(in_channels=27, cond_channels=28)
text_encoder = dict(t5=dict(max_length=32))
method = dict(shift=dict(base_tokens=64, base_shift=3.0), condition_probs=dict(_delete_=True, t2v=1.0))
