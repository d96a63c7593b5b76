"""Log-probabilities in OpenAI's shapes: the prompt's (``echo``, one plain forward of the target) and the committed
tokens' (the engine's :class:`~adaflash_hf.engine.processed_rows.LoggedToken`), as ``/v1/completions`` (``tokens``,
``token_logprobs``, ``top_logprobs``, ``text_offset``) and ``/v1/chat/completions`` (``content``) lay them out.

An entry is ``(token id, logprob or None, ((id, logprob), ...) top alternatives, text offset)``; the prompt's first
token has no logprob (nothing predicts it), as OpenAI answers.

Example::

    entries = prompt_entries(target, [5, 9, 2], top=1, offsets=[0, 3, 7])
    completion_logprobs(entries, lambda t: tok.decode([t]))   # {"tokens": [...], "token_logprobs": [None, ...], ...}
"""

from __future__ import annotations

import torch

from ..speculation.capture import CAPTURE_LOCK

__all__ = ["MAX_TOP_LOGPROBS", "chat_logprobs", "completion_logprobs", "prompt_entries"]

MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat's top_logprobs; vLLM's default for both endpoints
_FLOOR = -9999.0  # a logprob that underflowed to -inf, sent as a finite number (JSON has no -Infinity), as vLLM does
_ROWS = 256  # LM-head rows per chunk: a long prompt's logits over a large vocabulary never sit in memory at once


def _finite(lp: float) -> float:
    return max(lp, _FLOOR)


@torch.no_grad()
def prompt_entries(target, ids: list[int], top: int, offsets: list[int]) -> list[tuple]:
    """The prompt's entries from one plain forward of ``target`` (logits row ``i`` predicts token ``i + 1``),
    ``top`` alternatives each; ``offsets[i]``: where token ``i`` starts in the text. Holds the engine's capture lock,
    so the forward never lands inside a CUDA graph capture of the engine thread."""
    device = next(target.parameters()).device
    with CAPTURE_LOCK:
        hidden = target.model(input_ids=torch.tensor([ids], device=device)).last_hidden_state[0, :-1]
        head = target.get_output_embeddings()
        nxt = torch.tensor(ids[1:], device=device)
        chosen, top_v, top_i = [], [], []
        for s in range(0, hidden.shape[0], _ROWS):
            lp = head(hidden[s : s + _ROWS]).float().log_softmax(dim=-1)
            chosen.append(lp.gather(1, nxt[s : s + _ROWS, None])[:, 0])
            if top:
                t = lp.topk(top, dim=-1)
                top_v.append(t.values)
                top_i.append(t.indices)
    chosen = torch.cat(chosen).tolist() if chosen else []
    tv = torch.cat(top_v).tolist() if top_v else [[] for _ in chosen]
    ti = torch.cat(top_i).tolist() if top_i else [[] for _ in chosen]
    rest = [(ids[i + 1], chosen[i], tuple(zip(ti[i], tv[i])), offsets[i + 1]) for i in range(len(chosen))]
    return [(ids[0], None, (), offsets[0])] + rest


def completion_logprobs(entries: list[tuple], token_text) -> dict:
    """``/v1/completions``' ``logprobs`` object; each ``top_logprobs`` dict holds the alternatives and the chosen
    token (OpenAI: up to ``logprobs + 1`` entries), ``None`` where the token has no logprob."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tok, lp, top, offset in entries:
        text = token_text(tok)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        if lp is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        alts = {token_text(t): _finite(v) for t, v in top}
        alts.setdefault(text, _finite(lp))
        out["token_logprobs"].append(_finite(lp))
        out["top_logprobs"].append(alts)
    return out


def chat_logprobs(entries: list[tuple], token_text) -> dict:
    """``/v1/chat/completions``' ``logprobs`` object: ``content``, a token's text, logprob, UTF-8 bytes and its top
    alternatives each."""
    def one(tok, lp):
        text = token_text(tok)
        return {"token": text, "logprob": _finite(lp), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**one(tok, lp), "top_logprobs": [one(t, v) for t, v in top]} for tok, lp, top, _ in entries],
            "refusal": None}
