# Causal ODE init (CausVid's ODE-pair regression): configs/distill/ode_init_demo.py with a block-causal student, the
# first stage of Self-Forcing (configs/distill/self_forcing_demo.py). After `make demo` (its teacher), or with
# --teacher-ckpt RUN_OR_CHECKPOINT (`make demo-stream` runs every stage):
#   python scripts/diffusion/train.py configs/distill/causal_ode_demo.py
# The student keeps the teacher's weights and changes only its attention pattern: video chunk c attends to the text
# and to chunks <= c; text attends to text. The teacher stays bidirectional.
_base_ = ["ode_init_demo.py"]

outputs = "outputs/demo/causal_ode"

# 4-frame clips -> 4 latent frames (PatchVAE keeps time): chunks of 1 latent frame give 4 chunks per clip, so the
# student learns to continue a video from earlier chunks three times per clip (2 frames per chunk: only 2 chunks).
num_frames_per_chunk = 1

from opensora.datasets.moving_shapes import all_captions  # noqa: E402  (a function: not kept in the config)

max_steps = 200  # `make demo-stream`: about a minute on 2 cores with cached pairs
ckpt_every = 100
models = dict(student=dict(model=dict(causal_chunk_frames=num_frames_per_chunk)))
method = dict(
    num_frames_per_chunk=num_frames_per_chunk,
    # half the samples with a clean prefix of chunks at t = 0, as the streaming cache holds them: a streamed init
    # then keeps its background at 21.5 where it fell to 5 without (data 24), at the same accuracy (CausalODEInit)
    clean_context_prob=0.5,
    # the teacher's 30-step CFG trajectories cost ~5 s per step to regenerate on a CPU: integrate 144 of them once
    # (every MovingShapes caption twice, from pair_seed) and draw each batch from them
    pairs="cache",
    prompts=all_captions(),
    num_cached_pairs=144,
)
