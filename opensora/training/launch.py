"""``scripts/diffusion/train.py``'s logic, importable: parse the config and flags, build the trainer, run."""

import logging
import os
import sys

from opensora.cli_errors import check_range, run_cli
from opensora.config import ConfigKeyError, ConfigValueError, load_config_from_cli
from opensora.quiet_logs import quiet_third_party
from opensora.role_config import role_configs
from opensora.training.defaults import TRAINER_DEFAULTS
from opensora.training.run_dir import check_load_path, prepare_outputs
from opensora.training.validation import validation_settings

_FLAG_SETTINGS = (
    "outputs",
    "max_steps",
    "ckpt_every",
    "max_minutes",
    "save_at_end",
    "profile_steps",
    "sequence_parallel_size",
)
TRAIN_FLAGS = {
    **{name: TRAINER_DEFAULTS[name] for name in _FLAG_SETTINGS},
    "load": None,  # a checkpoint directory to resume from
    "resume": None,  # "auto": the newest complete checkpoint under outputs
    "overwrite": False,  # a fresh run into an outputs dir holding a run: move the old run aside (never deleted)
}


def check_train_flags(cfg, args) -> None:
    """Range checks of the common flags, before anything is built or written."""
    check_range("max_steps", args.max_steps, 1, integer=True)
    check_range("ckpt_every", args.ckpt_every, 0, integer=True)
    check_range("max_minutes", args.max_minutes, 0, allow_none=True)
    check_range("sequence_parallel_size", args.sequence_parallel_size, 1, integer=True)
    check_range("seed", cfg.get("seed", 0), 0, 2**32 - 1, integer=True)
    check_range("grad_accum", cfg.get("grad_accum", 1), 1, integer=True)
    check_range("keep_last", cfg.get("keep_last", 3), 0, integer=True)
    check_range("num_workers", cfg.get("num_workers", 2), 0, integer=True)
    check_range("warmup_steps", cfg.get("warmup_steps"), 0, integer=True, allow_none=True)  # None: per role
    if cfg.get("lr") is not None:
        check_range("lr", cfg.lr, 0)


def main(argv=None) -> None:
    quiet_third_party()
    try:
        cfg, args = load_config_from_cli(
            argv,
            script_flags=TRAIN_FLAGS,
            prog="train.py",
            description="Train a video diffusion model (flow matching or a distillation method).",
        )
        role_configs(cfg)  # a role key that would be ignored is reported here, before anything heavy loads
        validation_settings(cfg)  # so is a validation key that does not exist
    except (ConfigKeyError, ConfigValueError) as error:
        # a typo in the config or on the command line: one line naming the key (and its nearest match)
        raise SystemExit(f"train.py: error: {error}") from None
    if args.load is not None and args.resume is not None:
        raise SystemExit("give either --load DIR or --resume auto, not both")
    if args.resume not in (None, "auto"):
        raise SystemExit(f"--resume only takes 'auto' (got {args.resume!r}); use --load DIR for a given checkpoint")
    check_train_flags(cfg, args)
    if args.load is not None:
        check_load_path(args.load)
    aside = prepare_outputs(
        cfg.outputs,
        args.load,
        args.resume == "auto",
        bool(args.overwrite),
        is_main=int(os.environ.get("RANK", "0")) == 0,
    )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if aside is not None:
        logging.getLogger(__name__).warning("--overwrite: moved the earlier run in %s to %s", cfg.outputs, aside)
    from opensora.training.trainer import Trainer  # heavy imports after argument errors are reported

    trainer = Trainer(cfg)
    trainer.resume(load=args.load, auto=args.resume == "auto")
    trainer.train()


if __name__ == "__main__":
    sys.exit(run_cli(main, sys.argv[1:], prog="train.py"))
