# Tiny MovingShapes demo: trains on a 2-core CPU in minutes (`make demo`). Single process or
# `colossalai run --nproc_per_node 2` (gloo + the CPU shim) both work.
from opensora.models.mmdit.configs import mmdit_config

outputs = "outputs/demo/train"
seed = 42
max_steps = 1000
ckpt_every = 500
keep_last = 2
grad_accum = 1
precision = "fp32"  # bf16 matmuls are slow on most CPUs; GPU configs use bf16

# ---- data ---------------------------------------------------------------------------------------------------
dataset = dict(type="VideoTextDataset", data_path="outputs/demo/data/meta.csv", frame_interval=1)
# resolution -> num_frames -> (keep probability, batch size); "32x32" means exactly 32x32 pixels
bucket_config = {"32x32": {16: (1.0, 8)}}
num_workers = 2

# ---- frozen components --------------------------------------------------------------------------------------
vae = dict(type="PatchVAE", patch_size=4, temporal_patch_size=1)  # lossless: [3,16,32,32] -> [48,16,8,8]
text_encoder = dict(type="TextConditioner", seed=0)  # tiny random T5 + CLIP over a byte tokenizer

# ---- the trained network: the tiny preset on PatchVAE's 48-channel latents ----------------------------------
model = mmdit_config("tiny", in_channels=48, cond_channels=49)  # cond: mask + masked condition latents (I2V/V2V)

# ---- optimisation: Open-Sora's top-level keys, the shorthand for the single role "model" ----------------------
lr = 1e-3
warmup_steps = 50
lr_decay = None  # constant lr after warmup; dict(type="cosine", fraction=0.5) decays it (opensora/lr_schedule.py)
grad_clip = 1.0
ema_decay = 0.99
ema_start_step = 0
plugin = dict(type="LowLevelZeroPlugin", stage=2)

method = dict(
    type="FlowMatching",
    timestep_kind="logit_normal",
    shift=dict(base_tokens=256, base_shift=1.0),
    text_dropout=0.1,
    condition_probs=dict(t2v=0.7, i2v_head=0.2, v2v_head=0.1),
)

tensorboard = True
wandb = dict(enable=False, mode="offline", project="opensora-demo")

# ---- validation samples during training (README "Validation during training"): off here; turn on with
# `--validation.every 100`. 12 captions: every colour twice, shape 4 times, direction 3 times; scored in memory.
# (Configs inheriting this one keep these keys: a distilled student still samples on its step list, CFG 1.)
validation = dict(
    every=0,
    prompts=[
        "a red circle moving left",
        "a yellow square moving right",
        "a green triangle moving up",
        "a cyan circle moving down",
        "a blue square moving left",
        "a magenta triangle moving right",
        "a red square moving up",
        "a yellow triangle moving down",
        "a green circle moving left",
        "a cyan square moving right",
        "a blue triangle moving up",
        "a magenta circle moving down",
    ],
    prompt_file=None,  # a txt / csv of prompts replaces the list
    num_steps=10,
    score="moving_shapes",
)
