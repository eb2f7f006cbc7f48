"""The trainer's settings (top-level config keys) and their defaults, in one table.

``train.py`` turns the command-line ones into flags (``launch.TRAIN_FLAGS``); the trainer reads every setting
through ``TRAINER_DEFAULTS`` when a config leaves it out. Per-network settings (lr, warmup, clipping, EMA) are
role keys: ``opensora.role_config``.
"""

TRAINER_DEFAULTS = dict(
    outputs="outputs/run",
    max_steps=1000,
    ckpt_every=0,  # 0: only the final save
    keep_last=3,  # complete checkpoints kept; older ones are deleted
    save_at_end=True,  # False for throwaway runs (benchmarks): no final checkpoint
    max_minutes=None,  # wall-clock budget: stop (and save) at the first step past it
    grad_accum=1,
    precision="bf16",  # of the frozen components, and of the single role of plain training
    max_consecutive_nonfinite=5,  # non-finite losses in a row before the run stops
    # "auto": a non-finite step is skipped on the device and the host reads the verdict one step later, where every
    # stepping optimizer is torch's fused Adam/AdamW and the method's step ignores the iteration; else (and with
    # "sync") the host reads it before each optimizer step
    nonfinite_check="auto",
    num_workers=2,
    prefetch_factor=2,  # batches each worker prepares ahead (with num_workers > 0)
    persistent_workers=True,  # keep the workers across epochs (no restart stall at every epoch start)
    tensorboard=True,
    wandb=None,
    profile_steps=None,  # e.g. "{'start': 15, 'steps': 3}": GPU kernel time split, {outputs}/profile/rank{r}.json
    sequence_parallel_size=1,  # ranks that share each sample (MMDiT all-to-all sequence parallelism)
    validation=None,  # dict(every=N, prompts=[...], ...): samples during training (``VALIDATION_DEFAULTS``)
)

# ``validation = dict(...)`` keys (``opensora.training.validation``); None means "from the config, see there"
VALIDATION_DEFAULTS = dict(
    every=0,  # sample every N optimizer steps on rank 0; 0 / None: off
    prompts=None,  # the fixed prompt set (a list) ...
    prompt_file=None,  # ... or a txt (one per line) / csv (text column) file, which replaces the list
    seed=0,  # sample i uses seed + i ...
    seeds=None,  # ... unless seeds are listed (one per prompt)
    num_frames=None,  # None: the first bucket's first frame count
    resolution=None,  # None: the first bucket's resolution ("32x32", "256px", ...)
    aspect_ratio=None,  # for an area resolution ("256px"); None: square
    num_steps=None,  # None: the config's num_steps, else 20; used only where no step_list applies
    step_list=None,  # None: method.step_list (few-step students), else the config's step_list, if any
    guidance_scale=None,  # None: the config's guidance_scale, else 4.0 (1.0 with a step_list)
    role=None,  # None: the config's sampling ``role``, else "model", else "student"
    score=None,  # "moving_shapes": score the samples and log val/color_acc, val/shape_acc, val/direction_acc
    batch_size=8,  # samples per sampler call (never changes a sample)
    max_seconds=300.0,  # stop sampling (between batches) once this is spent; other ranks wait at most ~this
    max_prompts=64,  # a config listing more prompts is an error
    fps=8,
    long_frames=None,  # also sample this many frames and log per-window scores (``validation_windows``)
    window_frames=None,  # frames per scored window of a long clip; None: num_frames
    motion=None,  # the MovingShapes motion rule clips are scored by (linear, bounce, wrap); None: the dataset's
    # a logged score (higher is better, e.g. "val/all_acc", "val/stats_window_min"): the run notes it in best.json
    # and keeps that step's checkpoint (``opensora.best_checkpoint``; ``every`` a multiple of ``ckpt_every``)
    best_metric=None,
    # also validate the run's last step when ``every`` does not divide it (a run stopped by max_minutes or max_steps),
    # after its checkpoint is saved: best.json then weighs the checkpoint the run ends on. Not after a preemption
    at_end=True,
)
