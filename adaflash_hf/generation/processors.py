"""How our decoding loop calls the logits processors `generate` prepared.

Plain decoding calls them once per step on the whole batch. Our loop verifies a block of positions per row,
rows holding different lengths and leaving the batch as they finish, so in general it calls them per row and
per position, each on its own prefix (:func:`process_row`), on a per-row view of any processor that holds
state for the whole batch (:func:`row_processors`). When none of them reads the sequence (sampling warpers
only: temperature, top-k, top-p, ...), every row and position is processed in one call
(:func:`shared_processors`, :func:`process_rows`): the per-position loop costs a few kernels per token.
"""

import copy
import functools

import torch
from transformers.generation.logits_process import (
    EncoderNoRepeatNGramLogitsProcessor,
    EncoderRepetitionPenaltyLogitsProcessor,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    LogitsProcessorList,
    MinPLogitsWarper,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)

__all__ = ["process_row", "process_rows", "row_processors", "shared_processors"]

# Processors that transform each row of scores alone and never read input_ids (exact types: a subclass may).
_SEQUENCE_FREE = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, TypicalLogitsWarper,
                  EpsilonLogitsWarper, EtaLogitsWarper)  # fmt: skip


def _with(processor, **fields):
    """A shallow copy of `processor` with some attributes replaced."""
    out = copy.copy(processor)
    out.__dict__.update(fields)
    return out


def _prefix_fn_at_row(fn, row: int, _batch_id: int, sent: torch.Tensor):
    return fn(row, sent)


def _row_view(p, row: int):
    """`p` restricted to batch row `row` where generate built it with state for the whole batch (our loop
    calls it on that row alone, so indexing by the call's own batch position would read row 0's state)."""
    if isinstance(p, RepetitionPenaltyLogitsProcessor) and torch.is_tensor(p.prompt_ignore_length):
        return _with(p, prompt_ignore_length=p.prompt_ignore_length[row : row + 1])  # the row's left padding
    if isinstance(p, EncoderRepetitionPenaltyLogitsProcessor):
        return _with(p, encoder_input_ids=p.encoder_input_ids[row : row + 1])  # the row's prompt
    if isinstance(p, EncoderNoRepeatNGramLogitsProcessor):
        return _with(p, batch_size=1, generated_ngrams=[p.generated_ngrams[row]])  # the row's prompt n-grams
    if isinstance(p, PrefixConstrainedLogitsProcessor):  # the user's function is told the row's batch index
        return _with(p, _prefix_allowed_tokens_fn=functools.partial(_prefix_fn_at_row, p._prefix_allowed_tokens_fn, row))
    return p


def row_processors(logits_processor, batch_size: int) -> list[LogitsProcessorList]:
    """Each row's view of generate's processors, to call them on that row alone (input_ids `[1, t]`).

    Plain decoding calls the processors once per step on the whole batch. Our loop calls them per row
    and per verified position (rows hold different lengths and leave the batch as they finish), so a
    processor holding per-row state built from the batch (prompt padding lengths, prompt ids, the batch
    index `prefix_allowed_tokens_fn` receives) gets a copy restricted to its row. Guidance keeps a cache
    of its own unconditional branch, one token per call, that a verify block (drafts that may be
    rejected) would corrupt: refused before any work, never silently wrong.
    """
    for p in logits_processor or []:
        if isinstance(p, UnbatchedClassifierFreeGuidanceLogitsProcessor):
            raise ValueError(
                f"{type(p).__name__} is not supported with an AdaFlash drafter (guidance_scale: it runs its own "
                "unconditional forward one token per call and cannot roll back rejected drafts); generate without assistant_model"
            )
    return [LogitsProcessorList(_row_view(p, r) for p in logits_processor or []) for r in range(batch_size)]


def shared_processors(logits_processor) -> LogitsProcessorList | None:
    """generate's processors as one list to call on every row and position at once, when none reads the
    sequence; else None (call them per row: :func:`row_processors`).

    Example:
        >>> shared_processors([TopPLogitsWarper(0.9)]) is not None, shared_processors([RepetitionPenaltyLogitsProcessor(1.2)])
        (True, None)
    """
    procs = list(logits_processor or [])
    return LogitsProcessorList(procs) if all(type(p) in _SEQUENCE_FREE for p in procs) else None


def process_row(processors, seq: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Apply one row's processors (`row_processors`) to its ``scores`` (``[n, V]``: the last ``n`` positions of
    ``seq``) position by position, each on its own prefix, as plain decoding does."""
    if not len(processors):
        return scores
    out = scores.clone()
    n = scores.shape[0]
    base = seq.shape[0] - n + 1
    for j in range(n):
        out[j] = processors(seq[None, : base + j], scores[j][None])[0]
    return out


def process_rows(rows, shared, seqs, scores: torch.Tensor) -> torch.Tensor:
    """Every row's processed ``scores`` (``[b, n, V]``, row i the last ``n`` positions of ``seqs[i]``): in one
    call with ``shared`` (:func:`shared_processors`), else row by row with ``rows`` (:func:`row_processors`)."""
    if shared is None:
        return torch.stack([process_row(p, s, l) for p, s, l in zip(rows, seqs, scores)])
    if not len(shared):
        return scores
    b, n, v = scores.shape
    unread = torch.zeros((b * n, 1), dtype=torch.long, device=scores.device)  # the processors read no sequence
    return shared(unread, scores.reshape(b * n, v)).view(b, n, v)
