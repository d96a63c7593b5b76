"""The drafter recipe's settings: `DrafterRecipe` and its command-line flags, without torch.

`adaflash train --help` and `python -m adaflash_hf.training.train_drafter --help` build their flags
from here, so printing help imports neither torch nor transformers.

Example:
    >>> import argparse
    >>> recipe = config_from_args(add_arguments(argparse.ArgumentParser()).parse_args(
    ...     ["--target", "t", "--out", "o", "--domains", "math,code"]))
    >>> recipe.domains
    ['math', 'code']
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field, fields

__all__ = ["DrafterRecipe", "add_arguments", "config_from_args"]


def add_arguments(ap: argparse.ArgumentParser, require_target: bool = True) -> argparse.ArgumentParser:
    """The training flags; `adaflash train` mounts them too (with `--reference` as a target shortcut)."""
    ap.add_argument("--target", required=require_target, help="target model folder (tokenizer inside unless --tokenizer)")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--out", required=True, help="output folder for the drafter checkpoint and logs")
    ap.add_argument("--data", default=None, help="shared/data folder (default: $ADAFLASH_DATA or ../shared/data)")
    ap.add_argument("--domains", default="chat,prose", help="training domains, comma separated")
    ap.add_argument("--train-domains", default=None,
                    help="train on the regenerated samples of these domains only (default: all of --domains): drafters "
                         "that each leave a domain out can share one regeneration (--regen-cache)")
    ap.add_argument("--device", default="auto", help="auto | cuda | cpu")
    ap.add_argument("--seed", type=int, default=0)
    # regeneration
    ap.add_argument("--num-prompts", type=int, default=2000, help="prompts to regenerate (all domains)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--gen-batch-size", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy regeneration")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--sampled-answers", type=int, default=0,
                    help="extra answers per prompt of --sampled-domains, sampled at --sampled-temperature: more of the "
                         "target's distribution where prompts are scarce")
    ap.add_argument("--sampled-domains", default="chat")
    ap.add_argument("--sampled-temperature", type=float, default=0.7)
    ap.add_argument("--prose-prefix", type=int, default=32, help="prompt tokens of a prose chunk")
    ap.add_argument("--max-prompt-tokens", type=int, default=384)
    ap.add_argument("--prompts-per-sample", type=int, default=1,
                    help="prompts drawn from each training sample (chat: first user turns; prose: prefixes at offsets)")
    ap.add_argument("--regen-cache", default=None,
                    help="jsonl of regenerated samples: reused if it exists and was made with the same regeneration "
                    "settings (kept in FILE.settings.json; other ones are refused), else written")
    ap.add_argument("--regen-only", action="store_true", help="stop after regeneration (with --regen-cache)")
    # drafter
    ap.add_argument("--init-from", default=None, help="a drafter folder to continue training (the next call of a run cut "
                    "into several): its weights, and its architecture, which the layer flags must match")
    ap.add_argument("--length-head-type", default=None, choices=("released", "paper"),
                    help="the length head's form (default: released; with --init-from, the checkpoint's head is kept "
                    "unless this is given, which starts a fresh head of that form)")
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--target-layer-ids", default=None,
                    help="comma list of target layers feeding the drafter (default: spread evenly, DFlash's rule)")
    ap.add_argument("--mask-token-id", type=int, default=None, help="default: tokenizer.mask_token_id")
    ap.add_argument("--max-anchors", type=int, default=512)
    ap.add_argument("--block-attention", default="dense", choices=("dense", "flex"),
                    help="the blocks' attention rule as a dense mask or a sparse flex-attention mask (CUDA only: faster "
                         "per step for long answers and many anchors, slower for short answers)")
    ap.add_argument("--gamma", type=float, default=None, help="position-weight decay (default from block size)")
    ap.add_argument("--length-head-weight", type=float, default=1.0)
    ap.add_argument("--length-head-steps", type=int, default=0, help="extra offline length-head steps, frozen drafter")
    ap.add_argument("--length-head-lr", type=float, default=2e-4)
    # optimisation
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup-ratio", type=float, default=0.04)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--batch-size", type=int, default=16,
                    help="samples per optimizer step in each process (N processes: N times as many in all)")
    ap.add_argument("--grad-accum", type=int, default=1,
                    help="batches of --batch-size per optimizer step: one process with --grad-accum N takes the steps "
                         "of N processes (accelerate launch --num_processes N), on the same samples")
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--minutes", type=float, default=6.0, help="training wall-clock budget (minutes)")
    ap.add_argument("--steps", "--max-steps", dest="steps", type=int, default=None,
                    help="fixed number of optimizer steps (step-based schedule)")
    ap.add_argument("--logging-steps", type=int, default=10)
    ap.add_argument("--num-workers", type=int, default=0)
    ap.add_argument("--train-sampling-strategy", default="group_by_length", choices=("random", "group_by_length"),
                    help="transformers' batch sampler: group_by_length (default) batches samples of similar length, "
                         "which pads fewer blocks and less context than random batches")
    # outputs / eval
    ap.add_argument("--eval-per-domain", type=int, default=32, help="held-out prompts per domain for the acceptance proxy")
    ap.add_argument("--eval-domains", default="math,code,chat,prose")
    ap.add_argument("--max-shard-size", default="15MB")
    ap.add_argument("--no-progress", "--quiet", dest="no_progress", action="store_true",
                    help="no progress bars (regeneration, training); also off when stderr is not a terminal")
    return ap


def _split(text: str | None) -> list[str]:
    return [x.strip() for x in (text or "").split(",") if x.strip()]


@dataclass
class DrafterRecipe:
    """How to regenerate, train and save a drafter (the flags of :func:`add_arguments`, same names;
    comma lists become lists, ``--no-progress`` / ``--quiet`` or a stderr that is no terminal become ``progress=False``)."""

    target: str | None
    out: str
    tokenizer: str | None = None
    data: str | None = None
    domains: list[str] = field(default_factory=lambda: ["chat", "prose"])
    train_domains: list[str] | None = None
    device: str = "auto"
    seed: int = 0
    num_prompts: int = 2000
    max_new_tokens: int = 256
    gen_batch_size: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    sampled_answers: int = 0
    sampled_domains: list[str] = field(default_factory=lambda: ["chat"])
    sampled_temperature: float = 0.7
    prose_prefix: int = 32
    max_prompt_tokens: int = 384
    prompts_per_sample: int = 1
    regen_cache: str | None = None
    regen_only: bool = False
    init_from: str | None = None
    length_head_type: str | None = None
    num_layers: int = 2
    block_size: int = 16
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = None
    max_anchors: int = 512
    block_attention: str = "dense"
    gamma: float | None = None
    length_head_weight: float = 1.0
    length_head_steps: int = 0
    length_head_lr: float = 2e-4
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    batch_size: int = 16
    grad_accum: int = 1
    max_length: int = 1024
    minutes: float = 6.0
    steps: int | None = None
    logging_steps: int = 10
    num_workers: int = 0
    train_sampling_strategy: str = "group_by_length"
    eval_per_domain: int = 32
    eval_domains: list[str] = field(default_factory=lambda: ["math", "code", "chat", "prose"])
    max_shard_size: str = "15MB"
    progress: bool = True


def config_from_args(a: argparse.Namespace) -> DrafterRecipe:
    """The recipe of parsed :func:`add_arguments` flags."""
    kw = {f.name: getattr(a, f.name) for f in fields(DrafterRecipe) if hasattr(a, f.name)}
    for name in ("domains", "sampled_domains", "eval_domains"):
        kw[name] = _split(kw[name])
    kw["target_layer_ids"] = [int(x) for x in _split(a.target_layer_ids)] or None
    kw["train_domains"] = _split(kw.get("train_domains")) or None
    kw["progress"] = not a.no_progress and sys.stderr.isatty()  # bars in a log file are noise
    return DrafterRecipe(**kw)
