"""What a benchmark method is: `Method` (a runner and when it cannot run), what it sees (`BenchContext`)
and what it answers (`MethodOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class BenchContext:
    """What a method's runner sees: the loaded models and the shared generation arguments."""

    target: Any
    drafter: Any
    assistant: Any
    tokenizer: Any
    device: Any  # torch.device
    generate_kwargs: dict
    engines: dict = field(default_factory=dict)  # the engine methods' engines, kept across batches
    prompt_lookup_num_tokens: int = 10
    length_rate: float | None = None  # the length head's rate (None: the drafter config's)
    halving_batch: int | None = None  # engine methods: load-scaled rate (None: fixed rate, the default)
    prompt_lookup_tuned: Any = None  # the current set's `PromptLookupSettings` chosen on validation (prompt_lookup_grid)
    fast_path: Any = "auto"  # our loop's `fast_path` (True: the engine off CUDA too, as on CUDA by default)


@dataclass
class MethodOutput:
    """A runner's answer: the generated sequences (prompt included), and our stats when it has them.

    ``rounds`` is a verify-round count (target forwards after the prefill) for methods without
    `GenerationStats` (batch 1); tau is then `speculation.rounds.tau_from_totals`. ``settings``: the knobs it ran
    with, where it has some (prompt lookup's), recorded in the cell.
    """

    sequences: Any  # torch.Tensor; None for a computed (`Method.from_plain`) method
    stats: Any = None
    rounds: int | None = None
    settings: dict | None = None


@dataclass
class Method:
    """A benchmark method: ``run(ctx, input_ids, attention_mask, streamer)`` returns a `MethodOutput`
    (or just the sequences tensor, or ``(sequences, stats)``). ``skip(ctx, concurrency)`` returns a
    reason when the method cannot run in that configuration, else None. ``online``: an
    ``OnlineAdapter`` method (``"osd"``, ``"opd"``): each cell then runs on a fresh copy of the
    drafter with an adapter attached, fed by every round the cell serves. ``from_plain``: a method
    computed, not run: ``from_plain(ctx, prompts, plain_rows, max_new_tokens, eos_ids)`` returns a
    `MethodOutput` (no sequences) with the `GenerationStats` it would have had, from plain's greedy rows
    of the same prompts (``run`` is None)."""

    name: str
    run: Callable | None
    description: str = ""
    needs_drafter: bool = False
    needs_assistant: bool = False
    batch1_only: bool = False
    skip: Callable | None = None
    online: str | None = None
    from_plain: Callable | None = None

    def skip_reason(self, ctx: BenchContext, concurrency: int) -> str | None:
        if self.needs_drafter and ctx.drafter is None:
            return "no drafter given (--drafter or --reference)"
        if self.needs_assistant and ctx.assistant is None:
            return "no autoregressive assistant given (--assistant)"
        if self.batch1_only and concurrency > 1:
            return f"{self.description or self.name} supports batch size 1 only (concurrency {concurrency})"
        return self.skip(ctx, concurrency) if self.skip is not None else None


def needs_length_head(ctx, concurrency):
    """`Method.skip` of the methods that choose verify lengths with the drafter's length head."""
    if getattr(ctx.drafter, "length_head", None) is None:
        return "the drafter has no length head (config.use_length_head is False): adaptive needs one"
    return None
