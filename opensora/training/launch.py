"""``scripts/diffusion/train.py``'s logic, importable: parse the config and flags, build the trainer, run."""

import logging
import sys

from opensora.config import ConfigKeyError, ConfigValueError, load_config_from_cli

TRAIN_FLAGS = {
    "outputs": "outputs/run",
    "max_steps": 1000,
    "ckpt_every": 0,
    "load": None,  # a checkpoint directory to resume from
    "resume": None,  # "auto": the newest complete checkpoint under outputs
    "max_minutes": None,  # wall-clock budget: stop (and save) at the first step past it
    "save_at_end": True,  # False for throwaway runs (benchmarks): no final checkpoint
    "profile_steps": None,  # e.g. "{'start': 15, 'steps': 3}": GPU kernel time split, {outputs}/profile/rank{r}.json
    "sequence_parallel_size": 1,  # ranks that share each sample (MMDiT all-to-all sequence parallelism)
}


def main(argv=None) -> None:
    try:
        cfg, args = load_config_from_cli(
            argv, script_flags=TRAIN_FLAGS, prog="train.py",
            description="Train a video diffusion model (flow matching or a distillation method).")
    except (ConfigKeyError, ConfigValueError) as error:
        # a typo on the command line: one line naming the key (and its nearest match), not a traceback
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
