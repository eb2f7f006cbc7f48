# DMD2 distillation of `make demo`'s MovingShapes teacher (configs/diffusion/train/demo_fast.py: 24x24 clips of 4
# frames) into a 4-step student, on CPU in minutes. After `make demo` (or with --teacher-ckpt RUN_OR_CHECKPOINT):
#   python scripts/diffusion/train.py configs/distill/dmd2_demo.py
# and sample the student with the same inference script (this file carries step_list / role / guidance_scale):
#   python scripts/diffusion/inference.py configs/distill/dmd2_demo.py --ckpt outputs/demo/dmd2 --prompt "..."
_base_ = ["../diffusion/train/demo_fast.py"]

outputs = "outputs/demo/dmd2"
max_steps = 400
ckpt_every = 200

# the teacher: `make demo`'s run (a run directory stands for its newest complete checkpoint; EMA weights)
teacher_ckpt = "outputs/demo/train"
_teacher_weights = dict(path=teacher_ckpt, role="model", ema=True)
# --teacher-ckpt P sets every role that starts from the teacher (the values above were copied when the file loaded)
_links_ = dict(teacher_ckpt=[f"models.{role}.init_from.path" for role in ("student", "teacher", "critic")])

# ---- few-step sampling (read by the inference script: step_list replaces num_steps) -------------------------
step_list = [1.0, 0.75, 0.5, 0.25]  # student times, t = 1 is noise; a final 0 is implied
role = "student"
guidance_scale = 1.0  # the student has the teacher's CFG distilled in: sample it without guidance

# ---- roles: all three start from the teacher -----------------------------------------------------------------
_mmdit = {{_base_.model}}
# the teacher config's single-role keys do not apply here (each role sets its own): unset, or they are an error
model = lr = warmup_steps = grad_clip = ema_decay = ema_start_step = None
models = dict(
    student=dict(
        model=_mmdit,
        trainable=True,
        precision="fp32",
        init_from=_teacher_weights,
        optimizer=dict(lr=5e-5, betas=(0.9, 0.999), weight_decay=0.01),
        warmup_steps=5,  # counted in the student's own optimizer steps (one per student_update_every iterations)
        grad_clip=1.0,
        ema=dict(decay=0.95, start_step=0),
    ),
    teacher=dict(model=_mmdit, trainable=False, precision="fp32", init_from=_teacher_weights),
    critic=dict(
        model=_mmdit,
        trainable=True,
        precision="fp32",
        init_from=_teacher_weights,
        optimizer=dict(lr=1e-4, betas=(0.9, 0.999), weight_decay=0.01),
        warmup_steps=20,
        grad_clip=1.0,
    ),
)

method = dict(
    _delete_=True,
    type="DMD2",
    step_list=step_list,
    rollout="euler",  # backward simulation with the same Euler steps inference takes
    student_update_every=5,  # two-time-scale rule: critic every iteration, student every 5th
    guidance_scale=3.0,  # teacher CFG for the real score
    min_timestep=20,
    max_timestep=980,
    # the teacher's own timestep shift (demo_fast.py: 64 tokens -> shift 3)
    adapter=dict(type="MMDiTAdapter", num_train_timesteps=1000, shift={{_base_.method.shift}}),
)
