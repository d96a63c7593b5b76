"""The `adaflash bench` flags, and running from them (``python -m adaflash_hf.bench`` too).

Torch-free at import: `adaflash bench --help` builds these flags without loading torch.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from .config import DEFAULT_METHODS, METHOD_NAMES, BenchConfig

DESCRIPTION = "`adaflash bench`: every decoding method on the same prompts, side by side, checked for correctness."


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _ints(s: str) -> list[int]:
    return [int(x) for x in _csv(s)]


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the `adaflash bench` flags to `parser` (a subcommand parser or a fresh one)."""
    g = parser.add_argument_group("models")
    g.add_argument("--target", help="target model: local path or Hub id")
    g.add_argument("--drafter", help="AdaFlash / DFlash drafter: local path or Hub id")
    g.add_argument("--tokenizer", help="tokenizer (default: the target's)")
    g.add_argument("--reference", action="store_true", help="use the embedded reference pair (adaflash_hf.reference)")
    g.add_argument("--assistant", help="small autoregressive assistant for hf_assisted")
    g = parser.add_argument_group("workload")
    g.add_argument("--datasets", type=_csv, default=["gsm8k"],
                   help=f"comma list of: {', '.join(dataset_names())}; or jsonl:PATH (one {{\"prompt\": ...}} or "
                   "{\"messages\": [...]} a line). spec_bench_all: MT-bench (both turns) and Spec-Bench's five other "
                   "categories; blend: gsm8k, mathqa, codealpaca and sharegpt mixed; spec_bench:CATEGORY takes any "
                   "category of Spec-Bench's file")
    g.add_argument("--data-dir", help="root of local eval datasets (default: $ADAFLASH_DATA, else the project's shared/data); a named set not found there loads from the Hub through datasets, else from the built-in sample")
    g.add_argument("--split", default="all", choices=("validation", "test", "all"),
                   help="all (default): every record of each named set, as listed; validation / test: that slice, "
                   "training duplicates removed (adaflash_hf.training.splits); bench.json records the counts")
    g.add_argument("--num-prompts", type=int, default=None, help=_default_help("num_prompts"))
    g.add_argument("--max-new-tokens", type=int, default=None, help=_default_help("max_new_tokens"))
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (outputs checked against plain)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--concurrency", type=_ints, default=[1], help="comma list of batch sizes, e.g. 1,4,16")
    g.add_argument(
        "--methods", type=_csv, default=None,
        help=f"comma list from: {', '.join(METHOD_NAMES)} ({_default_help('methods')}). cost and engine_cost are what "
        "generate(assistant_model=drafter) and `adaflash serve` do by default (verify lengths from the length head and a "
        "cost model); fixed verifies whole blocks; *_alone: the drafter without the prompt n-gram rule; *_wide: n-gram "
        "candidates verified up to 31 tokens. prompt_lookup_exact is computed, not timed: prompt lookup's tau from plain's "
        "greedy outputs (exact under greedy, any concurrency); so is prompt_lookup_grid (best of tokens 10/15/20 x n-gram "
        "2/3/4); prompt_lookup_tuned is timed, at the setting chosen on validation (--prompt-lookup-choice)",
    )
    g = parser.add_argument_group("runtime")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    g.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), bf16, fp16, fp32")
    g.add_argument("--attn-implementation", default="sdpa")
    g.add_argument("--warmup", type=int, default=1, help="prompts decoded untimed before each method and concurrency is first timed on a set (the set's longest)")
    g.add_argument("--prompt-lookup-num-tokens", type=int, default=10,
                   help="candidate tokens per round of prompt_lookup and prompt_lookup_exact")
    g.add_argument("--prompt-lookup-choice", metavar="BENCH_JSON",
                   help="a --split validation run's bench.json (with prompt_lookup_grid): each set's best prompt-lookup "
                   "setting, reported by prompt_lookup_grid (computed) and prompt_lookup_tuned (timed)")
    g.add_argument("--length-rate", type=float, default=None,
                   help="adaptive methods: rate of k_hat = floor(a*B*rate) (default: the drafter config's)")
    g.add_argument("--fast-path", action="store_true",
                   help="our loop's methods take the engine's fast path off CUDA too (on CUDA they do by default): "
                        "a CPU run then makes the GPU path's decisions")
    g.add_argument("--reference-concurrency", type=int, default=None, metavar="N",
                   help="without plain among the methods: decode the untimed plain rows greedy outputs are compared "
                        "with N prompts at a time (default: each cell's concurrency); greedy float32 rows do not "
                        "depend on the batch")
    g.add_argument("--halving-batch", type=int, default=None,
                   help="engine methods: scale the rate down with the batch, half at this many requests (default: fixed rate)")
    g = parser.add_argument_group("online methods (osd, adaflash)")
    g.add_argument("--online-sample-unit", default="request", choices=("request", "round"),
                   help="what one online sample is: a finished request (the paper's unit) or one verified round")
    g.add_argument("--online-samples-per-update", type=int, default=128, help="samples that trigger an update")
    g.add_argument("--online-epochs", type=int, default=2, help="passes over each update's samples")
    g.add_argument("--online-lr", type=float, default=3e-4, help="drafter learning rate of the online updates")
    g.add_argument(
        "--online-wait", action=argparse.BooleanOptionalAction, default=True,
        help="wait for each triggered update before serving the next batch (reproducible curves; the wait is timed)",
    )  # fmt: skip
    g = parser.add_argument_group("output")
    g.add_argument("--out", help="output folder for bench.json, bench.md and the plots")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--quiet", action="store_true")
    return parser


# What a flag left out means. `--reference` is a first look that runs in well under a minute on a laptop CPU:
# fewer prompts and tokens, and the methods a newcomer compares (plain, prompt lookup, ours, the engine).
DEFAULTS = {"num_prompts": 8, "max_new_tokens": 128, "methods": list(DEFAULT_METHODS)}
REFERENCE_DEFAULTS = {"num_prompts": 3, "max_new_tokens": 48,
                      "methods": ["plain", "prompt_lookup", "fixed", "cost", "adaptive", "engine_cost"]}  # fmt: skip


def dataset_names() -> list[str]:
    """Every dataset name `--datasets` takes (besides jsonl:PATH): the named sets, the suites, each Spec-Bench
    category of the suite and each EAGLE task."""
    from ..training import data as D

    return [*D.EVAL_DATASETS, *D.SUITES, *(f"spec_bench:{c}" for c in D.SPEC_BENCH_CATEGORIES),
            *(f"eagle_bench:{t}" for t in D.EAGLE_TASKS)]  # fmt: skip


def _default_help(name: str) -> str:
    def show(v):
        return ", ".join(v) if isinstance(v, list) else v

    return f"default: {show(DEFAULTS[name])}; with --reference {show(REFERENCE_DEFAULTS[name])}"


def fill_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Give every flag left out (None) its default: `REFERENCE_DEFAULTS` under ``--reference``."""
    for name, value in (REFERENCE_DEFAULTS if args.reference else DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, list(value) if isinstance(value, list) else value)
    return args


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The `BenchConfig` of parsed `add_arguments` flags."""
    fill_defaults(args)
    return BenchConfig(
        target=args.target, drafter=args.drafter, tokenizer=args.tokenizer, assistant=args.assistant, reference=args.reference,
        datasets=args.datasets, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed, concurrency=args.concurrency,
        methods=args.methods, device=args.device, dtype=args.dtype, threads=getattr(args, "threads", None),
        attn_implementation=args.attn_implementation,
        warmup=args.warmup, prompt_lookup_num_tokens=args.prompt_lookup_num_tokens,
        prompt_lookup_choice=args.prompt_lookup_choice, length_rate=args.length_rate,
        halving_batch=args.halving_batch, fast_path=args.fast_path, reference_concurrency=args.reference_concurrency,
        online_sample_unit=args.online_sample_unit,
        online_samples_per_update=args.online_samples_per_update, online_epochs=args.online_epochs,
        online_lr=args.online_lr, online_wait=args.online_wait, out=args.out, data_dir=args.data_dir, split=args.split,
        command=getattr(args, "command", None), plots=not args.no_plots, verbose=not args.quiet,
    )  # fmt: skip


def run_from_args(args: argparse.Namespace) -> int:
    """Run from parsed `add_arguments` flags; 0 when every check passed, 1 on any failure."""
    from .runner import loud, run_bench

    result = run_bench(config_from_args(args))
    from .report import markdown

    print(markdown(result))
    if result.files:
        print("wrote " + ", ".join(result.files), file=sys.stderr)
    if result.failures:
        loud(f"{len(result.failures)} failure(s): exit status 1")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """`adaflash bench ...` / `python -m adaflash_hf.bench ...`."""
    from .. import _bootstrap  # the package's registrations (deferred under `python -m adaflash_hf.bench`)

    parser = add_arguments(argparse.ArgumentParser(prog="adaflash bench", description=DESCRIPTION))
    args = parser.parse_args(argv)
    args.command = shlex.join(sys.argv) if argv is None else shlex.join(["adaflash", "bench", *argv])
    _bootstrap()
    return run_from_args(args)
