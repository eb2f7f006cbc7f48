# Sampling the MovingShapes demo model (configs/diffusion/train/demo.py): its model / vae / text_encoder / method
# (the timestep shift) come from the training config, this file adds the sampling settings.
#   python scripts/diffusion/inference.py configs/diffusion/inference/demo.py --ckpt outputs/demo/train \
#       --prompt-file outputs/demo/data/prompts.txt --save-dir outputs/demo/samples
#   python tools/eval_moving_shapes.py outputs/demo/samples/samples.csv --json outputs/demo/samples/eval.json
_base_ = ["../train/demo.py"]

ckpt = "outputs/demo/train"  # a training outputs dir means its newest checkpoint
role = "model"
ema = True
save_dir = "outputs/demo/samples"
prompt = None
prompt_file = None

seed = 0  # sample i uses seed + i
num_steps = 30
step_list = None
num_frames = 16
resolution = "32x32"
aspect_ratio = "1:1"
fps = 8
batch_size = 8

guidance_scale = 4.0  # text CFG (2 passes per step without a reference)
image_guidance_scale = 1.5  # image CFG (3 passes per step with a reference)
cond_type = "t2v"
ref = None

dtype = "auto"
device = "auto"
offload = False
