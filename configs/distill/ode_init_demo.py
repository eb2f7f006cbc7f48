# ODE-pair (KD) initialisation of a 4-step student from `make demo`'s MovingShapes teacher
# (configs/diffusion/train/demo_fast.py: 24x24 clips of 4 frames), on CPU in minutes: the student regresses the
# teacher's guided ODE trajectory at its step list. This student is bidirectional; configs/distill/causal_ode_demo.py
# makes it causal (the first stage of Self-Forcing). After `make demo` (or with --teacher-ckpt RUN_OR_CHECKPOINT):
#   python scripts/diffusion/train.py configs/distill/ode_init_demo.py
# Data-free: the clips only fix the latent size [27, 4, 8, 8]; the prompts are the dataset's captions.
_base_ = ["../diffusion/train/demo_fast.py"]

outputs = "outputs/demo/ode_init"
max_steps = 300
ckpt_every = 150

# the teacher: `make demo`'s run (a run directory stands for its newest complete checkpoint; EMA weights)
teacher_ckpt = "outputs/demo/train"
_teacher_weights = dict(path=teacher_ckpt, role="model", ema=True)
# --teacher-ckpt P sets every role that starts from the teacher (the values above were copied when the file loaded)
_links_ = dict(teacher_ckpt=["models.student.init_from.path", "models.teacher.init_from.path"])

# ---- the few-step student ------------------------------------------------------------------------------------
step_list = [1.0, 0.75, 0.5, 0.25]  # the student's times (t = 1 noise), read by the inference script too
role = "student"
guidance_scale = 1.0  # the teacher's CFG is distilled into the student: sample it without guidance

_mmdit = {{_base_.model}}
# the teacher config's single-role keys do not apply here (each role sets its own): unset, or they are an error
model = lr = warmup_steps = grad_clip = ema_decay = ema_start_step = None
models = dict(
    student=dict(
        model=_mmdit,
        trainable=True,
        precision="fp32",
        init_from=_teacher_weights,
        optimizer=dict(lr=1e-4, betas=(0.9, 0.999), weight_decay=0.01),
        warmup_steps=10,
        grad_clip=1.0,
        ema=dict(decay=0.95, start_step=0),
    ),
    teacher=dict(model=_mmdit, trainable=False, precision="fp32", init_from=_teacher_weights),
)

method = dict(
    _delete_=True,
    type="CausalODEInit",
    step_list=step_list,
    teacher_num_steps=30,  # the teacher's shifted Euler schedule, merged with step_list
    teacher_guidance_scale=3.0,  # standard CFG scale s of the teacher: v = u + s (c - u)
    target="x0",  # regress the student's x0 on the teacher's final sample (fp32 MSE); or "velocity"
    pairs="regenerate",  # a fresh teacher ODE per micro-step; "cache" + prompts=[...] reuses num_cached_pairs
    # the teacher's own timestep shift (demo_fast.py: 64 tokens -> shift 3)
    adapter=dict(type="MMDiTAdapter", num_train_timesteps=1000, shift={{_base_.method.shift}}),
)
