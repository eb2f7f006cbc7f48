# Causal ODE init on GPU: configs/distill/ode_init_gpu.py with a block-causal student (stage 1 of Self-Forcing,
# benchmarks/gpu_self_forcing.sh). 16-frame clips -> 16 latent frames; chunks of 2 latent frames (128 video tokens)
# give 8 chunks per clip.
_base_ = ["ode_init_gpu.py"]

outputs = "outputs/moving_shapes_gpu/causal_ode"
num_frames_per_chunk = 2

# eager student blocks: per-chunk timesteps attend through sibling-KV hooks, not verified under compiled blocks
models = dict(student=dict(model=dict(causal_chunk_frames=num_frames_per_chunk, compile_blocks=False)))
# half the samples with a clean prefix of chunks at t = 0, as the streaming cache holds them (CausalODEInit): on the
# CPU demo this kept a streamed init's background at 21.5 against 5 without (data 24), at the same accuracy
method = dict(num_frames_per_chunk=num_frames_per_chunk, clean_context_prob=0.5)
