# DMD2 on one or more GPUs: distil the larger MovingShapes teacher into a 4-step student.
#   torchrun --nproc_per_node N scripts/diffusion/train.py configs/distill/dmd2_gpu.py \
#       --models.student.init_from.path T --models.teacher.init_from.path T --models.critic.init_from.path T
# The teacher architecture below (`_mmdit`) and the data settings must equal the teacher's own training config:
# init_from loads strictly, so a mismatch fails at start-up naming the offending keys. Point all three roles at
# the teacher checkpoint T as above (the teacher_ckpt path below is resolved when this file loads, so
# --teacher-ckpt alone does not reach the roles).
_base_ = ["dmd2_demo.py"]

outputs = "outputs/moving_shapes/dmd2"
max_steps = 3000
ckpt_every = 500
precision = "bf16"  # frozen components (VAE, text conditioner) and the compute dtype
num_workers = 4
bucket_config = dict(_delete_=True, **{"64x64": {32: (1.0, 16)}})
dataset = dict(_delete_=True, type="VideoTextDataset", data_path="outputs/moving_shapes/data/meta.csv",
               frame_interval=1)

teacher_ckpt = "outputs/moving_shapes/train/checkpoints/latest"  # replace with the teacher's step-XXXXXXX dir
_teacher_weights = dict(path=teacher_ckpt, role="model", ema=True)

_mmdit = dict(
    type="MMDiT",
    in_channels=48,
    cond_channels=49,
    patch_size=(1, 2, 2),
    hidden_size=512,
    num_heads=8,
    depth_double=4,
    depth_single=8,
    mlp_ratio=4.0,
    text_dim=64,
    pooled_dim=64,
    axes_dims=(16, 24, 24),
    attn_backend="auto",
    grad_ckpt_double=False,
    grad_ckpt_single=False,
)
model = _mmdit  # what inference builds for a single-role config; the student has the same architecture

models = dict(
    student=dict(model=_mmdit, precision="bf16", init_from=_teacher_weights,
                 optimizer=dict(lr=2e-5), ema=dict(decay=0.99, start_step=0)),
    teacher=dict(model=_mmdit, precision="bf16", init_from=_teacher_weights),
    critic=dict(model=_mmdit, precision="bf16", init_from=_teacher_weights,
                optimizer=dict(lr=4e-5)),
)
plugin = dict(type="LowLevelZeroPlugin", stage=2)

method = dict(
    student_update_every=5,
    guidance_scale=4.0,
    adapter=dict(shift=dict(base_tokens=256, base_shift=1.0)),
)
