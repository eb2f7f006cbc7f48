# The real trainer at the shape of benchmarks/padded_text_step.py (the configuration users run with real prompts):
# 1B preset, batch 4 at 256px x 33 frames (latent [16, 9, 32, 32] -> 2304 video tokens per sample), T5 text padded to
# 512 tokens of which 20-120 are valid (a different count per pool slot, so a batch's rows differ), full
# checkpointing, compiled blocks. Loading costs nothing (SyntheticLatentDataset); FlowMatching hands the model the
# host bound on the text lengths (the last valid column of the batch's mask), as with a latent cache.
#   python -m benchmarks.train_step --trainer-config configs/diffusion/train/mmdit_1b_padded_text_shape.py \
#       --runs "trainer@full"          # the trainer's padded step, next to padded_text_step's
#   ours-padded-bound-graph-ckpt-master (the bare step with the trainer's fp32 masters; bash benchmarks/gpu_padded_text.sh
#   trainer-padded times all three)
_base_ = ["mmdit_1b_bench_shape.py"]

outputs = "outputs/mmdit_1b_padded_text_shape"

dataset = dict(
    type="SyntheticLatentDataset",
    num=4096,
    latent_frames=9,
    latent_height=32,
    latent_width=32,
    text_valid_range=(20, 120),
    pool=16,  # 16 prompt lengths (and feature sets) in rotation
)
bucket_config = {"_delete_": True, "256x256": {33: (1.0, 4)}}  # the pixel shape of those latents; batch 4

model = dict(compile_blocks=True)
