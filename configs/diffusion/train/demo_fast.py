# `make demo`'s training config: demo.py shrunk until the tiny model learns colour, shape and motion direction
# within minutes on 2 CPU cores (benchmarks/reports/demo_cpu_2026-11.md has the runs behind each choice).
# demo.py stays the shared base of the tests and the distillation demos (32x32x16 clips).
_base_ = ["demo.py"]

max_steps = 3200  # 9.7 min on 2 cores (0.18 s/step, DDP below): shape 0.847 in one run; 2400 ZeRO steps took as long
ckpt_every = 1200
# One process has nothing to shard: LowLevelZero's flat-buffer copies and per-parameter hooks cost ~40% of the step
# on 2 cores (benchmarks/reports/demo_cpu_2026-11.md). DDP also trains on `colossalai run --nproc_per_node 2` (gloo).
plugin = dict(_delete_=True, type="TorchDDPPlugin")
lr = 2e-3  # twice demo.py's: the short run learns shape sooner (QK-norm and grad clip keep it stable)

# 24x24 clips of 4 frames, 16 per step: the shape travels 2.4-3.6 px a frame, so motion is easy to see and to learn.
bucket_config = {"_delete_": True, "24x24": {4: (1.0, 16)}}
# PatchVAE 3: [3,4,24,24] -> [27,4,8,8]; the model's 2x2 patches are 108-value tokens, fewer than its 128 channels
# (PatchVAE 4 on 32x32 gives 192-value tokens: a bottleneck that holds the loss near 0.47).
vae = dict(patch_size=3)
model = dict(in_channels=27, cond_channels=28)
text_encoder = dict(t5=dict(max_length=32))  # the longest caption is 31 bytes + EOS: no padding tokens to attend
method = dict(
    shift=dict(base_tokens=64, base_shift=3.0),  # 64 tokens -> shift 3: most steps at the noisy t that set motion
    condition_probs=dict(_delete_=True, t2v=1.0),  # text-to-video only: the demo samples nothing else
)
