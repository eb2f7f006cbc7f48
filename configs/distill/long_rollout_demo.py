# Long-rollout DMD (Self-Forcing++-style) of the MovingShapes demo teacher into a causal streaming student, on CPU in
# minutes: configs/distill/self_forcing_demo.py with the student rolled out 4x the clip length through its rolling
# KV cache (sink frames included) and DMD applied to one 16-frame window of that rollout per iteration (see
# opensora/methods/long_rollout.py). Start from the causal ODE init (causal_ode_demo.py) or a Self-Forcing student:
#   python scripts/diffusion/train.py configs/distill/long_rollout_demo.py
# Sample long videos with the same cache the student trained with (window_frames / sink_frames below), e.g.
#   python scripts/diffusion/inference.py configs/distill/long_rollout_demo.py --ckpt CKPT --num-frames 128 ...
_base_ = ["self_forcing_demo.py"]

outputs = "outputs/demo/long_rollout"

# the rolling KV cache in latent frames; the streaming sampler reads the same two keys, so it keeps the cache the
# student trained with (the method alone would default to the clip's latent frames minus one chunk; the sampler's
# None keeps every frame, so set it)
window_frames = 3  # the demo's 4 latent frames per clip minus one chunk (chunks of 1 latent frame)
sink_frames = {{_base_.num_frames_per_chunk}}  # the first chunk stays in view (frame sink)
# the text and the sinks at the window's start in RoPE time once it rolls: the sampling CLI's default,
# so the student trains where it will stream (long_rollout_gpu.py says why)
rope_anchor = "window"
_links_ = dict(
    window_frames=["method.kv_window_frames"],
    sink_frames=["method.kv_sink_frames"],
    rope_anchor=["method.kv_rope_anchor"],
)

method = dict(
    _delete_=True,
    type="LongRollout",
    step_list={{_base_.step_list}},
    num_frames_per_chunk={{_base_.num_frames_per_chunk}},
    rollout={{_base_.rollout}},
    student_update_every=5,
    real_guidance_scale=3.0,  # standard CFG s of the teacher's real score, u + s (c - u); DMD's w = s - 1
    min_timestep=20,
    max_timestep=980,
    rollout_multiple=4,  # the student streams up to 4x the clip length; the judged window ends anywhere in it
    window="uniform",  # or "last": always the rollout's last window
    kv_window_frames=window_frames,
    kv_sink_frames=sink_frames,
    kv_rope_anchor=rope_anchor,
    adapter={{_base_.method.adapter}},
)
