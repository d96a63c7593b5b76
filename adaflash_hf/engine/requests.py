"""What the engine's callers hold: a request's state, its handle, its output, and a step's summary."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..speculation.rounds import RoundTally
from .sampling import SamplingParams

__all__ = ["EngineOutput", "Request", "RequestHandle", "RequestRejected", "StepInfo", "check_request"]


class RequestRejected(ValueError):
    """A request that can never fit the engine (raised by :meth:`Engine.submit`)."""


@dataclass
class EngineOutput(RoundTally):
    """What one request produced. ``token_ids`` are the generated ids only."""

    request_id: int
    prompt_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "length", "eos", "cancelled" or "error" (then ``error`` says why)
    accepted: list[int] = field(default_factory=list)  # accepted drafts per round after prefill (0s when "off")
    verify_lengths: list[int] = field(default_factory=list)  # tokens verified per round (bonus included)
    error: str | None = None  # finish_reason "error": what failed (this request only, or the engine's round)
    logprobs: list | None = None  # SamplingParams(logprobs=...): a `processed_rows.LoggedToken` per token of token_ids


@dataclass(frozen=True)
class StepInfo:
    """What one step is about to send to the target (given to ``step_hook`` before the forward)."""

    num_tokens: int
    token_budget: int
    num_prefill: int
    num_verify: int
    slots_in_use: int
    num_slots: int
    n_hat: float


class Request:
    """One request's state inside the engine (queued, running, done)."""

    def __init__(self, rid: int, prompt: list[int], max_new: int, params: SamplingParams, on_token):
        self.id, self.prompt, self.max_new, self.params, self.on_token = rid, prompt, max_new, params, on_token
        self.slot: int | None = None
        self.tokens: list[int] = []
        self.pending_ctx: torch.Tensor | None = None  # target features the drafter has not consumed
        self.ngrams = None  # prompt + tokens indexed for the prompt n-gram rule (`speculation.prompt_ngrams.NgramIndex`)
        self.head_ratio: float | None = None  # the length head's last ratio
        self.seen = (0.0, 0)  # sum and count of its rounds' acceptance ratios (the cost policy's guess before a round)
        self.state = "queued"
        self.cancel_requested = False
        self.output: EngineOutput | None = None
        self.accepted: list[int] = []
        self.verify_lengths: list[int] = []
        self.logprobs: list = []  # LoggedToken per committed token, when params.logprobs is set
        self.grammar = params.grammar.matcher() if params.grammar is not None else None  # its state (engine.grammar)

    @property
    def bonus(self) -> int:
        return self.tokens[-1]

    @property
    def remaining(self) -> int:
        return self.max_new - len(self.tokens)


class StepsRequests(Protocol):
    """What a :class:`RequestHandle` needs of its engine: one round for every running request (``step()``: whether
    anything is left to do) and cancelling one request (the engine's class imports this module, not the reverse)."""

    def step(self) -> bool: ...

    def _cancel(self, req: Request) -> None: ...


class RequestHandle:
    """A submitted request: ``cancel()``, ``result()`` (steps the engine until it is done), ``done``."""

    def __init__(self, engine: StepsRequests, req: Request):
        self._engine, self._req = engine, req

    @property
    def request_id(self) -> int:
        return self._req.id

    @property
    def done(self) -> bool:
        return self._req.output is not None

    @property
    def token_ids(self) -> list[int]:
        return list(self._req.tokens)

    def cancel(self) -> None:
        self._engine._cancel(self._req)

    def result(self) -> EngineOutput:
        while self._req.output is None:
            if not self._engine.step():
                raise RuntimeError(f"request {self._req.id} cannot progress (engine idle)")
        return self._req.output


def check_request(prompt: list[int], max_new_tokens: int, max_len: int, token_budget: int, vocab: int) -> None:
    """Raise :class:`RequestRejected` for a request that can never run: empty, nothing to generate, longer
    than a KV slot, a prompt over one forward's token budget (prefill is not chunked), ids off the vocabulary."""
    if not prompt:
        raise RequestRejected("empty prompt: a request needs at least one prompt token")
    if max_new_tokens < 1:
        raise RequestRejected(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if len(prompt) + max_new_tokens > max_len:
        raise RequestRejected(
            f"request can never fit: prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) = "
            f"{len(prompt) + max_new_tokens} > max_len ({max_len}) of a KV slot")
    if len(prompt) > token_budget:
        raise RequestRejected(
            f"request can never fit: prompt ({len(prompt)} tokens) is longer than the per-forward token budget "
            f"({token_budget}); prefill is not chunked")
    if min(prompt) < 0 or max(prompt) >= vocab:
        raise RequestRejected(f"prompt token ids must lie in [0, {vocab})")
