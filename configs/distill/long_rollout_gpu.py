# Long-rollout DMD on one GPU (MovingShapes 64x64x16): configs/distill/self_forcing_gpu.py with the student rolled out
# 8x the clip length through its rolling KV cache and DMD on one clip-length window of it per iteration
# (opensora/methods/long_rollout.py). Start from the causal ODE init (or a Self-Forcing student):
#   torchrun --nproc_per_node N scripts/diffusion/train.py configs/distill/long_rollout_gpu.py \
#       --models.student.init_from.path S --models.teacher.init_from.path T --models.critic.init_from.path T
# benchmarks/long_streaming_quality.py runs teacher -> causal init -> Self-Forcing vs this method on the same seeds.
_base_ = ["self_forcing_gpu.py"]

outputs = "outputs/moving_shapes_gpu/long_rollout"

# the rolling KV cache in latent frames, read by the method and by the streaming sampler (set it: the sampler's None
# keeps every frame)
window_frames = 14  # 16 latent frames per clip minus one chunk
sink_frames = {{_base_.num_frames_per_chunk}}
# where the text and the sinks sit in RoPE time once the window rolls (absolute | window), read by the method, the
# windowed validation and the sampler alike. window: the sampling CLI's default (under it a Self-Forcing
# student kept its direction at 8x the clip, benchmarks/reports/long_streaming_h200_2026-11.md); train where it streams
rope_anchor = "window"
# a command-line --window-frames / --sink-frames / --rope-anchor reaches the method's copies too
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
    real_guidance_scale=4.0,
    rollout_multiple=8,  # the measured length: 8x the training clip
    window="uniform",
    kv_window_frames=window_frames,
    kv_sink_frames=sink_frames,
    kv_rope_anchor=rope_anchor,
    # a quarter of the iterations switch every sample's prompt at the judged window's start (re-cache under the new
    # text at the pinned anchor, DMD with the new prompt), so a prompt switch mid-stream is learned. Measured once
    # twice (benchmarks/reports/long_streaming_h200_2026-11.md, sessions 19 and 20), 120 steps from a Self-Forcing
    # student each: it taught no colour switch either time; the student faded once (0.94 -> 0.79 at the clip length)
    # and not the other time, with or without switches; with switches the frame statistics came back (0.72 in range
    # at the clip length against 0.22 without)
    switch_prob=0.25,
    # the chunks before the judged window stop at the exit step (Self-Forcing's rule); "full" runs them through every
    # step, so the window sees the context the sampler would have made (not yet measured)
    context_steps="exit",
    adapter={{_base_.method.adapter}},
)
