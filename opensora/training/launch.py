"""``scripts/diffusion/train.py``'s logic, importable: parse the config and flags, build the trainer, run."""

import logging
import signal
import sys
from pathlib import Path

from opensora.cli_errors import check_range
from opensora.config import ConfigKeyError, ConfigValueError, load_config_from_cli
from opensora.quiet_logs import quiet_third_party
from opensora.role_config import role_configs
from opensora.shape_rules import check_training_shapes
from opensora.training.defaults import TRAINER_DEFAULTS
from opensora.training.run_dir import check_load_path, check_max_steps_after, checkpoint_step, prepare_outputs
from opensora.training.run_lock import check_not_in_use
from opensora.training.validation import validation_settings
from opensora.writable import check_writable_dir

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


def main(argv=None) -> int:
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
    check_training_shapes(cfg)  # every bucket against the VAE and patch sizes, before anything is built
    if args.load is not None:
        check_load_path(args.load)
        check_max_steps_after(args.load, args.max_steps)
    # a live run's directory is busy, not finished: said before "already holds a run"
    check_not_in_use(cfg.outputs, bool(args.overwrite))
    move_old_run = prepare_outputs(cfg.outputs, args.load, args.resume == "auto", bool(args.overwrite))
    check_writable_dir(cfg.outputs, "--outputs")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from opensora.training.distributed import init_distributed  # heavy imports after argument errors are reported
    from opensora.training.preemption import EXIT_PREEMPTED, Preemption
    from opensora.training.run_lock import claim_outputs

    with Preemption(Path(cfg.outputs) / "checkpoints") as preemption:  # until the end: a launcher may signal again
        rank = init_distributed()[0]
        with claim_outputs(cfg.outputs, move_old_run) as aside:  # one run per outputs directory (rank 0 holds it)
            if aside is not None:
                logging.getLogger(__name__).warning(
                    "--overwrite: moved the earlier run in %s to %s", cfg.outputs, aside
                )
            from opensora.training.checkpoint import resolve_resume_path
            from opensora.training.trainer import Trainer

            # verified (sizes and checksums, on rank 0) before anything is built: a damaged --load is refused at once
            resume_from = resolve_resume_path(cfg.outputs, load=args.load, resume_auto=args.resume == "auto")
            if resume_from is not None and args.load is None:
                if checkpoint_step(resume_from) == int(args.max_steps):  # a finished run started again (a requeue)
                    if rank == 0:
                        print(
                            f"train.py: {cfg.outputs} already finished: its newest checkpoint is at step "
                            f"{args.max_steps} = --max-steps; nothing to train (pass a larger --max-steps to go on)",
                            file=sys.stderr,
                            flush=True,
                        )
                    return 0
                check_max_steps_after(resume_from, args.max_steps, "--resume auto: the newest checkpoint")
            trainer = Trainer(cfg)
            trainer.preemption = preemption
            trainer.resume_from(resume_from, auto=args.resume == "auto")
            trainer.train()
        if not trainer.preempted:
            return 0
        if rank == 0:
            print(
                f"train.py: stopped by {signal.Signals(trainer.stop_signal).name} after step "
                f"{trainer.step}: checkpoint {trainer.last_checkpoint} saved; continue with --resume auto "
                f"(exit code {EXIT_PREEMPTED})",
                file=sys.stderr,
                flush=True,
            )
        return EXIT_PREEMPTED


def run_train_script(argv) -> int:
    """``train.py``'s process: ``main`` with its errors reported, the process group released at the end."""
    from opensora.training.distributed import run_script
    from opensora.training.preemption import EXIT_PREEMPTED

    return run_script(main, argv, prog="train.py", clean_codes=(0, EXIT_PREEMPTED))


if __name__ == "__main__":
    sys.exit(run_train_script(sys.argv[1:]))
