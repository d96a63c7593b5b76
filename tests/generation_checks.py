"""Shared pieces of the `generate(assistant_model=...)` tests (`test_generation*.py`): cached tiny targets,
plain and speculative greedy calls, and the per-round bookkeeping checks."""

from __future__ import annotations

import functools

from generation_helpers import (
    PAD_ID,
    make_target,
)


MAX_NEW = 20


@functools.lru_cache(maxsize=None)
def target_model(family: str, seed: int, attn: str = "sdpa"):
    return make_target(family, seed=seed, attn=attn)


def plain(target, ids, mask=None, **kw):
    kw.setdefault("max_new_tokens", MAX_NEW)
    return target.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=PAD_ID, **kw)


def spec(target, drafter, ids, mask=None, **kw):
    kw.setdefault("max_new_tokens", MAX_NEW)
    return target.generate(
        ids, attention_mask=mask, assistant_model=drafter, do_sample=False, pad_token_id=PAD_ID, return_stats=True, **kw
    )


def full_block_lengths(stats, block: int, max_new: int) -> list[int]:
    """Verify lengths a full-block policy must use: the block, capped by the tokens still allowed."""
    gen, out = 1, []  # the prefill committed the first token
    for acc in stats.accepted:
        out.append(min(block, max_new - gen))
        gen += acc + 1
    return out


def committed_per_round_ok(stats, new_tokens: int) -> bool:
    """Without an early stop every round commits accepted + 1 tokens, after the prefill's one."""
    return 1 + sum(a + 1 for a in stats.accepted) == new_tokens


def first_unique(tokens: list[int], lo: int, hi: int) -> int:
    """Index in [lo, hi) of a token that does not occur earlier in `tokens`."""
    for i in range(lo, hi):
        if tokens[i] not in tokens[:i]:
            return i
    raise AssertionError(f"no fresh token in positions {lo}..{hi} of {tokens}")
