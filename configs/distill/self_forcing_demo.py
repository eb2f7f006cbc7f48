# Self-Forcing distillation of the MovingShapes demo teacher into a causal, streaming 4-step student, on CPU in
# minutes. Stage 1 is configs/distill/causal_ode_demo.py (the student starts from its checkpoint); then:
#   python scripts/diffusion/train.py configs/distill/self_forcing_demo.py
# It is configs/distill/dmd2_demo.py with the student causal and rolled out chunk by chunk through its KV cache, as
# it streams at inference; the teacher (real score, CFG) and the critic (fake score) stay bidirectional.
_base_ = ["dmd2_demo.py"]

outputs = "outputs/demo/self_forcing"

ode_ckpt = "outputs/demo/causal_ode/checkpoints/step-0000300"  # the causal ODE-init student (EMA weights)
num_frames_per_chunk = 2  # latent frames per chunk: 16-frame clips -> 8 chunks (see causal_ode_demo.py)

models = dict(
    student=dict(
        model=dict(causal_chunk_frames=num_frames_per_chunk),
        init_from=dict(path=ode_ckpt, role="student", ema=True),
    ),
)

method = dict(
    _delete_=True,
    type="SelfForcing",
    step_list={{_base_.step_list}},
    num_frames_per_chunk=num_frames_per_chunk,
    rollout="renoise",  # between steps of a chunk: x0 re-noised with fresh noise ("euler": Euler step); sample alike
    student_update_every=5,  # critic every iteration, student every 5th (Self-Forcing's ratio)
    real_guidance_scale=3.0,  # standard CFG s of the teacher's real score, u + s (c - u); DMD's w = s - 1
    grad_frames=None,  # latent frames at the end of the clip whose exit step keeps gradients (None: all)
    context_noise=0.0,  # the cache is refilled with each chunk's x0 at this noise level (0: clean)
    min_timestep=20,
    max_timestep=980,
    adapter={{_base_.method.adapter}},
)
