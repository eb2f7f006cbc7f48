# DMD2 on GPU: distil the MovingShapes GPU teacher (configs/diffusion/train/moving_shapes_gpu.py) into a
# 4-step student. Same data and architecture as the teacher (init_from loads strictly, so a mismatch fails at
# start-up naming the keys):
#   torchrun --nproc_per_node N scripts/diffusion/train.py configs/distill/dmd2_gpu.py --teacher-ckpt T
# with T the teacher's run or checkpoint directory (it sets every role's init_from.path, see _links_). Sample the student with this same config:
#   python scripts/diffusion/inference.py configs/distill/dmd2_gpu.py --ckpt OUTPUTS --prompt "..."
_base_ = ["../diffusion/train/moving_shapes_gpu.py"]

outputs = "outputs/moving_shapes_gpu/dmd2"
max_steps = 1500
ckpt_every = 500
bucket_config = {"64x64": {16: (1.0, 16)}}

teacher_ckpt = "outputs/moving_shapes_gpu/checkpoints/step-0004000"
_teacher_weights = dict(path=teacher_ckpt, role="model", ema=True)
_links_ = dict(teacher_ckpt=[f"models.{role}.init_from.path" for role in ("student", "teacher", "critic")])

step_list = [1.0, 0.75, 0.5, 0.25]
role = "student"
guidance_scale = 1.0  # CFG is distilled into the student

_mmdit = {{_base_.model}}
# the teacher config's single-role keys do not apply here (each role sets its own): unset, or they are an error
model = lr = warmup_steps = grad_clip = ema_decay = ema_start_step = None
models = dict(
    student=dict(
        model=_mmdit,
        precision="bf16",
        init_from=_teacher_weights,
        warmup_steps=10,
        grad_clip=1.0,
        optimizer=dict(lr=2e-5, betas=(0.9, 0.999)),
        ema=dict(decay=0.99, start_step=0),
    ),
    teacher=dict(model=_mmdit, trainable=False, precision="bf16", init_from=_teacher_weights),
    critic=dict(
        model=_mmdit,
        precision="bf16",
        init_from=_teacher_weights,
        warmup_steps=50,
        grad_clip=1.0,
        optimizer=dict(lr=4e-5, betas=(0.9, 0.999)),
    ),
)

method = dict(
    _delete_=True,
    type="DMD2",
    step_list=step_list,
    rollout="euler",
    student_update_every=5,
    guidance_scale=4.0,
    min_timestep=20,
    max_timestep=980,
    adapter=dict(type="MMDiTAdapter", num_train_timesteps=1000, shift=dict(base_tokens=256, base_shift=1.0)),
)
