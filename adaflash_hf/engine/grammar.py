"""Structured output on the verify path: a request's grammar (xgrammar, the library vLLM and SGLang use) masks the
target's rows before acceptance, every verified position with the grammar state after the tokens before it.

Row ``c`` of a verify segment follows ``tokens + d_1 .. d_c``: the request's matcher takes the drafts one by one,
fills row ``c``'s mask, and is rolled back after the round (xgrammar's ``rollback``, made for speculative decoding).
A draft the grammar refuses has no mass in its row, so it is never accepted and the rows after it are never
committed (their masks are left open). Committed tokens advance the matcher. Greedy answers are therefore plain
decoding's under the same grammar, and speculative sampling stays exact on the masked rows. The drafts are read to
the host once per round that holds a grammar request (the masks are built on the host).

Needs ``xgrammar`` (``pip install 'adaflash-hf[grammar]'``); nothing imports it until a grammar is compiled.

Example::

    grammars = Grammars(tokenizer, vocab_size=target.config.vocab_size, stop_token_ids=[tok.eos_token_id])
    params = SamplingParams(grammar=grammars.json_object())
    engine.submit(prompt_ids, 64, params)   # the answer is JSON (or a prefix of it, cut by max_new_tokens)
"""

from __future__ import annotations

import threading

import numpy as np
import torch

__all__ = ["Grammar", "Grammars", "constrain_round"]

_MASKED = -1e30  # a refused token's logit


class Grammar:
    """A compiled grammar (immutable, shared by requests); :meth:`matcher` starts one request's state."""

    def __init__(self, compiled, vocab_size: int):
        self.compiled, self.vocab_size = compiled, vocab_size

    def matcher(self):
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compiled)


class Grammars:
    """Compiles grammars for one tokenizer and vocabulary (xgrammar's compiler, with its cache); thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids):
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))
        self._compiler, self.vocab_size = xgr.GrammarCompiler(info), vocab_size
        self._lock = threading.Lock()

    def json_object(self) -> Grammar:
        """Any JSON object (OpenAI's ``response_format={"type": "json_object"}``: an object, not any JSON value)."""
        return self.json_schema({"type": "object"})

    def json_schema(self, schema: dict, before: str = "", after: str = "", any_whitespace: bool = True) -> Grammar:
        """JSON that satisfies ``schema``, between the texts ``before`` and ``after`` (a tool call's tags; there, JSON
        without free whitespace: ``any_whitespace=False``); raises ``ValueError`` (xgrammar's reason) when it cannot
        be compiled."""
        import json

        import xgrammar as xgr

        with self._lock:
            try:
                parts = [xgr.Grammar.from_ebnf(f"root ::= {json.dumps(before)}")] if before else []
                parts.append(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=any_whitespace))
                parts += [xgr.Grammar.from_ebnf(f"root ::= {json.dumps(after)}")] if after else []
                grammar = xgr.Grammar.concat(*parts) if len(parts) > 1 else parts[0]
                return Grammar(self._compiler.compile_grammar(grammar), self.vocab_size)
            except RuntimeError as e:
                raise ValueError(str(e)) from None


def _fill(matcher, bitmask: torch.Tensor, first: int, drafts: list[int], rows: int) -> None:
    """Fill ``rows`` mask rows from ``first`` on: row ``c`` after ``drafts[:c]``; the matcher is left as it was."""
    taken = 0
    for c in range(rows):
        matcher.fill_next_token_bitmask(bitmask, first + c)
        if c == rows - 1 or not matcher.accept_token(drafts[c]):
            break  # refused: the rows after it are never committed (left open)
        taken += 1
        if matcher.is_terminated():  # a stop token: the request ends there, the rows after it are never committed
            break
    if taken:
        matcher.rollback(taken)


def constrain_round(logits: torch.Tensor, admitted, running, q_lens: list[int], drafts: torch.Tensor | None) -> None:
    """Mask the packed ``logits`` rows of every grammar request in place: prefill rows (the first token), then each
    verify segment (``drafts [n, kmax]``: the drafts in the target's input)."""
    which = [(j, r) for j, r in enumerate(admitted) if r.grammar is not None]
    verify = [(i, r) for i, r in enumerate(running) if r.grammar is not None]
    if not which and not verify:
        return
    import xgrammar as xgr

    rows = [j for j, _ in which]
    ql = np.asarray(q_lens, dtype=np.int64)
    starts = len(admitted) + np.cumsum(ql) - ql
    host = drafts.tolist() if drafts is not None and verify else None  # the round's extra read
    for i, _ in verify:
        rows.extend(range(int(starts[i]), int(starts[i]) + q_lens[i]))
    bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[-1])  # every token allowed until filled
    for k, (_, r) in enumerate(which):
        r.grammar.fill_next_token_bitmask(bitmask, k)
    k = len(which)
    for i, r in verify:
        _fill(r.grammar, bitmask, k, host[i] if host is not None else [], q_lens[i])
        k += q_lens[i]
    masked = logits[rows].float()
    xgr.apply_token_bitmask_inplace(masked, bitmask.to(masked.device))
    # -inf (xgrammar's mask) as a finite floor: the engine fails a request whose row is not finite, and a floor this
    # low still has no mass after any temperature >= GREEDY_TEMPERATURE; NaN stays NaN (a fault is still one)
    logits[rows] = torch.where(masked == float("-inf"), _MASKED, masked).to(logits.dtype)
