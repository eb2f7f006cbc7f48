# ODE-pair (KD) initialisation on GPU: the MovingShapes GPU teacher (configs/diffusion/train/moving_shapes_gpu.py)
# teaches a 4-step student its guided ODE trajectory. Bidirectional student; causal_ode_gpu.py makes it causal.
#   torchrun --nproc_per_node N scripts/diffusion/train.py configs/distill/ode_init_gpu.py --teacher-ckpt T
# with T the teacher's run or checkpoint directory (it sets both roles' init_from.path, see _links_).
_base_ = ["../diffusion/train/moving_shapes_gpu.py"]

outputs = "outputs/moving_shapes_gpu/ode_init"
max_steps = 1000
ckpt_every = 500

teacher_ckpt = "outputs/moving_shapes_gpu/checkpoints/step-0004000"
_teacher_weights = dict(path=teacher_ckpt, role="model", ema=True)
_links_ = dict(teacher_ckpt=["models.student.init_from.path", "models.teacher.init_from.path"])

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
        warmup_steps=20,
        grad_clip=1.0,
        optimizer=dict(lr=1e-4, betas=(0.9, 0.999)),
        ema=dict(decay=0.99, start_step=0),
    ),
    teacher=dict(model=_mmdit, trainable=False, precision="bf16", init_from=_teacher_weights),
)

method = dict(
    _delete_=True,
    type="CausalODEInit",
    step_list=step_list,
    teacher_num_steps=20,  # teacher Euler steps (shifted), merged with step_list: ~23 guided steps per trajectory
    teacher_guidance_scale=4.0,  # standard CFG s, as the teacher is sampled (benchmarks/gpu_moving_shapes.sh)
    target="x0",
    pairs="regenerate",
    adapter=dict(type="MMDiTAdapter", num_train_timesteps=1000, shift=dict(base_tokens=256, base_shift=1.0)),
)
