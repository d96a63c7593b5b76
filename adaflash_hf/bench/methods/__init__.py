"""The benchmark's methods, one module per family: transformers' own paths (`.hf`), our loop with a
verify-length policy (`.ours`), the serving engine (`.engine`). `METHODS` maps a name to its `Method`."""

from __future__ import annotations

from ...speculation.prompt_ngrams import PromptNgrams
from .base import BenchContext, Method, MethodOutput, needs_length_head
from .engine import engine
from .hf import (
    needs_plain_rows, prompt_lookup_from_plain, prompt_lookup_grid_from_plain, run_dflash_native, run_hf_assisted, run_plain,
    run_plain_static, run_prompt_lookup, run_prompt_lookup_tuned,
)  # fmt: skip
from .ours import adaflash_policy, ours

__all__ = ["METHODS", "BenchContext", "Method", "MethodOutput", "adaflash_policy"]

METHODS: dict[str, Method] = {
    "plain": Method("plain", run_plain, "HF generate, dynamic cache"),
    "plain_static": Method("plain_static", run_plain_static, "HF generate, static cache (compiled on CUDA)"),
    "hf_assisted": Method("hf_assisted", run_hf_assisted, "HF assisted generation", needs_assistant=True, batch1_only=True),
    "prompt_lookup": Method(
        "prompt_lookup", run_prompt_lookup, "HF prompt-lookup decoding (no drafter)", batch1_only=True
    ),
    "prompt_lookup_exact": Method(
        "prompt_lookup_exact", None, "HF prompt-lookup decoding's rounds computed from plain's outputs (not timed)",
        skip=needs_plain_rows, from_plain=prompt_lookup_from_plain,
    ),
    # Prompt lookup at its best (`..prompt_lookup_grid`): opt-in, not among the default methods.
    "prompt_lookup_grid": Method(
        "prompt_lookup_grid", None, "HF prompt lookup's best of the grid (tokens 10/15/20 x n-gram 2/3/4), computed "
        "from plain's outputs (not timed)", skip=needs_plain_rows, from_plain=prompt_lookup_grid_from_plain,
    ),
    "prompt_lookup_tuned": Method(
        "prompt_lookup_tuned", run_prompt_lookup_tuned, "HF prompt-lookup decoding at the setting chosen on validation",
        batch1_only=True,
    ),
    "dflash_native": Method(
        "dflash_native", run_dflash_native, "transformers' native DFlash path", needs_drafter=True, batch1_only=True
    ),
    "fixed": Method("fixed", ours("fixed"), "AdaFlash loop, fixed full-block verify, prompt n-grams beside the drafter",
                    needs_drafter=True),
    # The drafter alone (`prompt_ngrams=0`): classic DFlash, and what the prompt n-gram rule is measured against.
    "fixed_alone": Method("fixed_alone", ours("fixed", 0), "AdaFlash loop, fixed full-block verify, the drafter alone (DFlash)",
                          needs_drafter=True),
    # A greedy row taking a prompt n-gram candidate verifies it up to 31 tokens, past the block (`PromptNgrams.max_width`).
    "fixed_wide": Method("fixed_wide", ours("fixed", PromptNgrams(max_width=31)), "AdaFlash loop, fixed full-block "
                         "verify, prompt n-gram candidates verified up to 31 tokens", needs_drafter=True),
    "adaptive": Method(
        "adaptive", ours("adaptive"), "AdaFlash loop, length-head verify length", needs_drafter=True, skip=needs_length_head
    ),
    "cost": Method(
        "cost", ours("cost"), "AdaFlash loop, cost-aware verify length (the default with a trained length head)",
        needs_drafter=True, skip=needs_length_head,
    ),
    "cost_alone": Method(
        "cost_alone", ours("cost", 0), "AdaFlash loop, cost-aware verify length, the drafter alone", needs_drafter=True,
        skip=needs_length_head,
    ),
    "cost_wide": Method(
        "cost_wide", ours("cost", PromptNgrams(max_width=31)), "AdaFlash loop, cost-aware verify length, prompt n-gram "
        "candidates verified up to 31 tokens", needs_drafter=True, skip=needs_length_head,
    ),
    "expected_gain": Method("expected_gain", ours("expected_gain"), "AdaFlash loop, expected-gain verify length", needs_drafter=True),
    "osd": Method(
        "osd", ours("fixed"), "AdaFlash loop, fixed verify, online speculative distillation (forward KL)",
        needs_drafter=True, online="osd",
    ),
    "adaflash": Method(
        "adaflash", ours(adaflash_policy), "AdaFlash loop, adaptive verify length + online OPD",
        needs_drafter=True, online="opd",
    ),
    "engine_off": Method("engine_off", engine(None), "serving engine, plain decoding (continuous batching)"),
    "engine_fixed": Method("engine_fixed", engine("fixed"), "serving engine, fixed full-block verify", needs_drafter=True),
    "engine_fixed_alone": Method("engine_fixed_alone", engine("fixed", 0), "serving engine, fixed full-block verify, the "
                                 "drafter alone", needs_drafter=True),
    "engine_adaptive": Method(
        "engine_adaptive", engine("adaptive"), "serving engine, per-request verify lengths packed in one forward",
        needs_drafter=True, skip=needs_length_head,
    ),
    "engine_cost": Method(
        "engine_cost", engine("cost"), "serving engine, cost-aware verify lengths packed in one forward",
        needs_drafter=True, skip=needs_length_head,
    ),
}  # fmt: skip
