"""``scripts/diffusion/train.py``'s logic, importable: parse the config and flags, build the trainer, run."""

import logging
import sys

from opensora.config import ConfigKeyError, ConfigValueError, load_config_from_cli
from opensora.role_config import role_configs
from opensora.training.defaults import TRAINER_DEFAULTS

_FLAG_SETTINGS = ("outputs", "max_steps", "ckpt_every", "max_minutes", "save_at_end", "profile_steps",
                  "sequence_parallel_size")
TRAIN_FLAGS = {
    **{name: TRAINER_DEFAULTS[name] for name in _FLAG_SETTINGS},
    "load": None,  # a checkpoint directory to resume from
    "resume": None,  # "auto": the newest complete checkpoint under outputs
}


def main(argv=None) -> None:
    try:
        cfg, args = load_config_from_cli(
            argv, script_flags=TRAIN_FLAGS, prog="train.py",
            description="Train a video diffusion model (flow matching or a distillation method).")
        role_configs(cfg)  # a role key that would be ignored is reported here, before anything heavy loads
    except (ConfigKeyError, ConfigValueError) as error:
        # a typo in the config or on the command line: one line naming the key (and its nearest match)
        raise SystemExit(f"train.py: error: {error}") from None
    if args.load is not None and args.resume is not None:
        raise SystemExit("give either --load DIR or --resume auto, not both")
    if args.resume not in (None, "auto"):
        raise SystemExit(f"--resume only takes 'auto' (got {args.resume!r}); use --load DIR for a given checkpoint")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from opensora.training.trainer import Trainer  # heavy imports after argument errors are reported

    trainer = Trainer(cfg)
    trainer.resume(load=args.load, auto=args.resume == "auto")
    trainer.train()


if __name__ == "__main__":
    main(sys.argv[1:])
