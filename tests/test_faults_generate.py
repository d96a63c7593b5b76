"""Issue 19, item 2: speculative `generate` never returns silently wrong output.

A pre-filled `past_key_values` and a right-padded batch are refused up front with a clear
ValueError (the loop would otherwise feed the whole prompt on top of the cache, or treat the
padding after a row's tokens as its context); an empty cache and left padding keep working.
"""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache

from adaflash_hf.generation import adaflash_decoding
from generation_helpers import make_drafter, make_target, ragged_prompts


@pytest.fixture
def pair():
    target = make_target("qwen3", seed=0)
    return target, make_drafter(target, block_size=4)


def _prefilled_cache(target, ids):
    with torch.no_grad():
        return target(ids[:, :-1], use_cache=True).past_key_values


@pytest.mark.parametrize("route", ["assistant_model", "custom_generate"])
def test_prefilled_cache_is_refused_up_front(pair, route):
    target, drafter = pair
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2]])
    plain = target.generate(ids, past_key_values=_prefilled_cache(target, ids), max_new_tokens=6, do_sample=False)
    assert plain.shape == (1, 13)  # plain generate accepts it: ours must not answer differently
    kw = dict(assistant_model=drafter) if route == "assistant_model" else dict(custom_generate=adaflash_decoding, drafter=drafter)
    with pytest.raises(ValueError, match=r"past_key_values.*6 tokens.*(drop|empty)"):
        target.generate(ids, past_key_values=_prefilled_cache(target, ids), max_new_tokens=6, do_sample=False, **kw)


def test_empty_cache_still_equals_plain(pair):
    target, drafter = pair
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2]])
    plain = target.generate(ids, max_new_tokens=10, do_sample=False)
    ours = target.generate(ids, past_key_values=DynamicCache(config=target.config), assistant_model=drafter,
                           max_new_tokens=10, do_sample=False)
    assert torch.equal(ours, plain)


def test_right_padded_batch_is_refused_naming_left_padding(pair):
    target, drafter = pair
    ids = torch.tensor([[3, 1, 4, 1, 5], [2, 7, 1, 126, 126]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    with pytest.raises(ValueError, match=r"right.padd.*padding_side='left'"):
        target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=6, do_sample=False, pad_token_id=126)


def test_left_padded_batch_still_equals_rows_alone(pair):
    target, drafter = pair
    ids, mask, rows = ragged_prompts(2, [5, 3], seed=1)
    ours = target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=6, do_sample=False, pad_token_id=126)
    for i, r in enumerate(rows):
        alone = target.generate(r[None], max_new_tokens=6, do_sample=False)
        assert ours[i, -6:].tolist() == alone[0, -6:].tolist()
