# Causal ODE init (CausVid's ODE-pair regression): configs/distill/ode_init_demo.py with a block-causal student, the
# first stage of Self-Forcing (configs/distill/self_forcing_demo.py). Train the demo teacher first (dmd2_demo.py), then:
#   python scripts/diffusion/train.py configs/distill/causal_ode_demo.py
# The student keeps the teacher's weights and changes only its attention pattern: video chunk c attends to the text
# and to chunks <= c; text attends to text. The teacher stays bidirectional.
_base_ = ["ode_init_demo.py"]

outputs = "outputs/demo/causal_ode"

# 16-frame clips -> 16 latent frames (PatchVAE keeps time): chunks of 2 latent frames give 8 chunks per clip, so the
# student learns to continue a video from earlier chunks many times per clip (1 frame per chunk: 16 chunks, twice
# the streaming passes; 4: too few chunks to learn continuation from).
num_frames_per_chunk = 2

models = dict(student=dict(model=dict(causal_chunk_frames=num_frames_per_chunk)))
method = dict(num_frames_per_chunk=num_frames_per_chunk)
