"""What an :class:`~.engine.Engine` is built from, besides its models: one :class:`EngineConfig`, checked when made."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable

from ..speculation.length import LengthSettings, RoundCost
from ..speculation.prompt_ngrams import PromptNgrams
from ..speculation.rounds import RoundSink

__all__ = ["EngineConfig"]


@dataclass(frozen=True)
class EngineConfig:
    """An engine's settings; a bad value raises one ``ValueError`` when the config is made, before any model work
    (what depends on the drafter, e.g. a length policy that needs its head, is checked when the engine is built).

    Args:
        length_policy: ``cost`` (each request's ``k_hat`` from the length head, chosen together against
            ``round_cost``, packed into one forward), ``adaptive`` (the paper's floor rule on the length head) or
            ``fixed`` (the whole block, DFlash); the same setting as ``generate``'s; default: ``cost``
            when the drafter's length head is trained, else ``fixed``; or a
            :class:`~adaflash_hf.speculation.length.names.LengthSettings` (``length_rate``, ``length_min`` and
            ``halving_batch`` override it). Under ``cost`` a round whose requests all decode plainly by their guesses is
            a plain step, as ``off``'s, without the drafter's body (a probe round runs it to refresh them; the engine's
            ``planner``, :mod:`adaflash_hf.speculation.length.planner`).
        rectangular: with ``cost`` / ``adaptive``, pad every request to the round's largest ``k_hat`` (the cost of a
            padded ``[b, max k_hat]`` batch; for comparison only).
        max_slots: concurrent requests (KV slots for target and drafter).
        max_len: positions per slot: ``len(prompt) + max_new_tokens`` must not exceed it.
        token_budget: most tokens one target forward may carry (prefill + verify).
        length_rate, length_min: the length head policy (default: the drafter config's).
        halving_batch: ``None`` (default) keeps the rate fixed, as the paper does (load is left to
            admission); a batch size scales the rate down with the batch instead
            (``load_scaled_rate(length_rate, batch, halving_batch)``: half the rate at that batch).
        ema_beta: admission EMA weight, in ``(0, 1]``.
        round_sink: receives every verified round, and every finished (not cancelled) request when it
            has ``on_request`` (default: an OnlineAdapter attached to the drafter).
        step_hook: called with a :class:`~.requests.StepInfo` before each target forward (tests, metrics).
        cuda_graphs: decode and drafter forwards as CUDA graphs per bucket with split-KV Triton attention
            (flex_attention without Triton) (default: on when the target is on CUDA). ``True`` on CPU runs the same
            static, padded bucket forwards eagerly with SDPA (what the CPU tests check); ``False`` is the eager
            reference path.
        fused_kernels: run the target's layers (and the drafter's, on the CUDA-graph path) with fused projections and
            elementwise kernels (:class:`~.kernels.fused.FusedTarget`). Kept off automatically, with the reason in the
            engine's ``fusion_note`` and a warning, for layers that are not the stock Qwen3 / Llama math (e.g. LoRA, a
            hook that may change a forward; transformers' output-capturing hooks do not count).
        decode_steps: ``off`` mode, and the ``cost`` policy's plain stretches, with graphs: while nothing waits for
            admission and every running request is greedy (and, under ``cost``, the last ratios say every request
            decodes plainly), queue up to this many decode steps and read them back once (:mod:`.decode_steps`).
            Outputs are unchanged; streaming callbacks and cancellations act at that granularity. 1 turns it off.
        spec_rounds: the ``fixed`` verify length with graphs: while nothing waits for admission, every running request
            is greedy and nothing reads the rounds but the acceptance (no penalty, grammar, logprobs or round sink),
            queue up to this many draft-verify rounds on the device, each built from the last one's verdict there,
            and read them back once (:mod:`.spec_rounds`). Outputs are unchanged; the prompt n-gram rule sits out the
            queued rounds. 1 (the default) turns it off.
        profile: time each step's phases (the engine's ``phase_seconds``: draft, target, accept, host), with a
            device synchronisation at every phase boundary (measurement only: it adds syncs; :class:`.stats.PhaseTimer`).
        prompt_ngrams: the prompt n-gram rule beside the drafter, as ``generate``'s
            (:mod:`adaflash_hf.speculation.prompt_ngrams`; 0: off; default: greedy requests only, n-grams up to 4).
            Off while a round sink or ``draft_replay`` is set (they read the drafter's own drafts).
        draft_replay: a :class:`~.round_drafts.DraftSource` that replaces the length head's ratios and the drafted tokens
            after the drafter's real forward (benchmarks: :class:`adaflash_hf.bench.replay.DraftReplay`, greedy
            requests only; outputs stay those of plain greedy decoding).
        round_cost: the :class:`~adaflash_hf.speculation.length.cost.RoundCost` the ``cost`` policy weighs, or
            ``"measured"``: the engine's own (:func:`~.warmup.measure_round_cost`), profiled once per models, device,
            dtype, shape and versions and cached (:func:`~.cost_cache.cached_round_cost`). Default: ``"measured"`` under
            ``cost`` on CUDA's graph path, else :class:`~adaflash_hf.speculation.length.cost.RoundCost`'s default table.

    Example:
        >>> EngineConfig(length_policy="fixed", max_slots=8).max_len
        1024
        >>> EngineConfig.of(EngineConfig(max_slots=8), token_budget=256).token_budget
        256
        >>> EngineConfig(decode_steps=0)
        Traceback (most recent call last):
        ...
        ValueError: EngineConfig: decode_steps must be >= 1, got 0
    """

    length_policy: str | LengthSettings | None = None
    rectangular: bool = False
    max_slots: int = 16
    max_len: int = 1024
    token_budget: int = 512
    length_rate: float | None = None
    length_min: int | None = None
    halving_batch: int | None = None
    ema_beta: float = 0.2
    round_sink: RoundSink | None = None
    step_hook: Callable | None = None
    cuda_graphs: bool | None = None
    fused_kernels: bool = True
    decode_steps: int = 8
    spec_rounds: int = 1
    profile: bool = False
    prompt_ngrams: int | PromptNgrams | None = None
    draft_replay: object | None = None
    round_cost: RoundCost | str | None = None

    def __post_init__(self):
        for name in ("max_slots", "max_len", "token_budget", "decode_steps", "spec_rounds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig: {name} must be >= 1, got {value!r}")
        if not 0 < self.ema_beta <= 1:
            raise ValueError(f"EngineConfig: ema_beta must be in (0, 1], got {self.ema_beta!r}")
        if self.round_cost is not None and not isinstance(self.round_cost, RoundCost) and self.round_cost != "measured":
            raise ValueError(f"EngineConfig: round_cost must be a RoundCost, 'measured' or None, got {self.round_cost!r}")
        if self.length_policy is not None and not isinstance(self.length_policy, (str, LengthSettings)):
            raise ValueError(f"EngineConfig: length_policy must be a policy name or LengthSettings, "
                             f"got {self.length_policy!r}")
        PromptNgrams.of(self.prompt_ngrams)  # its own checks

    @classmethod
    def of(cls, config: EngineConfig | None = None, **overrides) -> EngineConfig:
        """``config`` (default: every default) with ``overrides`` (field name: value) on top: the one way an engine's
        keywords become its config; an unknown name raises ``TypeError`` naming it."""
        if config is not None and not isinstance(config, cls):
            raise TypeError(f"config must be an EngineConfig or None, got {type(config).__name__} "
                            f"(settings by name go as keywords: Engine(target, drafter, length_policy=...))")
        unknown = sorted(set(overrides) - {f.name for f in fields(cls)})
        if unknown:
            raise TypeError(f"EngineConfig has no setting {', '.join(unknown)}")
        base = config if config is not None else cls()
        return replace(base, **overrides) if overrides else base

    @property
    def length_settings(self) -> LengthSettings:
        """The verify-length settings these fields give, before the drafter fills in its defaults."""
        given = self.length_policy if isinstance(self.length_policy, LengthSettings) else None
        return LengthSettings.of(given, length_policy=None if given is not None else self.length_policy,
                                 length_rate=self.length_rate, length_min=self.length_min,
                                 halving_batch=self.halving_batch)
