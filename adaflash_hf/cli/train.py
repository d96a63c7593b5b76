"""`adaflash train`: offline drafter training, the flags of `adaflash_hf.training.train_drafter`."""

from __future__ import annotations

import argparse
import os

from ..loading import UsageError, check_target_path, locate, one_line
from .common import PROG

HELP = "train a drafter offline on the target's own answers (DFlash recipe, transformers Trainer)"
DESCRIPTION = (
    "Offline drafter training: regenerate answers with the target, train a fresh drafter with DrafterTrainer,\n"
    "save it in the native layout (same flags as `python -m adaflash_hf.training.train_drafter`).\n\n"
    "example:\n  adaflash train --reference --out runs/drafter --domains chat,prose --minutes 5"
)


def add_arguments(p) -> None:
    from ..training.drafter_recipe import add_arguments as recipe_arguments  # torch-free: fast --help

    recipe_arguments(p, require_target=False)
    p.add_argument("--reference", action="store_true",
                   help="train for the embedded reference target, a CPU-sized run unless given otherwise: "
                        + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in REFERENCE_DEFAULTS.items()))
    # None = not given: the recipe's default, or REFERENCE_DEFAULTS under --reference
    p.set_defaults(**{k: None for k in REFERENCE_DEFAULTS})


# `--reference` is a smoke-sized run on CPU (a few seconds of regeneration), not the 256-token recipe.
REFERENCE_DEFAULTS = {"max_new_tokens": 16, "eval_per_domain": 0, "batch_size": 4, "max_anchors": 32}


def _fill_defaults(a) -> None:
    from ..training.drafter_recipe import DrafterRecipe

    for k, small in REFERENCE_DEFAULTS.items():
        if getattr(a, k) is None:
            setattr(a, k, small if a.reference else DrafterRecipe.__dataclass_fields__[k].default)


def _check_domains(a, D) -> None:
    domains = [d.strip() for d in a.domains.split(",") if d.strip()]
    eval_domains = [d.strip() for d in a.eval_domains.split(",") if d.strip()]
    for flag, names in (("--domains", domains), ("--eval-domains", eval_domains)):
        bad = [d for d in names if d not in D.TRAIN_DOMAINS]
        if bad or (flag == "--domains" and not names):
            raise UsageError(f"{flag}: unknown domain(s) {', '.join(bad) or '(none given)'}", f"choose from {', '.join(D.TRAIN_DOMAINS)}")


def _check_numbers(a, prog: str) -> None:
    for flag, value, low in (("--num-prompts", a.num_prompts, 1), ("--max-new-tokens", a.max_new_tokens, 1),
                             ("--batch-size", a.batch_size, 1), ("--num-layers", a.num_layers, 1),
                             ("--block-size", a.block_size, 2), ("--eval-per-domain", a.eval_per_domain, 0)):
        if value < low:
            raise UsageError(f"{flag} must be >= {low}, got {value}", f"see `{prog} --help`")
    if a.steps is not None and a.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {a.steps}", "leave it out to train for --minutes instead")
    if not a.minutes > 0:
        raise UsageError(f"--minutes must be > 0, got {a.minutes}", f"see `{prog} --help`")


def run(a: argparse.Namespace) -> int:
    from ..training import data as D
    from ..training import train_drafter

    prog = f"{PROG} train"
    _fill_defaults(a)
    if a.reference:
        if a.target:
            raise UsageError("pass either --reference or --target, not both", "drop one of them")
        from ..reference import REFERENCE_DIR

        a.target = os.path.join(REFERENCE_DIR, "target")
    if not a.target:
        raise UsageError("train: the following arguments are required: --target", "or pass --reference")
    check_target_path(a.target)
    if a.tokenizer:
        locate(a.tokenizer, "--tokenizer")
    if os.path.isfile(a.out):
        raise UsageError(f"--out {a.out} is a file", "pass a directory for the drafter checkpoint and logs")
    _check_domains(a, D)
    _check_numbers(a, prog)
    cached = a.regen_cache is not None and os.path.isfile(a.regen_cache)
    if a.regen_only and a.regen_cache is None:
        raise UsageError("--regen-only needs --regen-cache FILE", "the regenerated samples are written there")
    if not cached or a.eval_per_domain > 0:
        try:
            D.local_data_dir(a.data)  # none at all is fine: the built-in sample (a one-line note)
        except FileNotFoundError as e:
            raise UsageError(one_line(e), f"pass --data DIR or set {D.ENV_VAR}") from None
    try:
        return train_drafter.run(train_drafter.config_from_args(a))
    except train_drafter.RecipeError as e:  # train_drafter stops on user-fixable problems with a message
        raise UsageError(f"train: {e}", f"see `{prog} --help`") from None
