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
    num_workers=2,
    tensorboard=True,
    wandb=None,
    profile_steps=None,  # e.g. "{'start': 15, 'steps': 3}": GPU kernel time split, {outputs}/profile/rank{r}.json
    sequence_parallel_size=1,  # ranks that share each sample (MMDiT all-to-all sequence parallelism)
)
