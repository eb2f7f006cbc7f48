# Self-Forcing distillation of the MovingShapes demo teacher into a causal, streaming 4-step student, on CPU in
# minutes. Stage 1 is configs/distill/causal_ode_demo.py (the student starts from its checkpoint); then:
#   python scripts/diffusion/train.py configs/distill/self_forcing_demo.py
# It is configs/distill/causvid_demo.py (DMD2 with the causal student) with the student rolled out chunk by chunk
# through its KV cache, as it streams at inference; the teacher (real score, CFG) and the critic (fake score) stay
# bidirectional. Sample it chunk by chunk with opensora.inference.streaming and the same rollout rule.
_base_ = ["causvid_demo.py"]

outputs = "outputs/demo/self_forcing"
max_steps = 200  # `make demo-stream`: ~1 s per step on 2 cores (the student updates on every 5th)
ckpt_every = 100
rollout = "renoise"  # between steps of a chunk: x0 re-noised with fresh noise ("euler": Euler step); also the sampler's

method = dict(
    type="SelfForcing",  # CausVid's keys (step_list, num_frames_per_chunk, real_guidance_scale, ...) carry over
    rollout=rollout,
    student_update_every=5,  # critic every iteration, student every 5th (Self-Forcing's ratio)
    grad_frames=None,  # latent frames at the end of the clip whose exit step keeps gradients (None: all)
    context_noise=0.0,  # the cache is refilled with each chunk's x0 at this noise level (0: clean; = context_time)
)
