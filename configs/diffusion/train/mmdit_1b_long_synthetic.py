# Long videos with sequence parallelism: the 1B MMDiT on 512x512 x 129-frame clips = 33 x 32 x 32 = 33,792 video
# tokens (+ 512 text), each sample split over `sequence_parallel_size` GPUs (all-to-all around attention, see
# opensora/parallel/sequence_parallel.py). Inputs are the stand-ins of mmdit_1b_synthetic.py (clips rendered on
# the fly, tiny random VAE / text encoders with the real shapes), so the step is what gets measured.
#   torchrun --nproc_per_node 8 scripts/diffusion/train.py configs/diffusion/train/mmdit_1b_long_synthetic.py \
#       --outputs /tmp/long --max-steps 20
#   benchmarks/train_scaling.sh --config configs/diffusion/train/mmdit_1b_long_synthetic.py --sp 4 --gpus "4 8"
# The sequence-parallel size must divide the GPU count and the 12 heads (2, 4 or 6; at 8 GPUs use 4 x 2 data
# parallel). It also divides both token counts here (33,792 and 512); other shapes are padded and masked per rank,
# which costs the mask-free attention kernels.
_base_ = ["mmdit_1b_synthetic.py"]

outputs = "outputs/mmdit_1b_long_synthetic"
sequence_parallel_size = 4
model = dict(compile_blocks=False)  # compiled blocks do not combine with sequence parallelism (yet)

dataset = dict(height=512, width=512, num_frames=129)
bucket_config = {"_delete_": True, "512x512": {129: (1.0, 1)}}
num_workers = 12  # rendering a 512x512x129 clip costs ~12 s of CPU; one clip per 4 GPUs per step
