"""`adaflash`: the command line of adaflash-hf (one entry point, one subcommand per job).

    adaflash demo                                   # reference pair: text, tau, verify lengths, speedup, lossless check
    adaflash generate --reference --prompt "Hi" --stats
    adaflash bench --reference --datasets gsm8k --num-prompts 8
    adaflash train --reference --out runs/drafter --device cpu --steps 3 --num-prompts 8 --max-new-tokens 16 --eval-per-domain 0
    adaflash adapt --reference --prompts-file prompts.jsonl --output-dir runs/online
    adaflash serve --port 8000                      # OpenAI-compatible HTTP server (reference pair by default)
    adaflash export runs/drafter runs/drafter-dflash
    adaflash info runs/drafter

One module per command (``adaflash_hf.cli.<command>``: ``HELP``, ``DESCRIPTION``, ``add_arguments(p)``,
``run(args)``); what they share is in `.common` and `adaflash_hf.loading`. Only the command being run
has its flags built and its module's heavy imports (torch, transformers) done, so ``--help`` is fast.

Mistakes in what was asked (a missing path, a checkpoint that is not a drafter, a bad flag value, a
missing data file) end with ONE line on stderr, ``adaflash: error: <what> (hint: <what to do>)``,
and exit status 2. Anything else is a bug and keeps its traceback. ``main(argv)`` returns the exit
status instead of exiting, so it can be called in-process.
"""

from __future__ import annotations

import importlib
import os
import sys

from ..loading import UsageError
from .common import PROG, Formatter, Parser
from .info import inspect_checkpoint

__all__ = ["COMMANDS", "UsageError", "build_parser", "inspect_checkpoint", "main"]

COMMANDS = ("demo", "generate", "bench", "train", "adapt", "serve", "export", "info")


def _command_module(name: str):
    return importlib.import_module(f"{__name__}.{name}")


def build_parser(only: tuple[str, ...] | None = None) -> Parser:
    """The `adaflash` parser. Every command is listed; with `only`, just those commands' flags are
    built (``adaflash --help`` builds none: `train`'s flags import torch)."""
    from .. import __version__

    parser = Parser(
        prog=PROG,
        formatter_class=Formatter,
        description="AdaFlash speculative decoding for Hugging Face transformers: a block-diffusion drafter proposes a\n"
        "block of tokens, the target verifies as many as the adaptive length head asks for, and the output\n"
        "stays exactly the target's own. Run `adaflash COMMAND --help` for each command's flags.",
        epilog="Start with `adaflash demo` (offline, about 10 s on a 2-core CPU).",
    )
    parser.add_argument("--version", action="version", version=f"adaflash-hf {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name in COMMANDS:
        module = _command_module(name)
        built = only is None or name in only
        description = None
        if built:
            description = module.description() if callable(getattr(module, "description", None)) else module.DESCRIPTION
        p = sub.add_parser(name, help=module.HELP, description=description, formatter_class=Formatter)
        if built:
            module.add_arguments(p)
    return parser


def _bootstrap_library() -> None:
    """The package's registrations with transformers (deferred while the CLI only parses its flags)."""
    import adaflash_hf

    adaflash_hf._bootstrap()


def main(argv: list[str] | None = None) -> int:
    """Run `adaflash ARGS`; returns the exit status (2 for a usage error, printed as one line)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        command = next((a for a in argv if not a.startswith("-")), None)
        parser = build_parser(only=(command,) if command in COMMANDS else ())
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # --help / --version
            return int(e.code or 0) if not isinstance(e.code, str) else 2
        if args.command is None:
            parser.print_help()
            return 0
        args._argv = argv[1:]
        _bootstrap_library()
        return _command_module(args.command).run(args)
    except UsageError as e:
        print(e.line(), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `adaflash ... | head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0

