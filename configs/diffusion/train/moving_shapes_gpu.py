# MovingShapes on one GPU, a larger config than the CPU demo: 64x64x16 clips rendered on the fly (no files, no PyAV),
# PatchVAE(4) -> latent [48, 16, 16, 16] -> 1024 video tokens, a ~30M-parameter MMDiT, bf16 ZeRO-2.
# torchrun --nproc_per_node 1 scripts/diffusion/train.py configs/diffusion/train/moving_shapes_gpu.py --outputs D
_base_ = ["demo.py"]

outputs = "outputs/moving_shapes_gpu"
max_steps = 4000
ckpt_every = 2000
precision = "bf16"

dataset = dict(
    _delete_=True, type="MovingShapesDataset", num=7200, seed=0, height=64, width=64, num_frames=16, motion="linear"
)  # motion: linear, or bounce / wrap (defined past the clip length: long streaming)
bucket_config = dict(_delete_=True, **{"64x64": {16: (1.0, 32)}})
num_workers = 12

model = dict(
    hidden_size=384,
    num_heads=6,
    depth_double=4,
    depth_single=8,
    axes_dims=(16, 24, 24),
    # a 30M model trained for minutes: on an H200 compiling costs ~33 s once and saves ~11 ms a step (85.7 vs 96.6
    # ms, separate runs: benchmarks/reports/padded_text_h200_2026-11.md), so it pays only after ~3000 steps
    compile_blocks=False,
)
lr = 5e-4
warmup_steps = 200
ema_decay = 0.999
