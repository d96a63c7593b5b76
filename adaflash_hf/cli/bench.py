"""`adaflash bench`: the flags of `adaflash_hf.bench`, checked here so that mistakes are one line."""

from __future__ import annotations

import os
import shlex

from ..loading import PROMPTS_HINT, UsageError, check_drafter_path, check_target_path, one_line
from .common import PROG, THREADS_HELP, check_either_reference, positive_int

HELP = "benchmark decoding methods side by side (tok/s, speedup, tau), checked for correctness"


def description() -> str:
    from .. import bench

    return (bench.__doc__ or "").split("\n\n")[0] + (
        "\n\nexample:\n  adaflash bench --reference --datasets gsm8k --num-prompts 4 "
        "--max-new-tokens 64 --methods plain,fixed,adaptive --out runs/bench"
    )


def add_arguments(p) -> None:
    from ..bench.cli_args import add_arguments as add_bench_arguments

    add_bench_arguments(p)
    p.add_argument("--threads", type=positive_int, help=THREADS_HELP)


def _check_models(args) -> None:
    check_either_reference(args)
    if not args.reference:
        if not args.target:
            raise UsageError("no target model given", "pass --target PATH_OR_HUB_ID --drafter PATH_OR_HUB_ID, or --reference")
        check_target_path(args.target)
        if args.drafter:
            check_drafter_path(args.drafter)
    if args.assistant:
        check_target_path(args.assistant, "--assistant")


def _check_workload(args, methods) -> None:
    unknown = [m for m in args.methods if m not in methods]
    if unknown or not args.methods:
        raise UsageError(f"--methods: unknown method(s) {', '.join(unknown) or '(none given)'}", f"choose from {', '.join(methods)}")
    for flag, value in (("--num-prompts", args.num_prompts), ("--max-new-tokens", args.max_new_tokens)):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}", f"see `{PROG} bench --help`")
    if not args.concurrency or min(args.concurrency) < 1:
        raise UsageError(f"--concurrency must list batch sizes >= 1, got {args.concurrency}", "e.g. --concurrency 1,4,16")


def _check_dataset_name(spec: str) -> None:
    """A named set (`--help` lists them), a suite, ``spec_bench:CATEGORY`` or ``eagle_bench:TASK``."""
    from ..bench.cli_args import dataset_names
    from ..training import data as D

    name = spec.strip().lower()
    family, _, part = name.partition(":")
    if name in dataset_names() or (family == "spec_bench" and part):
        return
    hint = f"choose from {', '.join(dataset_names())}, spec_bench:CATEGORY or jsonl:PATH"
    if family == "eagle_bench" and part:
        raise UsageError(f"--datasets: unknown eagle_bench task {part!r}", f"choose from {', '.join(D.EAGLE_TASKS)}")
    raise UsageError(f"--datasets: unknown dataset {spec!r}", hint)


def _check_datasets(args) -> None:
    from ..training import data as D

    if not args.datasets:
        raise UsageError("--datasets is empty", "e.g. --datasets gsm8k,mathqa")
    named = []
    for spec in args.datasets:
        if spec.startswith("jsonl:"):
            if not os.path.isfile(spec[len("jsonl:") :]):
                raise UsageError(f"--datasets: prompts file not found: {spec[len('jsonl:'):]}", f"pass jsonl:{PROMPTS_HINT}")
        else:
            _check_dataset_name(spec)
            named.append(spec)
    if named:
        try:
            D.local_data_dir(args.data_dir)  # None (Hub, then the built-in sample) unless a folder was asked for
        except FileNotFoundError as e:
            raise UsageError(one_line(e), f"pass --data-dir DIR or set {D.ENV_VAR}") from None


def run(args) -> int:
    from .. import bench
    from ..bench.cli_args import fill_defaults

    fill_defaults(args)
    _check_models(args)
    _check_workload(args, bench.METHODS)
    _check_datasets(args)
    args.command = shlex.join([PROG, "bench", *args._argv])
    return bench.run_from_args(args)
