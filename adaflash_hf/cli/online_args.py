"""The online adapter's flags, shared by `adaflash adapt` and `adaflash serve --online`.

Unset flags keep :class:`~adaflash_hf.online.config.OnlineConfig`'s defaults (one place for them).
"""

from __future__ import annotations

import os
import tempfile

from ..loading import HUB_ID, UsageError
from .common import nonneg_float, nonneg_int, number, positive_float, positive_int


# A server keeps most of its throughput while it learns with these two: a child process takes the update's Python off
# the serving interpreter, and the share bounds its GPU time.
# "auto": a child process on CUDA (shared through CUDA IPC); on the CPU a thread, since sharing CPU tensors goes
# through /dev/shm, which containers often keep small, and the measurement was a GPU's.
SERVE_TRAIN_SHARE = 0.25
SERVE_TRAINER = "auto"


def add_online_args(g, method_flag: str = "--method", output_required: bool = True, train_share: float | None = None,
                    trainer: str | None = None) -> None:
    """Add the adapter's flags to the argparse group ``g`` (``method_flag``: its name for the method;
    ``train_share`` / ``trainer``: the defaults of --train-share / --trainer, ``None`` for OnlineConfig's)."""
    _DEFAULTS.clear()

    def add(*flags, **kwargs):  # remembers each flag's default, for online_flags_given
        action = g.add_argument(*flags, **kwargs)
        _DEFAULTS[action.dest] = (action.option_strings[0], action.default)

    add("--output-dir", required=output_required, help="where the numbered versions are written")
    add("--hub-repo", "--push-to-hub", dest="hub_repo", metavar="REPO",
        help="also push every version to this Hub model repo (org/name)")
    add("--hub-private", action="store_true", help="create the Hub repo as private")
    add(method_flag, dest="method", choices=("opd", "osd", "off"), default="opd",
        help="opd: AdaFlash on-policy distillation; osd: forward-KL baseline; off: measure only")
    add("--sample-unit", choices=("request", "round"), default=None,
        help="what one sample is: a finished request (the paper's unit; default) or one verified round")
    add("--samples-per-update", type=positive_int, default=None,
        help="samples buffered per update (default 128 requests, as the paper)")
    add("--epochs", type=positive_int, default=None, help="passes over an update's samples")
    add("--train-batch-size", type=positive_int, default=None, help="samples per optimizer step")
    add("--lr", type=positive_float, default=None, help="drafter learning rate")
    add("--head-lr", type=positive_float, default=None, help="length-head learning rate")
    add("--train-share", type=number(float, lambda v: 0 < v <= 1, "a number in (0, 1]"), default=train_share,
        help="the most of the wall clock an update may train (it sleeps between steps, so serving beside it "
             f"loses less; default: {'1.0' if train_share is None else train_share})")
    add("--trainer", choices=("thread", "process", "auto"), default=trainer,
        help="where an update trains: a thread of this process or a child process sharing the models' memory, so "
             "that its Python never holds the serving loop's interpreter lock; auto: a process when the drafter is "
             f"on CUDA, else a thread (default: {trainer or 'thread'})")
    add("--trainer-device", default=None, metavar="DEVICE",
        help="where updates train and are judged (cpu, cuda:1...; default: the drafter's device): another GPU than "
             "the serving one keeps every training step off it, with a copy of the target there; the weights cross "
             "only at a swap. Indices count the devices CUDA_VISIBLE_DEVICES shows")
    add("--layout", choices=("native", "dflash"), default="native", help="version layout (dflash: what SGLang / vLLM load)")
    add("--keep-versions", type=positive_int, default=None, help="rolling window of versions kept on disk")
    add("--guard-samples", type=nonneg_int, default=None,
        help="requests of each update held back from training to judge it: it is swapped in only if its "
             "acceptance on them is not lower than the serving weights', else kept aside in OUTPUT_DIR/refused "
             "(default: samples-per-update // 8; 0: off; request samples only)")
    add("--guard-margin", type=number(float, lambda v: True, "a number"), default=None,
        help="acceptance (tokens per block) a candidate may lose on the held-back requests and still be "
             "swapped in (negative: what it must gain)")
    add("--guard-confidence", type=nonneg_float, default=None,
        help="standard errors of a candidate's paired gain on the held-back requests it must clear to be swapped "
             "in (default 0: the gain itself decides; 1-2 refuse gains the held-back sample cannot tell from noise)")
    add("--rollback-rounds", type=nonneg_int, default=None,
        help="served rounds after a swap that judge it against as many rounds before it; a fall of served "
             "tau beyond --rollback-margin restores the previous weights (0: never)")
    add("--rollback-margin", type=nonneg_float, default=None,
        help="relative fall of served tau after a swap that rolls it back")


_DEFAULTS: dict[str, tuple[str, object]] = {}  # dest -> (first flag, default), as add_online_args added them


def online_flags_given(args) -> list[str]:
    """The adapter flags set to something other than their default (``serve`` refuses them without --online)."""
    return [flag for dest, (flag, default) in _DEFAULTS.items() if getattr(args, dest, default) != default]


def check_online_args(args) -> None:
    """Refuse bad adapter flags before anything loads."""
    from ..online.config import resolve_trainer_device

    if args.trainer_device is not None:
        try:
            resolve_trainer_device(args.trainer_device)
        except ValueError as e:
            raise UsageError(f"--trainer-device {args.trainer_device}: {e}",
                             "pass cpu or a cuda:N this process sees, or leave it out to train beside the drafter") from None
    if args.output_dir:
        check_output_dir(args.output_dir)
    if args.hub_repo and not HUB_ID.match(args.hub_repo):
        raise UsageError(f"--hub-repo {args.hub_repo!r} is not a Hub repository id", "use the form org/name")
    if args.hub_repo and not args.output_dir:
        raise UsageError("--push-to-hub needs --output-dir", "pass --output-dir DIR: every version is written there first")
    try:  # the settings' own checks (e.g. --guard-samples below --samples-per-update), before anything loads
        online_config(args)
    except ValueError as e:
        raise UsageError(f"online adaptation flags: {e}", "see the flags' --help") from None


def check_output_dir(path: str) -> None:
    """Create ``path`` if missing and write a file in it, so that a folder the versions cannot go to fails in one
    line before any model loads (a file in its place, no permission, a read-only or full disk)."""
    if os.path.isfile(path):
        raise UsageError(f"--output-dir {path} is a file", "pass a directory for the numbered versions")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path) as f:
            f.write(b"adaflash")
    except OSError as e:
        raise UsageError(f"--output-dir {path} cannot be written: {e.strerror or type(e).__name__}",
                         "pass a folder this user can create and write") from None


def online_adapter(args, drafter, target):
    """The :class:`OnlineAdapter` the flags describe, attached to ``drafter``; a trainer process whose shared memory
    does not fit is the user's one-line error."""
    from ..online import OnlineAdapter
    from ..online.trainer_process import SharedMemoryTooSmall

    try:
        return OnlineAdapter(drafter, target, online_config(args, drafter))
    except SharedMemoryTooSmall as e:
        raise UsageError(e.problem, "--trainer thread, or a larger /dev/shm (docker run --shm-size)") from None


def online_config(args, drafter=None):
    """The :class:`OnlineConfig` the flags describe (unset flags: its defaults); ``--trainer auto`` is resolved by
    ``drafter``'s device (a thread when no drafter is given: the flags' own check, before anything loads)."""
    from ..online import OnlineConfig

    trainer = args.trainer
    if trainer == "auto":
        on_cuda = drafter is not None and next(drafter.parameters()).device.type == "cuda"
        trainer = "process" if on_cuda else "thread"

    flags = {"sample_unit": args.sample_unit, "samples_per_update": args.samples_per_update, "epochs": args.epochs,
             "batch_size": args.train_batch_size, "lr": args.lr, "head_lr": args.head_lr, "train_share": args.train_share, "trainer": trainer, "keep_versions": args.keep_versions,
             "trainer_device": args.trainer_device,
             "guard_samples": args.guard_samples, "guard_margin": args.guard_margin,
             "guard_confidence": args.guard_confidence, "rollback_rounds": args.rollback_rounds,
             "rollback_margin": args.rollback_margin}
    return OnlineConfig(
        method=args.method, output_dir=args.output_dir, hub_repo=args.hub_repo, version_layout=args.layout,
        resume=not getattr(args, "fresh", True),  # serve resumes unless --fresh; adapt has no such flag
        hub_private=True if args.hub_private else None, seed=getattr(args, "seed", 0) or 0,
        target_name="reference target (adaflash_hf.reference)" if args.reference else args.target,
        **{k: v for k, v in flags.items() if v is not None},
    )  # fmt: skip
