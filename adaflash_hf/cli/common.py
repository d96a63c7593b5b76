"""What every `adaflash` command shares: the argparse formatter and parser, value types, the model /
runtime / decoding flag groups, loading the models a command names, encoding prompts, progress output.

No torch or transformers at module level: building the parser (``--help``) must stay fast.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import Counter

from ..loading import (
    PROMPTS_HINT, SMALL_MODEL_PARAMS, UsageError, load_models, read_jsonl, record_messages, resolve_device_dtype,
)  # fmt: skip

PROG = "adaflash"
from ..speculation.length.names import HEAD_POLICIES, POLICY_NAMES

THREADS_HELP = f"CPU threads for torch (default: 1 on the CPU for models under {SMALL_MODEL_PARAMS // 10**6}M parameters, else torch's)"


# ============================================================================ parsing
class Formatter(argparse.RawDescriptionHelpFormatter):
    """Keeps description line breaks; appends "(default: X)" where a default says something."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (
            "%(default)" not in text
            and default is not None
            and default is not False
            and default is not argparse.SUPPRESS
            and action.option_strings
            and action.nargs != 0
        ):
            text += " (default: %(default)s)"
        return text


class Parser(argparse.ArgumentParser):
    """argparse, except that a bad command line raises `UsageError` (one line) instead of printing usage."""

    def error(self, message):
        where = self.prog[len(PROG) :].strip()
        raise UsageError(f"{where}: {message}" if where else message, f"see `{self.prog} --help`")


def number(cast, ok, expected: str):
    """An argparse `type` that parses with `cast` and accepts values where `ok(value)` holds."""

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


positive_int = number(int, lambda v: v >= 1, "a positive integer")
nonneg_int = number(int, lambda v: v >= 0, "an integer >= 0")
nonneg_float = number(float, lambda v: v >= 0, "a number >= 0")
positive_float = number(float, lambda v: v > 0, "a number > 0")
probability = number(float, lambda v: 0 < v <= 1, "a number in (0, 1]")


def add_model_args(p, drafter: bool = True) -> None:
    g = p.add_argument_group("models")
    g.add_argument("--reference", action="store_true", help="use the embedded reference pair (no download, no paths)")
    g.add_argument("--target", help="target causal LM: local folder or Hub id")
    if drafter:
        g.add_argument("--drafter", help="AdaFlash / DFlash drafter for the target: local folder or Hub id")
    g.add_argument("--tokenizer", help="tokenizer folder or Hub id (default: the target's)")
    g = p.add_argument_group("runtime")
    g.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda, cuda:N")
    g.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16", "fp16"), help="auto: bf16 on CUDA, fp32 on CPU")
    g.add_argument("--threads", type=positive_int, help=THREADS_HELP)


def add_sampling_args(p, max_new_tokens: int):
    g = p.add_argument_group("decoding")
    g.add_argument("--max-new-tokens", type=positive_int, default=max_new_tokens, help="tokens generated per prompt at most")
    g.add_argument("--temperature", type=nonneg_float, default=0.0, help="0 = greedy; > 0 samples (output distribution stays the target's)")
    g.add_argument("--top-p", type=probability, default=1.0, help="nucleus sampling (with --temperature > 0)")
    g.add_argument("--top-k", type=nonneg_int, default=0, help="top-k sampling, 0 = off (with --temperature > 0)")
    g.add_argument("--seed", type=int, default=0, help="torch seed set before each generate call (sampling)")
    g.add_argument("--length-policy", choices=POLICY_NAMES, default=None,
                   help="verify length per round: cost (length head, each round's lengths weighed against what a verify "
                        "costs at that batch), adaptive (length head, the paper's floor rule), fixed (full block, DFlash), "
                        "expected_gain (default: cost when the drafter has a trained length head, else fixed)")
    g.add_argument("--no-chat-template", action="store_true", help="feed prompt text as is instead of through the chat template")
    return g


def check_either_reference(args) -> None:
    if args.reference and (args.target or getattr(args, "drafter", None)):
        raise UsageError("pass either --reference or --target/--drafter, not both", "drop --reference to use your own models")


# ============================================================================ models & prompts
def load_models_from_args(args, need_drafter: bool = True):
    """(target, drafter, tokenizer) from ``--reference`` or ``--target`` / ``--drafter`` / ``--tokenizer``."""
    device, dtype = resolve_device_dtype(getattr(args, "device", "auto"), getattr(args, "dtype", "auto"))
    check_either_reference(args)
    target, drafter, tok, _ = load_models(
        args.target, args.drafter, args.tokenizer, reference=args.reference, device=device, dtype=dtype,
        need_drafter=need_drafter, threads=getattr(args, "threads", None),
    )
    return target, drafter, tok


def check_policy(drafter, policy: str | None) -> None:
    if policy in [p.value for p in HEAD_POLICIES] and getattr(drafter, "length_head", None) is None:
        raise UsageError(
            f"--length-policy {policy} needs a drafter with a length head; this one has none",
            "use --length-policy fixed or expected_gain",
        )


def read_prompts_file(path: str, flag: str = "--prompts-file") -> list[dict]:
    """Records of a prompts jsonl file: ``{"messages": [...], "domain": str | None}`` each."""
    out = []
    for lineno, rec in read_jsonl(path, flag):
        messages = record_messages(rec)
        if messages is None:
            raise UsageError(f"{path}:{lineno}: no \"prompt\" string or \"messages\" list", f"the file must be {PROMPTS_HINT}")
        out.append({"messages": messages, "domain": rec.get("domain") if isinstance(rec, dict) else None})
    if not out:
        raise UsageError(f"{flag}: {path} holds no prompts", f"the file must be {PROMPTS_HINT}")
    return out


def encode(tok, messages: list[dict], chat_template: bool = True, system: str | None = None) -> list[int]:
    """Prompt ids: through the chat template (`generation.prompts.encode_prompt`), or the messages'
    text joined by newlines with the tokenizer's special tokens when there is no template or it is off."""
    from ..generation.prompts import encode_prompt

    if system:
        messages = [{"role": "system", "content": system}, *messages]
    if chat_template and getattr(tok, "chat_template", None):
        ids = encode_prompt(tok, messages)
    else:
        ids = tok("\n".join(m["content"] for m in messages))["input_ids"]
    if not ids:
        raise UsageError("a prompt encodes to zero tokens", "give a non-empty prompt")
    return list(ids)


def sampling_kwargs(args) -> dict:
    """generate's decoding arguments; `UsageError` for sampling flags given to greedy decoding."""
    kw = {"max_new_tokens": args.max_new_tokens}
    if args.temperature == 0 and (args.top_p != 1.0 or args.top_k != 0):
        raise UsageError("--top-p / --top-k cannot apply to greedy decoding (--temperature 0)", "add --temperature T > 0 to sample")
    if args.temperature > 0:
        kw.update(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    else:
        kw.update(do_sample=False)
    return kw


# ============================================================================ output
def verify_summary(lengths: list[int]) -> str:
    """`k=2: 37, k=1: 3` (rounds per verify length, bonus slot included)."""
    counts = Counter(lengths)
    return ", ".join(f"k={k}: {counts[k]}" for k in sorted(counts)) or "-"


def progress(**kw):
    """A tqdm bar on stderr, off when stderr is not a terminal."""
    from tqdm.auto import tqdm

    return tqdm(file=sys.stderr, disable=None, dynamic_ncols=True, **kw)


def write(text: str = "") -> None:
    """Print a line to stdout without breaking a progress bar."""
    from tqdm.auto import tqdm

    tqdm.write(text, file=sys.stdout)
