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


# --------------------------------------------------------------------------- item 8: one clear error each
import json  # noqa: E402

from adaflash_hf import AdaFlashDrafter  # noqa: E402
from adaflash_hf.modeling.configuration_adaflash import default_target_layer_ids  # noqa: E402


def test_invalid_config_json_names_the_file(pair, tmp_path):
    _, drafter = pair
    drafter.save_pretrained(tmp_path / "ckpt")
    config = tmp_path / "ckpt" / "config.json"
    config.write_text(config.read_text() + "}{garbage")
    with pytest.raises(ValueError, match=rf"{config}.*not valid JSON"):
        AdaFlashDrafter.from_pretrained(tmp_path / "ckpt")


@pytest.mark.parametrize("path", ["{tmp}/no_such_checkpoint", "./no/such/checkpoint", "no_such_dir/"])
def test_missing_local_path_says_it_does_not_exist(tmp_path, path):
    path = path.format(tmp=tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist") as e:
        AdaFlashDrafter.from_pretrained(path)
    assert "Repo id" not in str(e.value)


def test_zlab_config_without_target_layer_ids_takes_the_zlab_default(pair, tmp_path):
    """z-lab's reader defaults `target_layer_ids` from `num_target_layers` (no KeyError); without both
    the error names the fields."""
    from adaflash_hf.export import export_dflash

    target, drafter = pair
    out = tmp_path / "dflash"
    export_dflash(drafter, str(out), dtype=None)
    config = json.loads((out / "config.json").read_text())
    config["dflash_config"].pop("target_layer_ids")
    config.pop("target_layer_ids", None)
    (out / "config.json").write_text(json.dumps(config))
    loaded = AdaFlashDrafter.from_pretrained(out)
    n = target.config.num_hidden_layers
    assert loaded.config.target_layer_ids == default_target_layer_ids(n, drafter.config.num_hidden_layers)
    config["dflash_config"].pop("num_target_layers", None)
    config.pop("num_target_layers", None)
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json: neither dflash_config.target_layer_ids nor num_target_layers"):
        AdaFlashDrafter.from_pretrained(out)


@pytest.mark.parametrize("message,words", [
    ({"role": "user"}, "has no `content`"),
    ({"role": "wizard", "content": "hi"}, "`messages[0].role` must be one of system"),  # the role is not echoed
    ({"role": "user", "content": None}, "only an assistant message"),
])  # fmt: skip
def test_chat_messages_without_content_or_with_an_unknown_role_are_refused(message, words):
    from adaflash_hf.serve.server import APIError, CompletionService

    with pytest.raises(APIError) as e:
        CompletionService._chat_messages([message])
    assert e.value.status == 400 and e.value.param == "messages" and words in e.value.message


def test_valid_chat_messages_still_pass():
    from adaflash_hf.serve.server import CompletionService

    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": None},
            {"role": "user", "content": [{"type": "text", "text": "x"}]}]
    assert [m["content"] for m in CompletionService._chat_messages(msgs)] == ["s", "u", "", "x"]
