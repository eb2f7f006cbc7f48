# LoRA finetune of the MovingShapes GPU teacher (moving_shapes_gpu.py) on a subset of the clips, on one GPU.
# The teacher's weights stay frozen and are never written; only a rank-16 adapter on the attention and MLP
# projections trains (benchmarks/gpu_lora.sh runs this and scores the subset before and after):
#   torchrun --nproc_per_node 1 scripts/diffusion/train.py configs/diffusion/train/moving_shapes_lora_gpu.py \
#       --outputs D --init_from.path TEACHER_CKPT --dataset.where.direction left
_base_ = ["moving_shapes_gpu.py"]

outputs = "outputs/moving_shapes_lora_gpu"
max_steps = 1000
ckpt_every = 0

# the base weights: the teacher's EMA (a checkpoint directory of moving_shapes_gpu.py)
init_from = dict(path="outputs/gpu_moving_shapes/teacher/checkpoints/step-0000000", role="model", ema=True)
lora = dict(
    rank=16,
    alpha=16,
    target_modules=["qkv", "proj", "linear1", "linear2", "img_mlp.0", "img_mlp.2", "txt_mlp.0", "txt_mlp.2"],
    dropout=0.0,
)
model = dict(compile_blocks=False)  # as the base config; compiled LoRA is GPU-tested (test_text_padding_gpu.py -k lora)
dataset = dict(where=dict(direction="left"))  # the subset to finetune on (colour / shape / direction values)
lr = 5e-4
warmup_steps = 20
ema_decay = 0.99  # an EMA of the adapter only
