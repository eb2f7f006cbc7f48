# CausVid-style DMD of the MovingShapes demo teacher into a causal 4-step student, on CPU in minutes: DMD2
# (configs/distill/dmd2_demo.py) with the student causal, started from the causal ODE init
# (configs/distill/causal_ode_demo.py). Each student pass is the full causal forward (chunk c sees chunks <= c, all at
# the step's time); Self-Forcing (self_forcing_demo.py) instead rolls out chunk by chunk with a clean KV cache.
#   python scripts/diffusion/train.py configs/distill/causvid_demo.py
_base_ = ["dmd2_demo.py"]

outputs = "outputs/demo/causvid"

ode_ckpt = "outputs/demo/causal_ode"  # the causal ODE-init run (its newest checkpoint; the student's EMA weights)
num_frames_per_chunk = 1  # latent frames per chunk: 4-frame clips -> 4 chunks (see causal_ode_demo.py)
# --teacher-ckpt sets the teacher and the critic; --ode-ckpt the student
_links_ = dict(
    teacher_ckpt=["models.teacher.init_from.path", "models.critic.init_from.path"],
    ode_ckpt=["models.student.init_from.path"],
)

# ---- streaming sampling, read by scripts/diffusion/inference.py (step_list, role, guidance_scale come from the base):
# chunk by chunk with the KV cache, with the rollout rule the student was trained with
streaming = True
rollout = "euler"
context_time = 0.0

models = dict(
    student=dict(
        model=dict(causal_chunk_frames=num_frames_per_chunk),
        init_from=dict(path=ode_ckpt, role="student", ema=True),
    ),
)

method = dict(
    _delete_=True,
    type="CausVid",
    step_list={{_base_.step_list}},
    num_frames_per_chunk=num_frames_per_chunk,
    rollout=rollout,  # DMD2's backward simulation (Euler) through the full causal forward
    student_update_every=5,
    real_guidance_scale=3.0,  # standard CFG s of the teacher's real score, u + s (c - u); DMD's w = s - 1
    min_timestep=20,
    max_timestep=980,
    adapter={{_base_.method.adapter}},
)
