# DMD2 distillation of the MovingShapes demo teacher (configs/diffusion/train/demo.py) into a 4-step student,
# on CPU in minutes. Train the teacher first (its 32x32x16 clips and checkpoints under outputs/demo; `make demo` runs
# the smaller demo_fast.py instead):
#   python tools/run_demo.py --train-config configs/diffusion/train/demo.py \
#       --sample-config configs/diffusion/inference/demo.py
# or python scripts/diffusion/train.py configs/diffusion/train/demo.py --outputs outputs/demo/train, then:
#   python scripts/diffusion/train.py configs/distill/dmd2_demo.py
# and sample the student with the same inference script (this file carries step_list / role / guidance_scale):
#   python scripts/diffusion/inference.py configs/distill/dmd2_demo.py --ckpt outputs/demo/dmd2 --prompt "..."
_base_ = ["../diffusion/train/demo.py"]

outputs = "outputs/demo/dmd2"
max_steps = 400
ckpt_every = 200

teacher_ckpt = "outputs/demo/train/checkpoints/step-0001000"  # the demo teacher's final checkpoint (EMA weights)
# resolved when the file loads: on the command line override --models.{student,teacher,critic}.init_from.path
_teacher_weights = dict(path=teacher_ckpt, role="model", ema=True)

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
    adapter=dict(type="MMDiTAdapter", num_train_timesteps=1000, shift=dict(base_tokens=256, base_shift=1.0)),
)
