"""`adaflash`: the command line of adaflash-hf (one entry point, one subcommand per job).

    adaflash demo                                   # reference pair: text, tau, verify lengths, speedup, lossless check
    adaflash generate --reference --prompt "Hi" --stats
    adaflash bench --reference --datasets gsm8k --num-prompts 8
    adaflash train --reference --out runs/drafter --device cpu --steps 3 --num-prompts 8 --max-new-tokens 16 --eval-per-domain 0
    adaflash adapt --reference --prompts-file prompts.jsonl --output-dir runs/online
    adaflash serve --port 8000                      # OpenAI-compatible HTTP server (reference pair by default)
    adaflash export runs/drafter runs/drafter-dflash
    adaflash info runs/drafter

Mistakes in what was asked (a missing path, a checkpoint that is not a drafter, a bad flag value, a
missing data file) end with ONE line on stderr, ``adaflash: error: <what> (hint: <what to do>)``,
and exit status 2. Anything else is a bug and keeps its traceback. ``main(argv)`` returns the exit
status instead of exiting, so it can be called in-process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shlex
import sys
import time
from collections import Counter

__all__ = ["UsageError", "build_parser", "inspect_checkpoint", "main", "serving_commands"]

PROG = "adaflash"
LENGTH_POLICIES = ("adaptive", "fixed", "expected_gain")
DEMO_PROMPTS = (
    "Tell me a short story about a cat.",
    "Write a Python function that reverses a string.",
    "What is 12 times 7?",
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_PROMPTS_HINT = 'a .jsonl file with one {"prompt": "..."} or {"messages": [...]} object per line'


# ============================================================================ errors & parsing
class UsageError(Exception):
    """A mistake in what was asked: reported as one line with a hint, exit status 2."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def line(self) -> str:
        text = " ".join(str(self.message).split())
        if self.hint:
            text += f" (hint: {' '.join(str(self.hint).split())})"
        return f"{PROG}: error: {text}"


class _Formatter(argparse.RawDescriptionHelpFormatter):
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


class _Parser(argparse.ArgumentParser):
    """argparse, except that a bad command line raises `UsageError` (one line) instead of printing usage."""

    def error(self, message):
        where = self.prog[len(PROG) :].strip()
        raise UsageError(f"{where}: {message}" if where else message, f"see `{self.prog} --help`")


def _number(cast, ok, expected: str):
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


_positive_int = _number(int, lambda v: v >= 1, "a positive integer")
_nonneg_int = _number(int, lambda v: v >= 0, "an integer >= 0")
_nonneg_float = _number(float, lambda v: v >= 0, "a number >= 0")
_positive_float = _number(float, lambda v: v > 0, "a number > 0")
_probability = _number(float, lambda v: 0 < v <= 1, "a number in (0, 1]")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


# ============================================================================ checkpoints
def _locate(path: str, flag: str) -> bool:
    """True when `path` is a local directory, False for a Hub id; `UsageError` otherwise."""
    if os.path.isdir(path):
        return True
    if os.path.exists(path):
        raise UsageError(f"{flag} {path} is a file, not a checkpoint directory", "pass the folder that holds config.json")
    if _HUB_ID.match(path) and not path.startswith((".", "~")):
        return False
    where = f"{flag}: checkpoint" if flag.startswith("-") else flag
    raise UsageError(f"{where} not found: {path}", "check the path, or pass a Hub id like org/name")


def _read_config(path: str, local: bool, flag: str) -> dict:
    """`config.json` of a local folder or a Hub repository (downloads that one file only)."""
    if local:
        file = os.path.join(path, "config.json")
        if not os.path.isfile(file):
            raise UsageError(f"{flag} {path} has no config.json: not a model checkpoint", "pass the folder a model was saved to")
    else:
        try:
            from huggingface_hub import hf_hub_download

            file = hf_hub_download(path, "config.json")
        except Exception as e:  # noqa: BLE001 - offline, no such repo, gated, ...: all about the id given
            where = f"{flag}: " if flag.startswith("-") else ""
            raise UsageError(
                f"{where}could not fetch config.json of Hub repo {path} ({type(e).__name__})",
                "check the id, network access and HF_TOKEN, or pass a local directory",
            ) from None
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"{flag}: cannot read {file}: {_one_line(e)}", "the checkpoint's config.json must be valid JSON") from None
    if not isinstance(config, dict):
        raise UsageError(f"{flag}: {file} is not a JSON object", "the checkpoint's config.json must be a JSON object")
    return config


def drafter_layout(config: dict) -> str | None:
    """``"native"``, ``"DFlash"`` or ``"AdaFlash"`` for a drafter ``config.json``; None otherwise."""
    from .modeling.checkpoint_layouts import is_dflash_layout

    if config.get("model_type") == "adaflash":
        return "native"
    if is_dflash_layout(config):
        dflash = config.get("dflash_config") or {}
        return "AdaFlash" if dflash.get("use_thresh_head_two_model") else "DFlash"
    return None


def _check_drafter_path(path: str, flag: str = "--drafter") -> tuple[bool, dict, str]:
    local = _locate(path, flag)
    config = _read_config(path, local, flag)
    layout = drafter_layout(config)
    if layout is None:
        raise UsageError(
            f"{flag} {path} is not a drafter checkpoint (config.json has model_type={config.get('model_type')!r} "
            "and no dflash_config)",
            "pass an AdaFlash / DFlash drafter folder; `adaflash info PATH` shows what a checkpoint is",
        )
    return local, config, layout


def _check_target_path(path: str, flag: str = "--target") -> bool:
    local = _locate(path, flag)
    config = _read_config(path, local, flag)
    layout = drafter_layout(config)
    if layout is not None:
        raise UsageError(
            f"{flag} {path} is a drafter checkpoint ({layout} layout), not a target model",
            "pass it as --drafter, and the model it drafts for as --target",
        )
    return local


@contextlib.contextmanager
def _loading(what: str, path: str, hint: str):
    """Turn a failure to load a user-given checkpoint into a `UsageError`."""
    try:
        yield
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"could not load the {what} from {path}: {_one_line(e)}", hint) from None


def _device_dtype(args):
    import torch

    name = getattr(args, "device", "auto") or "auto"
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"unknown device {name!r}", "use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available on this machine", "use --device cpu")
    dtypes = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
              "fp16": torch.float16, "float16": torch.float16}  # fmt: skip
    dname = getattr(args, "dtype", "auto") or "auto"
    if dname == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    elif dname in dtypes:
        dtype = dtypes[dname]
    else:
        raise UsageError(f"unknown dtype {dname!r}", "use auto, fp32, bf16 or fp16")
    threads = getattr(args, "threads", None)
    if threads:
        torch.set_num_threads(threads)
    return device, dtype


def _load_models(args, need_drafter: bool = True):
    """(target, drafter, tokenizer) from ``--reference`` or ``--target`` / ``--drafter`` / ``--tokenizer``."""
    device, dtype = _device_dtype(args)
    if args.reference:
        if args.target or args.drafter:
            raise UsageError("pass either --reference or --target/--drafter, not both", "drop --reference to use your own models")
        from .reference import load_reference_pair

        target, drafter, tok = load_reference_pair(device=device, dtype=dtype)
        if args.tokenizer:
            with _loading("tokenizer", args.tokenizer, "pass a folder or Hub id holding a tokenizer"):
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(args.tokenizer)
        return target, drafter, tok
    if not args.target:
        raise UsageError("no target model given", "pass --target PATH_OR_HUB_ID --drafter PATH_OR_HUB_ID, or --reference")
    if need_drafter and not args.drafter:
        raise UsageError("no drafter given", "pass --drafter PATH_OR_HUB_ID (an AdaFlash or DFlash checkpoint), or --reference")
    _check_target_path(args.target)
    if args.drafter:
        _check_drafter_path(args.drafter)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .modeling import AdaFlashDrafter

    with _loading("target", args.target, "pass a causal LM checkpoint (a folder saved with save_pretrained, or a Hub id)"):
        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(device).eval()
    drafter = None
    if args.drafter:
        with _loading("drafter", args.drafter, "`adaflash info PATH` checks a drafter checkpoint without loading it"):
            drafter = AdaFlashDrafter.from_pretrained(args.drafter, dtype=dtype).to(device).eval()
        with _loading("drafter", args.drafter, "the drafter must be trained for this target (`adaflash info` shows what it fits)"):
            drafter.bind_target(target)
    tok_path = args.tokenizer or args.target
    with _loading("tokenizer", tok_path, "pass --tokenizer PATH_OR_HUB_ID"):
        tok = AutoTokenizer.from_pretrained(tok_path)
    return target, drafter, tok


def _check_policy(drafter, policy: str | None) -> None:
    if policy == "adaptive" and getattr(drafter, "length_head", None) is None:
        raise UsageError(
            "--length-policy adaptive needs a drafter with a length head; this one has none",
            "use --length-policy fixed or expected_gain",
        )


# ============================================================================ prompts
def read_prompts_file(path: str, flag: str = "--prompts-file") -> list[dict]:
    """Records of a prompts jsonl file: ``{"messages": [...], "domain": str | None}`` each."""
    if not os.path.isfile(path):
        raise UsageError(f"{flag}: prompts file not found: {path}", f"pass {_PROMPTS_HINT}")
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"{path}:{lineno}: not valid JSON ({e.msg})", f"the file must be {_PROMPTS_HINT}") from None
            messages = _record_messages(rec)
            if messages is None:
                raise UsageError(f"{path}:{lineno}: no \"prompt\" string or \"messages\" list", f"the file must be {_PROMPTS_HINT}")
            out.append({"messages": messages, "domain": rec.get("domain") if isinstance(rec, dict) else None})
    if not out:
        raise UsageError(f"{flag}: {path} holds no prompts", f"the file must be {_PROMPTS_HINT}")
    return out


def _record_messages(rec) -> list[dict] | None:
    if isinstance(rec, str):
        return [{"role": "user", "content": rec}]
    if not isinstance(rec, dict):
        return None
    msgs = rec.get("messages", rec.get("prompt"))
    if isinstance(msgs, str):
        return [{"role": "user", "content": msgs}]
    if isinstance(msgs, list) and msgs and all(isinstance(m, dict) and "content" in m for m in msgs):
        msgs = [{"role": m.get("role", "user"), "content": m["content"]} for m in msgs]
        if msgs[-1]["role"] == "assistant":  # a full conversation: prompt with what precedes the answer
            msgs = msgs[:-1]
        return msgs or None
    return None


def _encode(tok, messages: list[dict], chat_template: bool = True, system: str | None = None) -> list[int]:
    if system:
        messages = [{"role": "system", "content": system}, *messages]
    if chat_template and getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        text = "\n".join(m["content"] for m in messages)
    ids = tok(text, add_special_tokens=not (chat_template and getattr(tok, "chat_template", None)))["input_ids"]
    if not ids:
        raise UsageError("a prompt encodes to zero tokens", "give a non-empty prompt")
    return list(ids)


def _sampling_kwargs(args) -> dict:
    kw = {"max_new_tokens": args.max_new_tokens}
    if args.temperature > 0:
        kw.update(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    else:
        kw.update(do_sample=False)
    return kw


def _verify_summary(lengths: list[int]) -> str:
    """`k=2: 37, k=1: 3` (rounds per verify length, bonus slot included)."""
    counts = Counter(lengths)
    return ", ".join(f"k={k}: {counts[k]}" for k in sorted(counts)) or "-"


def _tqdm(**kw):
    from tqdm.auto import tqdm

    return tqdm(file=sys.stderr, disable=None, dynamic_ncols=True, **kw)


def _write(text: str = "") -> None:
    from tqdm.auto import tqdm

    tqdm.write(text, file=sys.stdout)


# ============================================================================ demo
def cmd_demo(args) -> int:
    import torch

    from .reference import load_reference_pair

    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    target, drafter, tok = load_reference_pair()
    _check_policy(drafter, args.length_policy)
    policy = args.length_policy or ("adaptive" if drafter.config.use_length_head and drafter.config.length_head_trained else "fixed")
    prompts = args.prompt or list(DEMO_PROMPTS)
    n_target = sum(p.numel() for p in target.parameters())
    n_drafter = sum(p.numel() for p in drafter.parameters())
    print(
        f"AdaFlash demo: embedded reference pair, target Qwen3 {n_target / 1e6:.1f}M params, drafter "
        f"{drafter.config.num_hidden_layers} layers {n_drafter / 1e6:.1f}M params, block {drafter.config.block_size}; "
        f"CPU, float32, {torch.get_num_threads()} thread(s); greedy, max_new_tokens {args.max_new_tokens}, "
        f"length policy {policy}"
    )
    encoded = [torch.tensor([_encode(tok, [{"role": "user", "content": p}])]) for p in prompts]
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    # One short untimed call of each path first: one-time set-up (lazy imports, kernel selection) is not decoding.
    with torch.inference_mode():
        target.generate(encoded[0], max_new_tokens=4, do_sample=False)
        target.generate(encoded[0], assistant_model=drafter, max_new_tokens=4, do_sample=False, length_policy=policy)

    t_plain = t_spec = 0.0
    new_tokens = accepted = rounds = 0
    lengths: list[int] = []
    identical = True
    bar = _tqdm(total=len(prompts), desc="demo", unit="prompt", leave=False)
    for i, (prompt, ids) in enumerate(zip(prompts, encoded), 1):
        with torch.inference_mode():
            t0 = time.perf_counter()
            plain = target.generate(ids, **gen)
            t1 = time.perf_counter()
            out, stats = target.generate(ids, assistant_model=drafter, return_stats=True, length_policy=policy, **gen)
            t2 = time.perf_counter()
        t_plain += t1 - t0
        t_spec += t2 - t1
        same = torch.equal(out, plain)
        identical &= same
        n_new = out.shape[1] - ids.shape[1]
        new_tokens += n_new
        accepted, rounds = accepted + sum(stats.accepted), rounds + stats.rounds
        lengths += stats.verify_lengths
        text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
        shown = " ".join(str(k) for k in stats.verify_lengths[:24]) + (" ..." if stats.rounds > 24 else "")
        _write(f"\n[{i}/{len(prompts)}] {prompt}")
        _write(f"  output: {text!r}")
        _write(f"  {n_new} new tokens in {stats.rounds} verify rounds: tau {stats.tau:.2f}")
        _write(f"  verify lengths chosen (bonus slot included): {shown}  [{_verify_summary(stats.verify_lengths)}]")
        _write(f"  plain {t1 - t0:.2f} s, speculative {t2 - t1:.2f} s; identical to plain greedy: {same}")
        bar.update(1)
    bar.close()

    tau = (accepted + rounds) / rounds if rounds else 0.0
    speedup = t_plain / t_spec if t_spec > 0 else float("nan")
    print()
    print(f"summary: {len(prompts)} prompts, {new_tokens} new tokens, {rounds} verify rounds")
    print(f"  tau (mean tokens committed per verify round): {tau:.2f}")
    print(f"  verify lengths chosen ({policy}): mean {sum(lengths) / max(len(lengths), 1):.2f} of {drafter.config.block_size} "
          f"[{_verify_summary(lengths)}]")
    print(f"  plain greedy decoding: {t_plain:.2f} s ({new_tokens / max(t_plain, 1e-9):.0f} tok/s); "
          f"AdaFlash speculative: {t_spec:.2f} s ({new_tokens / max(t_spec, 1e-9):.0f} tok/s)")
    print(f"  speedup over plain decoding, measured in this run: {speedup:.2f}x")
    if speedup < 1:
        print(f"  (below 1x here: every round costs a drafter forward plus a target verify forward, while this small"
              f" reference drafter commits only {tau:.2f} tokens per round and the tiny CPU target is cheap to run token by"
              f" token; speculative decoding pays when a target step is expensive and tau is high; measure yours with"
              f" `adaflash bench`)")
    print(f"identical: {identical} (speculative output {'equals' if identical else 'DIFFERS from'} plain greedy decoding"
          f" token for token)")
    print(f"demo took {time.perf_counter() - start:.1f} s (after imports)")
    if not identical:
        print(f"{PROG}: demo FAILED: speculative output differs from plain greedy decoding", file=sys.stderr)
        return 1
    return 0


# ============================================================================ generate
def cmd_generate(args) -> int:
    import torch

    from .generation.prompts import left_pad

    if not args.prompt and not args.prompts_file:
        raise UsageError("no prompt given", "pass --prompt TEXT (repeatable) or --prompts-file FILE.jsonl")
    records = [{"messages": [{"role": "user", "content": p}], "domain": None} for p in (args.prompt or [])]
    if args.prompts_file:
        records += read_prompts_file(args.prompts_file)
    if args.output and os.path.isdir(args.output):
        raise UsageError(f"--output {args.output} is a directory", "pass a file name, e.g. out.jsonl")
    target, drafter, tok = _load_models(args, need_drafter=not args.no_drafter)
    if drafter is not None:
        _check_policy(drafter, args.length_policy)
    device = next(target.parameters()).device
    rows = [_encode(tok, r["messages"], not args.no_chat_template, args.system) for r in records]
    pad = tok.pad_token_id if tok.pad_token_id is not None else (target.generation_config.pad_token_id or 0)
    if isinstance(pad, list):
        pad = pad[0]
    gen = _sampling_kwargs(args)
    spec = {}
    if drafter is not None:
        spec = dict(assistant_model=drafter, return_stats=True)
        for key in ("length_policy", "length_rate", "length_min"):
            if getattr(args, key) is not None:
                spec[key] = getattr(args, key)
    out_file = open(args.output, "w", encoding="utf-8") if args.output else None
    all_stats = []
    total_new, total_time = 0, 0.0
    identical = True
    bar = _tqdm(total=len(rows), desc="generate", unit="prompt", leave=False)
    try:
        for b0 in range(0, len(rows), args.batch_size):
            batch = rows[b0 : b0 + args.batch_size]
            ids, mask = left_pad(batch, pad, device)
            torch.manual_seed(args.seed)
            t0 = time.perf_counter()
            with torch.inference_mode():
                res = target.generate(ids, attention_mask=mask, pad_token_id=pad, **gen, **spec)
            elapsed = time.perf_counter() - t0
            out, stats = res if drafter is not None else (res, None)
            ref = None
            if args.check and drafter is not None and not gen["do_sample"]:
                with torch.inference_mode():
                    ref = target.generate(ids, attention_mask=mask, pad_token_id=pad, **gen)
            total_time += elapsed
            for j in range(len(batch)):
                new = out[j, ids.shape[1] :]
                eos = target.generation_config.eos_token_id
                eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
                kept = []
                for t in new.tolist():  # up to the first stop token (a finished row is padded after it)
                    kept.append(t)
                    if t in eos:
                        break
                total_new += len(kept)
                text = tok.decode(kept, skip_special_tokens=True)
                k = b0 + j
                if len(rows) > 1:
                    _write(f"### [{k + 1}/{len(rows)}] {records[k]['messages'][-1]['content']}")
                _write(text)
                record = {"prompt": records[k]["messages"], "response": text}
                if ref is not None:
                    same = torch.equal(out[j], ref[j])
                    identical &= same
                    record["identical_to_plain"] = same
                    if args.stats or not same:
                        _write(f"  identical to plain greedy: {same}")
                if out_file is not None:
                    out_file.write(json.dumps(record) + "\n")
            if stats is not None:
                all_stats.append(stats)
                if args.stats:
                    _write(f"  [stats] rows {b0 + 1}-{b0 + len(batch)}: tau {stats.tau:.2f}, {stats.rounds} rounds, "
                           f"policy {stats.policy}, verify lengths [{_verify_summary(stats.verify_lengths)}], "
                           f"{elapsed:.2f} s")
            bar.update(len(batch))
    finally:
        bar.close()
        if out_file is not None:
            out_file.close()
    if args.stats:
        rounds = sum(s.rounds for s in all_stats)
        accepted = sum(sum(s.accepted) for s in all_stats)
        summary = {"prompts": len(rows), "new_tokens": total_new, "seconds": round(total_time, 3),
                   "tokens_per_s": round(total_new / total_time, 1) if total_time else None}
        if all_stats:
            summary.update(tau=round((accepted + rounds) / rounds, 3) if rounds else None, rounds=rounds,
                           policy=all_stats[0].policy,
                           mean_verify_length=round(sum(sum(s.verify_lengths) for s in all_stats) / max(rounds, 1), 3))
        print("[stats] " + json.dumps(summary), file=sys.stderr)
    if args.output:
        print(f"wrote {args.output}", file=sys.stderr)
    if not identical:
        print(f"{PROG}: generate: speculative output differs from plain greedy decoding", file=sys.stderr)
        return 1
    return 0


# ============================================================================ bench
def cmd_bench(args) -> int:
    from . import bench
    from .training import data as D

    if args.reference and (args.target or args.drafter):
        raise UsageError("pass either --reference or --target/--drafter, not both", "drop --reference to use your own models")
    if not args.reference:
        if not args.target:
            raise UsageError("no target model given", "pass --target PATH_OR_HUB_ID --drafter PATH_OR_HUB_ID, or --reference")
        _check_target_path(args.target)
        if args.drafter:
            _check_drafter_path(args.drafter)
    if args.assistant:
        _check_target_path(args.assistant, "--assistant")
    unknown = [m for m in args.methods if m not in bench.METHODS]
    if unknown or not args.methods:
        raise UsageError(f"--methods: unknown method(s) {', '.join(unknown) or '(none given)'}",
                         f"choose from {', '.join(bench.METHODS)}")
    for flag, value in (("--num-prompts", args.num_prompts), ("--max-new-tokens", args.max_new_tokens)):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}", f"see `{PROG} bench --help`")
    if not args.concurrency or min(args.concurrency) < 1:
        raise UsageError(f"--concurrency must list batch sizes >= 1, got {args.concurrency}", "e.g. --concurrency 1,4,16")
    if not args.datasets:
        raise UsageError("--datasets is empty", "e.g. --datasets gsm8k,mathqa")
    named = []
    for spec in args.datasets:
        if spec.startswith("jsonl:"):
            if not os.path.isfile(spec[len("jsonl:") :]):
                raise UsageError(f"--datasets: prompts file not found: {spec[len('jsonl:'):]}", f"pass jsonl:{_PROMPTS_HINT}")
        elif spec.lower() in D.EVAL_DATASETS or spec.lower().startswith("eagle_bench:"):
            named.append(spec)
        else:
            raise UsageError(f"--datasets: unknown dataset {spec!r}", f"choose from {', '.join(D.EVAL_DATASETS)} or jsonl:PATH")
    if named:
        try:
            D.data_dir(args.data_dir)
        except FileNotFoundError as e:
            raise UsageError(_one_line(e), f"pass --data-dir DIR or set {D.ENV_VAR}") from None
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    args.command = shlex.join([PROG, "bench", *args._argv])
    return bench.run_from_args(args)


# ============================================================================ train


def cmd_train(a: argparse.Namespace) -> int:
    from .training import data as D
    from .training import train_drafter

    prog = f"{PROG} train"
    if a.reference:
        if a.target:
            raise UsageError("pass either --reference or --target, not both", "drop one of them")
        from .reference import REFERENCE_DIR

        a.target = os.path.join(REFERENCE_DIR, "target")
    if not a.target:
        raise UsageError("train: the following arguments are required: --target", "or pass --reference")
    _check_target_path(a.target)
    if a.tokenizer:
        _locate(a.tokenizer, "--tokenizer")
    if os.path.isfile(a.out):
        raise UsageError(f"--out {a.out} is a file", "pass a directory for the drafter checkpoint and logs")
    domains = [d.strip() for d in a.domains.split(",") if d.strip()]
    eval_domains = [d.strip() for d in a.eval_domains.split(",") if d.strip()]
    for flag, names in (("--domains", domains), ("--eval-domains", eval_domains)):
        bad = [d for d in names if d not in D.TRAIN_DOMAINS]
        if bad or (flag == "--domains" and not names):
            raise UsageError(f"{flag}: unknown domain(s) {', '.join(bad) or '(none given)'}", f"choose from {', '.join(D.TRAIN_DOMAINS)}")
    for flag, value, low in (("--num-prompts", a.num_prompts, 1), ("--max-new-tokens", a.max_new_tokens, 1),
                             ("--batch-size", a.batch_size, 1), ("--num-layers", a.num_layers, 1),
                             ("--block-size", a.block_size, 2), ("--eval-per-domain", a.eval_per_domain, 0)):
        if value < low:
            raise UsageError(f"{flag} must be >= {low}, got {value}", f"see `{prog} --help`")
    if a.steps is not None and a.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {a.steps}", "leave it out to train for --minutes instead")
    if not a.minutes > 0:
        raise UsageError(f"--minutes must be > 0, got {a.minutes}", f"see `{prog} --help`")
    cached = a.regen_cache is not None and os.path.isfile(a.regen_cache)
    if a.regen_only and a.regen_cache is None:
        raise UsageError("--regen-only needs --regen-cache FILE", "the regenerated samples are written there")
    if not cached or a.eval_per_domain > 0:
        try:
            D.data_dir(a.data)
        except FileNotFoundError as e:
            raise UsageError(_one_line(e), f"pass --data DIR or set {D.ENV_VAR}") from None
    try:
        return train_drafter.run(train_drafter.config_from_args(a))
    except train_drafter.RecipeError as e:  # train_drafter stops on user-fixable problems with a message
        raise UsageError(f"train: {e}", f"see `{prog} --help`") from None


# ============================================================================ adapt
def cmd_adapt(args) -> int:
    import torch

    from .online import OnlineAdapter, list_versions

    records = read_prompts_file(args.prompts_file)
    if args.max_prompts:
        records = records[: args.max_prompts]
    if os.path.isfile(args.output_dir):
        raise UsageError(f"--output-dir {args.output_dir} is a file", "pass a directory for the numbered versions")
    if args.hub_repo and not _HUB_ID.match(args.hub_repo):
        raise UsageError(f"--hub-repo {args.hub_repo!r} is not a Hub repository id", "use the form org/name")
    target, drafter, tok = _load_models(args)
    _check_policy(drafter, args.length_policy)
    device = next(target.parameters()).device
    gen = _sampling_kwargs(args)
    spec = {"length_policy": args.length_policy} if args.length_policy else {}
    target_name = "reference target (adaflash_hf.reference)" if args.reference else args.target
    adapter = OnlineAdapter(
        drafter, target, method=args.method, sample_unit=args.sample_unit, samples_per_update=args.samples_per_update, epochs=args.epochs,
        batch_size=args.train_batch_size, lr=args.lr, head_lr=args.head_lr, output_dir=args.output_dir,
        keep_versions=args.keep_versions, hub_repo=args.hub_repo, version_layout=args.layout,
        target_name=target_name, hub_private=True if args.hub_private else None, seed=args.seed,
    )  # fmt: skip
    print(f"online adaptation ({args.method}) over {len(records)} prompts from {args.prompts_file}: an update every "
          f"{args.samples_per_update} {'finished requests' if args.sample_unit == 'request' else 'verified rounds'}, versions in {args.output_dir}"
          + (f", pushed to https://huggingface.co/{args.hub_repo}" if args.hub_repo else ""))
    adapter.attach()
    served_tokens, start = 0, time.perf_counter()
    bar = _tqdm(total=len(records), desc="adapt", unit="prompt")
    try:
        for rec in records:
            adapter.set_domain(rec.get("domain"))
            ids = torch.tensor([_encode(tok, rec["messages"], not args.no_chat_template)], device=device)
            torch.manual_seed(args.seed)
            with torch.inference_mode():
                out = target.generate(ids, assistant_model=drafter, **gen, **spec)
            served_tokens += out.shape[1] - ids.shape[1]
            if args.wait:
                adapter.wait_for_update()
            st = adapter.stats
            tau = st["tau_since_update"]
            bar.set_postfix(updates=st["updates"], tau="-" if tau is None else f"{tau:.2f}", refresh=False)
            bar.update(1)
    finally:
        bar.close()
        adapter.close(flush=args.flush, timeout=args.timeout)
    stats = adapter.stats
    elapsed = time.perf_counter() - start
    print(f"\nserved {len(records)} prompts ({served_tokens} tokens, {stats['rounds_seen']} verify rounds) in {elapsed:.1f} s; "
          f"{stats['updates']} update(s), {stats['failures']} failed")
    if stats["history"]:
        print("\n| update | version | samples | loss first -> last | tau before | tau after (rounds) |")
        print("|---|---|---|---|---|---|")
        fmt = lambda x, d=3: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
        for h in stats["history"]:
            print(f"| {h['update']} | {h['version'] if h['version'] is not None else '-'} | {h['samples']} | "
                  f"{fmt(h['loss_first'])} -> {fmt(h['loss_last'])} | {fmt(h['tau_before'], 2)} | "
                  f"{fmt(h['tau_after'], 2)} ({h['rounds_after']}) |")
        print("\ntau before: mean tokens per round served with the previous weights; tau after: with this update's weights.")
    elif args.method == "off":
        tau = stats["tau_since_update"]
        print(f"--method off: no training; tau over the stream {'-' if tau is None else f'{tau:.2f}'}")
    else:
        print(f"no update ran: {stats['rounds_seen']} rounds served, {args.samples_per_update} needed per update "
              "(pass --flush to train on a partial buffer, or lower --samples-per-update)")
    versions = list_versions(args.output_dir) if os.path.isdir(args.output_dir) else []
    if versions:
        print(f"versions on disk: {', '.join(p.name for _, p in versions)} (newest: {versions[-1][1]})")
    if stats["hub"] is not None:
        print(f"hub: {json.dumps(stats['hub'], default=str)}")
    if stats["last_error"]:
        print(f"last update error: {stats['last_error']}", file=sys.stderr)
    return 0


# ============================================================================ serve
def cmd_serve(args) -> int:
    import logging
    import signal
    import threading

    if args.reference and (args.target or args.drafter):
        raise UsageError("pass either --reference or --target/--drafter, not both", "drop --reference to use your own models")
    if args.drafter and not args.target:
        raise UsageError("--drafter given without --target", "pass --target PATH_OR_HUB_ID (the model the drafter is for)")
    if not args.target:
        args.reference = True  # the embedded reference pair
    need_drafter = args.verify_mode != "off"
    if args.target and need_drafter and not args.drafter:
        raise UsageError("no drafter given", "pass --drafter PATH_OR_HUB_ID, or --verify-mode off to serve the target alone")
    if args.target:
        _check_target_path(args.target)
        if args.drafter:
            _check_drafter_path(args.drafter)

    from .engine import Engine
    from .engine.serve.server import CompletionService, OpenAIServer

    try:  # bind first: a port in use fails at once, before models load
        server = OpenAIServer((args.host, args.port))
    except OSError as e:
        raise UsageError(f"cannot listen on {args.host}:{args.port}: {e.strerror or _one_line(e)}",
                         "pick another --port (0 picks a free one) or --host") from None
    def on_sigterm(signum, frame):  # stop like Ctrl-C (containers and process managers send SIGTERM)
        raise KeyboardInterrupt

    old_sigterm = None
    if threading.current_thread() is threading.main_thread():
        old_sigterm = signal.signal(signal.SIGTERM, on_sigterm)
    logger = logging.getLogger("adaflash_hf.server")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    try:
        target, drafter, tok = _load_models(args, need_drafter=need_drafter)
        cfg = target.config.get_text_config(decoder=True)
        max_len = args.max_len or min(2048, getattr(cfg, "max_position_embeddings", None) or 2048)
        token_budget = args.token_budget or max_len
        try:
            engine = Engine(target, drafter if need_drafter else None, verify_mode=args.verify_mode,
                            max_slots=args.max_slots, max_len=max_len, token_budget=token_budget,
                            decode_steps=args.decode_steps)
        except ValueError as e:
            raise UsageError(f"cannot serve this model: {_one_line(e)}", "the engine drives Qwen3 / Llama-family targets") from None
        name = args.model_name or ("adaflash-reference" if args.reference else args.target.rstrip("/"))
        server.service = CompletionService(engine, tok, name, min(args.default_max_tokens, max_len - 1))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        print(f"{PROG} serve: model {name!r} at {server.url}/v1 (verify mode {args.verify_mode}, {args.max_slots} slots, "
              f"max_len {max_len}, token budget {token_budget}); endpoints /v1/completions, /v1/chat/completions, "
              f"/v1/models, /health; Ctrl-C stops", flush=True)
        server.serve_forever()
    except KeyboardInterrupt:
        print(f"{PROG} serve: stopping", file=sys.stderr)
    finally:
        server.close()
        logger.removeHandler(handler)
        if old_sigterm is not None:
            signal.signal(signal.SIGTERM, old_sigterm)
    return 0


# ============================================================================ export
def serving_commands(draft_path: str, target: str | None = None, block_size: int = 16, tp: int = 1) -> dict[str, str]:
    """Command lines that serve `target` with the exported drafter in SGLang and vLLM."""
    target = target or "<target-model>"
    draft = shlex.quote(str(draft_path))
    cfg = json.dumps({"method": "dflash", "model": str(draft_path), "num_speculative_tokens": block_size - 1})
    return {
        "sglang": (
            f"python -m sglang.launch_server --model-path {shlex.quote(target)} --speculative-algorithm DFLASH "
            f"--speculative-draft-model-path {draft} --speculative-num-draft-tokens {block_size} --tp-size {tp}"
        ),
        "vllm": f"vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(cfg)} --tensor-parallel-size {tp}",
    }


def cmd_export(args) -> int:
    import torch

    from .export import export_dflash
    from .modeling import AdaFlashDrafter

    out = os.path.abspath(args.output)
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"output {args.output} is a file", "choose a new directory; export never overwrites")
    if os.path.isdir(out) and os.listdir(out):
        raise UsageError(f"output directory {args.output} exists and is not empty", "choose a new directory; export never overwrites")
    _, _, layout = _check_drafter_path(args.drafter, "drafter checkpoint")
    dtypes = {"keep": "auto", "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    with _loading("drafter", args.drafter, "`adaflash info PATH` checks a drafter checkpoint without loading it"):
        drafter = AdaFlashDrafter.from_pretrained(args.drafter, dtype=dtypes[args.dtype])
    export_dflash(drafter, out)
    cfg = drafter.config
    written = "AdaFlash (DFlash + length head as thresh_head_two_model.*; the engines ignore the head)" if cfg.use_length_head else "DFlash"
    n_params = sum(p.numel() for p in drafter.parameters())
    print(f"exported {args.drafter} ({layout} layout) -> {out}")
    print(f"  layout {written}; {n_params / 1e6:.2f}M params, {next(drafter.parameters()).dtype}".replace("torch.", ""))
    print(f"  fits a target with {cfg.num_target_layers} layers, hidden size {cfg.hidden_size}, vocab {cfg.vocab_size}; "
          f"target_layer_ids {list(cfg.target_layer_ids)}, block {cfg.block_size}, mask token id {cfg.mask_token_id}")
    cmds = serving_commands(out, args.target, cfg.block_size, args.tp)
    print("\nSGLang:\n  " + cmds["sglang"])
    print("\nvLLM:\n  " + cmds["vllm"])
    if not args.target:
        print("\n(replace <target-model> with the model this drafter was trained for; --target NAME fills it in)")
    return 0


# ============================================================================ info
def _tensor_headers_local(path: str) -> tuple[dict, list[str]]:
    from safetensors import safe_open

    from .modeling.checkpoint_layouts import weight_files

    files = weight_files(path, {})
    tensors = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                tensors[name] = (tuple(sl.get_shape()), str(sl.get_dtype()))
    return tensors, [os.path.basename(f) for f in files]


def _tensor_headers_hub(repo: str) -> tuple[dict, list[str]]:
    from huggingface_hub import HfApi

    meta = HfApi().get_safetensors_metadata(repo)
    tensors = {}
    for fm in meta.files_metadata.values():
        for name, info in fm.tensors.items():
            tensors[name] = (tuple(info.shape), str(info.dtype))
    return tensors, sorted(meta.files_metadata)


def inspect_checkpoint(path: str) -> dict:
    """What a drafter checkpoint is, from `config.json` and safetensors headers only (no weights read).

    Raises `UsageError` when `path` is missing or not a drafter checkpoint.
    """
    from .modeling import AdaFlashConfig, AdaFlashDrafter
    from .modeling.checkpoint_layouts import (
        NATIVE_HEAD_PREFIX,
        RELEASED_HEAD_PREFIX,
        check_tensors,
        config_from_dflash_dict,
        expected_shapes,
        to_native_keys,
    )

    local, raw, layout = _check_drafter_path(path, "checkpoint")
    try:
        if layout == "native":
            config = AdaFlashConfig.from_dict(raw)
        else:
            config = config_from_dflash_dict(raw)
    except (ValueError, KeyError, TypeError) as e:
        raise UsageError(f"{path}: invalid drafter config.json: {_one_line(e)}", "the checkpoint's config.json is damaged") from None
    expected = expected_shapes(AdaFlashDrafter, config)
    weights: dict = {"files": [], "status": None}
    try:
        tensors, files = _tensor_headers_local(path) if local else _tensor_headers_hub(path)
        weights["files"] = files
    except Exception as e:  # noqa: BLE001 - missing / pickle-only / unreachable weights: reported, not fatal
        tensors = None
        weights["status"] = f"not readable: {_one_line(e)}"
    if tensors is not None:
        names = to_native_keys(tensors) if layout != "native" else {n: n for n in tensors}
        found = {names[n]: shape for n, (shape, _) in tensors.items()}
        try:
            check_tensors(found, expected, path)
            weights["status"] = "match the config"
        except ValueError as e:
            weights["status"] = _one_line(e)
        weights["dtypes"] = sorted({d for _, d in tensors.values()})
        params = sum(math.prod(s) for s, _ in tensors.values())
        head_in_weights = any(n.startswith((NATIVE_HEAD_PREFIX, RELEASED_HEAD_PREFIX)) for n in tensors)
    else:
        params = sum(math.prod(s) for s in expected.values())
        head_in_weights = None
    has_head = bool(config.use_length_head)
    if layout == "native":
        trained = bool(config.length_head_trained) if has_head else None
    else:
        trained = True if has_head else None  # released AdaFlash heads ship trained; DFlash has none
    return {
        "checkpoint": path,
        "source": "local directory" if local else "Hugging Face Hub",
        "layout": layout,
        "model_type": raw.get("model_type"),
        "architectures": raw.get("architectures"),
        "target": {
            "num_target_layers": config.num_target_layers,
            "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size,
        },
        "target_layer_ids": list(config.target_layer_ids),
        "block_size": config.block_size,
        "mask_token_id": config.mask_token_id,
        "drafter": {
            "num_hidden_layers": config.num_hidden_layers,
            "num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads,
            "head_dim": config.head_dim,
            "intermediate_size": config.intermediate_size,
        },
        "length_head": {
            "present": has_head,
            "in_weights": head_in_weights,
            "trained": trained,
            "dim": config.length_head_dim if has_head else None,
        },
        "parameters": params,
        "parameters_from": "safetensors headers" if tensors is not None else "config (weights not readable)",
        "weights": weights,
        "loads_with": (
            ["AdaFlashDrafter.from_pretrained", "AutoModel (trust_remote_code)" if raw.get("auto_map") else None]
            if layout == "native"
            else ["AdaFlashDrafter.from_pretrained", "SGLang --speculative-algorithm DFLASH", 'vLLM {"method": "dflash"}']
        ),
    }


def _fit_problems(info: dict, target_path: str) -> list[str]:
    local = _locate(target_path, "--target")
    cfg = _read_config(target_path, local, "--target")
    if drafter_layout(cfg) is not None:
        raise UsageError(f"--target {target_path} is a drafter checkpoint, not a target model", "pass the model the drafter is for")
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    t = info["target"]
    problems = []
    for key, theirs in (("num_target_layers", text.get("num_hidden_layers")), ("hidden_size", text.get("hidden_size")),
                        ("vocab_size", text.get("vocab_size"))):
        if theirs != t[key]:
            problems.append(f"{key}: drafter {t[key]}, target {theirs}")
    return problems


def cmd_info(args) -> int:
    info = inspect_checkpoint(args.checkpoint)
    problems = None
    if args.target:
        problems = _fit_problems(info, args.target)
        info["fits"] = {"target": args.target, "ok": not problems, "problems": problems}
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0 if not problems else 1
    t, d, h, w = info["target"], info["drafter"], info["length_head"], info["weights"]
    layout_text = {
        "native": 'native (adaflash-hf, model_type "adaflash")',
        "DFlash": "DFlash (z-lab; SGLang / vLLM read it)",
        "AdaFlash": "AdaFlash (DFlash + length head; SGLang / vLLM read it and ignore the head)",
    }[info["layout"]]
    if h["present"]:
        head = f"present, {'trained' if h['trained'] else 'NOT trained (adaptive policy would guess)'}, dim {h['dim']}"
        if h["in_weights"] is False:
            head += " (but missing from the weights)"
    else:
        head = "absent (use --length-policy fixed or expected_gain)"
    rows = [
        ("checkpoint", f"{info['checkpoint']} ({info['source']})"),
        ("layout", layout_text),
        ("fits target", f"{t['num_target_layers']} layers, hidden size {t['hidden_size']}, vocab {t['vocab_size']}"),
        ("target_layer_ids", f"{info['target_layer_ids']} (K={len(info['target_layer_ids'])} target layers read)"),
        ("block_size", f"{info['block_size']} (up to {info['block_size'] - 1} draft tokens per round)"),
        ("mask_token_id", str(info["mask_token_id"])),
        ("drafter", f"{d['num_hidden_layers']} layers, {d['num_attention_heads']} heads / {d['num_key_value_heads']} KV heads, "
                    f"head_dim {d['head_dim']}, intermediate {d['intermediate_size']}"),
        ("length head", head),
        ("parameters", f"{info['parameters']:,} (from {info['parameters_from']})"),
        ("weights", f"{w['status']}" + (f"; {', '.join(w['files'])}, {'/'.join(w.get('dtypes', []))}" if w["files"] else "")),
        ("loads with", ", ".join(x for x in info["loads_with"] if x)),
    ]
    if info["layout"] == "native":
        rows.append(("serving", f"SGLang / vLLM need the DFlash layout: {PROG} export {shlex.quote(args.checkpoint)} OUT_DIR"))
    if problems is not None:
        rows.append(("fits --target", "yes" if not problems else "NO: " + "; ".join(problems)))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0 if not problems else 1


# ============================================================================ parser
def _add_model_args(p, drafter: bool = True):
    g = p.add_argument_group("models")
    g.add_argument("--reference", action="store_true", help="use the embedded reference pair (no download, no paths)")
    g.add_argument("--target", help="target causal LM: local folder or Hub id")
    if drafter:
        g.add_argument("--drafter", help="AdaFlash / DFlash drafter for the target: local folder or Hub id")
    g.add_argument("--tokenizer", help="tokenizer folder or Hub id (default: the target's)")
    g = p.add_argument_group("runtime")
    g.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda, cuda:N")
    g.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16", "fp16"), help="auto: bf16 on CUDA, fp32 on CPU")
    g.add_argument("--threads", type=_positive_int, help="CPU threads for torch (small models are often fastest with 1)")


def _add_sampling_args(p, max_new_tokens: int):
    g = p.add_argument_group("decoding")
    g.add_argument("--max-new-tokens", type=_positive_int, default=max_new_tokens, help="tokens generated per prompt at most")
    g.add_argument("--temperature", type=_nonneg_float, default=0.0, help="0 = greedy; > 0 samples (output distribution stays the target's)")
    g.add_argument("--top-p", type=_probability, default=1.0, help="nucleus sampling (with --temperature > 0)")
    g.add_argument("--top-k", type=_nonneg_int, default=0, help="top-k sampling, 0 = off (with --temperature > 0)")
    g.add_argument("--seed", type=int, default=0, help="torch seed set before each generate call (sampling)")
    g.add_argument("--length-policy", choices=LENGTH_POLICIES, default=None,
                   help="verify length per round: adaptive (length head), fixed (full block, DFlash), expected_gain "
                        "(default: adaptive when the drafter has a trained length head, else fixed)")
    g.add_argument("--no-chat-template", action="store_true", help="feed prompt text as is instead of through the chat template")
    return g


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = _Parser(
        prog=PROG,
        formatter_class=_Formatter,
        description="AdaFlash speculative decoding for Hugging Face transformers: a block-diffusion drafter proposes a\n"
        "block of tokens, the target verifies as many as the adaptive length head asks for, and the output\n"
        "stays exactly the target's own. Run `adaflash COMMAND --help` for each command's flags.",
        epilog="Start with `adaflash demo` (offline, about 10 s on a 2-core CPU).",
    )
    parser.add_argument("--version", action="version", version=f"adaflash-hf {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")

    def add(name, help_, description, **kw):
        return sub.add_parser(name, help=help_, description=description, formatter_class=_Formatter, **kw)

    # ---- demo
    p = add("demo", "generate with the embedded reference pair; print text, tau, verify lengths, speedup, lossless check",
            "Generate answers to a few short prompts with the embedded reference pair (a 12.6M-parameter Qwen3\n"
            "target and its AdaFlash drafter), twice: plain greedy decoding and AdaFlash speculative decoding,\n"
            "timed in the same run. Prints the text, tau (mean tokens committed per verify round), the verify\n"
            "lengths the policy chose, the measured speedup (honestly: on CPU it is usually below 1x), and\n"
            "whether the speculative output equals plain greedy token for token (exit status 1 if not).\n"
            "Offline; about 10 s on a 2-core CPU.")
    p.add_argument("--max-new-tokens", type=_positive_int, default=64, help="tokens generated per prompt")
    p.add_argument("--prompt", action="append", help="a prompt of your own (repeatable; default: three built-in prompts)")
    p.add_argument("--length-policy", choices=LENGTH_POLICIES, default=None, help="default: adaptive (the drafter's trained length head)")
    p.add_argument("--threads", type=_positive_int, default=1, help="CPU threads (1 is fastest for this tiny pair)")
    p.set_defaults(func=cmd_demo)

    # ---- generate
    p = add("generate", "generate text with a target + drafter (or --reference), optionally with per-round statistics",
            "Generate with speculative decoding: target.generate(..., assistant_model=drafter). Prompts come from\n"
            "--prompt (repeatable) and/or --prompts-file (jsonl, one {\"prompt\": ...} or {\"messages\": [...]}\n"
            "per line), go through the tokenizer's chat template unless --no-chat-template, and are decoded\n"
            "--batch-size at a time (left padded). Greedy by default; --temperature > 0 samples losslessly.\n\n"
            "example:\n  adaflash generate --reference --prompt 'What is 2+2?' --stats --check")
    _add_model_args(p)
    g = p.add_argument_group("prompts")
    g.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    g.add_argument("--prompts-file", help=f"prompts: {_PROMPTS_HINT}")
    g.add_argument("--system", help="system message prepended to every prompt")
    g = _add_sampling_args(p, 128)
    g.add_argument("--length-rate", type=_positive_float, default=None, help="adaptive policy: scale of k_hat = round(a*B*rate)")
    g.add_argument("--length-min", type=_positive_int, default=None, help="smallest verify length (bonus slot included)")
    g.add_argument("--batch-size", type=_positive_int, default=1, help="prompts decoded together")
    g.add_argument("--no-drafter", action="store_true", help="plain decoding with the target only (for comparison)")
    g = p.add_argument_group("output")
    g.add_argument("--stats", action="store_true", help="print tau, rounds and chosen verify lengths per batch, and a JSON summary")
    g.add_argument("--check", action="store_true", help="also decode plainly and report whether the outputs are identical (greedy only)")
    g.add_argument("--output", help="also write {prompt, response} records to this jsonl file")
    p.set_defaults(func=cmd_generate)

    # ---- bench
    from . import bench

    p = add("bench", "benchmark decoding methods side by side (tok/s, speedup, tau), checked for correctness",
            (bench.__doc__ or "").split("\n\n")[0] + "\n\nexample:\n  adaflash bench --reference --datasets gsm8k --num-prompts 4 "
            "--max-new-tokens 64 --methods plain,fixed,adaptive --out runs/bench")
    bench.add_arguments(p)
    p.add_argument("--threads", type=_positive_int, help="CPU threads for torch (small models are often fastest with 1)")
    p.set_defaults(func=cmd_bench)

    # ---- train (the flags of adaflash_hf.training.train_drafter)
    from .training import train_drafter

    p = add("train", "train a drafter offline on the target's own answers (DFlash recipe, transformers Trainer)",
            "Offline drafter training: regenerate answers with the target, train a fresh drafter with DrafterTrainer,\n"
            "save it in the native layout (same flags as `python -m adaflash_hf.training.train_drafter`).\n\n"
            "example:\n  adaflash train --reference --out runs/drafter --domains chat,prose --minutes 5")
    train_drafter.add_arguments(p, require_target=False)
    p.add_argument("--reference", action="store_true", help="train for the embedded reference target")
    p.set_defaults(func=cmd_train)

    # ---- adapt
    p = add("adapt", "online adaptation: serve a jsonl stream of prompts with an OnlineAdapter attached, write versions",
            "Serve every prompt of --prompts-file with speculative decoding while an OnlineAdapter distils the\n"
            "drafter from the target's verification feedback (OPD; OSD as a baseline) in a background thread.\n"
            "Every update is swapped in between rounds and written atomically as a numbered version\n"
            "(--output-dir/v00001, ..., LATEST), and pushed to the Hub when --hub-repo is given (credentials from\n"
            "HF_TOKEN or `hf auth login`). Output stays identical to the target's; tau per update is printed at\n"
            "the end.\n\nexample:\n  adaflash adapt --reference --prompts-file prompts.jsonl --output-dir runs/online --samples-per-update 64")
    _add_model_args(p)
    g = p.add_argument_group("stream")
    g.add_argument("--prompts-file", required=True, help=f"the prompt stream: {_PROMPTS_HINT} (optional \"domain\" tags)")
    g.add_argument("--max-prompts", type=_positive_int, help="serve only the first N prompts")
    _add_sampling_args(p, 128)
    g = p.add_argument_group("adaptation")
    g.add_argument("--output-dir", required=True, help="where the numbered versions are written")
    g.add_argument("--hub-repo", help="also push every version to this Hub model repo (org/name)")
    g.add_argument("--hub-private", action="store_true", help="create the Hub repo as private")
    g.add_argument("--method", choices=("opd", "osd", "off"), default="opd", help="opd: AdaFlash on-policy distillation; osd: forward-KL baseline; off: measure only")
    g.add_argument("--sample-unit", choices=("request", "round"), default="request",
                   help="what one sample is: a finished request (the paper's unit) or one verified round")
    g.add_argument("--samples-per-update", type=_positive_int, default=128, help="samples buffered per update (paper: 128 requests)")
    g.add_argument("--epochs", type=_positive_int, default=2, help="passes over an update's samples")
    g.add_argument("--train-batch-size", type=_positive_int, default=2, help="samples per optimizer step")
    g.add_argument("--lr", type=_positive_float, default=3e-4, help="drafter learning rate")
    g.add_argument("--head-lr", type=_positive_float, default=2e-4, help="length-head learning rate")
    g.add_argument("--layout", choices=("native", "dflash"), default="native", help="version layout (dflash: what SGLang / vLLM load)")
    g.add_argument("--keep-versions", type=_positive_int, default=3, help="rolling window of versions kept on disk")
    g.add_argument("--wait", action="store_true", help="after each prompt, wait for a triggered update to finish (reproducible)")
    g.add_argument("--flush", action="store_true", help="at the end, also train on the partial buffer")
    g.add_argument("--timeout", type=_positive_float, default=600.0, help="seconds to wait for pending updates / pushes at the end")
    p.set_defaults(func=cmd_adapt)

    # ---- serve
    from .engine import VERIFY_MODES

    p = add("serve", "OpenAI-compatible HTTP server (completions, chat, streaming) over the continuous-batching engine",
            "Serve a target + drafter (default: the embedded reference pair) over HTTP with OpenAI's API:\n"
            "POST /v1/completions, POST /v1/chat/completions (the tokenizer's chat template), GET /v1/models,\n"
            "GET /health. Concurrent requests are decoded together by the continuous-batching engine; fields:\n"
            "max_tokens, temperature (default 1.0, as OpenAI; 0 = greedy), top_p, top_k, seed, stop, stream\n"
            "(server-sent events), usage counts. One log line per request on stderr (no prompt text).\n"
            "Standard library HTTP (no extra dependencies); put a reverse proxy in front for TLS / auth.\n\n"
            "example:\n  adaflash serve --port 8000\n"
            "  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\\n"
            "       -d '{\"prompt\": \"Hello\", \"max_tokens\": 16, \"temperature\": 0}'")
    _add_model_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    g.add_argument("--port", type=_number(int, lambda v: 0 <= v <= 65535, "a port in [0, 65535]"), default=8000,
                   help="TCP port (0: any free port)")
    g.add_argument("--model-name", help="model id reported by /v1/models and required in requests' `model` "
                                        "(default: the --target path, or adaflash-reference)")
    g.add_argument("--default-max-tokens", type=_positive_int, default=256, help="max_tokens of a request that gives none (capped at what fits after its prompt)")
    g = p.add_argument_group("engine")
    g.add_argument("--verify-mode", choices=VERIFY_MODES, default="packed",
                   help="packed: each request its own verify length; rectangular; fixed (full block); off (no drafter)")
    g.add_argument("--max-slots", type=_positive_int, default=16, help="requests decoded concurrently (KV slots)")
    g.add_argument("--max-len", type=_number(int, lambda v: v >= 2, "an integer >= 2"), default=None,
                   help="positions per request, prompt + completion (default: min(2048, the target's max positions))")
    g.add_argument("--token-budget", type=_positive_int, default=None,
                   help="most tokens in one target forward; also the longest prompt (default: --max-len)")
    g.add_argument("--decode-steps", type=_positive_int, default=8,
                   help="--verify-mode off on CUDA: greedy decode steps per graph replay while no request waits "
                        "(streaming then arrives in groups of up to this many tokens; 1: one at a time)")
    p.set_defaults(func=cmd_serve)

    # ---- export
    p = add("export", "write a drafter in the DFlash (z-lab) layout that SGLang and vLLM load; print their commands",
            "Convert a drafter checkpoint (any layout) into the z-lab DFlash layout read by SGLang\n"
            "(--speculative-algorithm DFLASH) and vLLM ({\"method\": \"dflash\"}) for multi-GPU serving; a length\n"
            "head is kept under the released AdaFlash names (the engines ignore it). Atomic; never overwrites.\n\n"
            "example:\n  adaflash export runs/drafter runs/drafter-dflash --target Qwen/Qwen3-8B --tp 2")
    p.add_argument("drafter", help="drafter checkpoint: local folder or Hub id")
    p.add_argument("output", help="new (or empty) output directory")
    p.add_argument("--dtype", choices=("keep", "bf16", "fp16", "fp32"), default="keep", help="weight dtype of the export")
    p.add_argument("--target", help="target model path / Hub id, to fill in the printed serving commands")
    p.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel size for the printed commands")
    p.set_defaults(func=cmd_export)

    # ---- info
    p = add("info", "inspect a drafter checkpoint (layout, target it fits, layer ids, head) without loading weights",
            "Inspect a drafter checkpoint folder or Hub id from its config.json and safetensors headers only (no\n"
            "weights are read): its layout (native / DFlash / AdaFlash), the target it fits (layers, hidden size,\n"
            "vocab), target_layer_ids, block size, mask token id, length head present / trained, parameter\n"
            "count, and whether the tensors match the config. --target also checks the fit against a target.\n\n"
            "example:\n  adaflash info z-lab/Qwen3-8B-DFlash-b16\n  adaflash info runs/drafter --target Qwen/Qwen3-8B --json")
    p.add_argument("checkpoint", help="drafter checkpoint: local folder or Hub id")
    p.add_argument("--target", help="also check that the drafter fits this target (its config.json only)")
    p.add_argument("--json", action="store_true", help="print the facts as JSON")
    p.set_defaults(func=cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run `adaflash ARGS`; returns the exit status (2 for a usage error, printed as one line)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # --help / --version
            return int(e.code or 0) if not isinstance(e.code, str) else 2
        if args.command is None:
            parser.print_help()
            return 0
        args._argv = argv[1:]
        return args.func(args)
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


if __name__ == "__main__":
    sys.exit(main())
