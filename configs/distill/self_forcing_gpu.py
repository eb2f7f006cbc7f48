# Self-Forcing on GPU: configs/distill/dmd2_gpu.py with the causal ODE-init student (causal_ode_gpu.py) rolled out
# chunk by chunk through its KV cache (stage 2 of benchmarks/gpu_self_forcing.sh):
#   torchrun --nproc_per_node N scripts/diffusion/train.py configs/distill/self_forcing_gpu.py \
#       --models.student.init_from.path S --models.teacher.init_from.path T --models.critic.init_from.path T
# with S the causal ODE-init checkpoint and T the teacher's.
_base_ = ["dmd2_gpu.py"]

outputs = "outputs/moving_shapes_gpu/self_forcing"
ode_ckpt = "outputs/moving_shapes_gpu/causal_ode/checkpoints/step-0001000"
num_frames_per_chunk = 2  # 8 chunks per 16-frame clip

# streaming sampling, read by scripts/diffusion/inference.py: chunk by chunk with the KV cache, the training rollout
streaming = True
rollout = "renoise"
context_time = 0.0

models = dict(
    student=dict(
        # eager blocks: the rollout's KV-cache passes are not verified under compiled blocks (the full causal
        # forward is: tests/test_text_padding_gpu.py)
        model=dict(causal_chunk_frames=num_frames_per_chunk, compile_blocks=False),
        init_from=dict(path=ode_ckpt, role="student", ema=True),
    ),
)

method = dict(  # the keys are documented in self_forcing_demo.py; the rest keep their defaults there
    _delete_=True,
    type="SelfForcing",
    step_list={{_base_.step_list}},
    num_frames_per_chunk=num_frames_per_chunk,
    rollout=rollout,
    real_guidance_scale=4.0,  # standard CFG s of the real score (DMD's w = 3), as dmd2_gpu.py's guidance_scale
    adapter={{_base_.method.adapter}},
)
