"""Issue 34: `generate(assistant_model=drafter)` takes generate's arguments as plain `generate` does.

1. Processors holding per-row state (prompt padding, prompt ids, the batch index) work per row on a
   left-padded batch; guidance (`guidance_scale`), which cannot follow a verify block, is refused.
2. `inputs_embeds` (with or without `input_ids`) gives plain generate's output.
3. Arguments passed by position are found where transformers finds them, with our drafter or any other
   assistant. CPU, tiny random targets; greedy output must equal plain greedy token for token.
"""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
from generation_checks import MAX_NEW, first_unique, plain, spec, target_model
from generation_helpers import PAD_ID, Collect, CollectingStreamer, make_drafter, make_oracle, make_target, ragged_prompts, unpad
from transformers import GenerationConfig, LogitsProcessorList, NoRepeatNGramLogitsProcessor
from transformers.generation.stopping_criteria import MaxLengthCriteria, StoppingCriteriaList
from transformers.generation.utils import GenerationMixin

import adaflash_hf  # noqa: F401  (installs the generate hook)


def _generate(target, drafter=None, **kw):
    """Greedy `generate` with every argument by keyword (our loop with `drafter`: returns stats too)."""
    kw = dict(dict(do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=PAD_ID), **kw)
    return target.generate(**kw) if drafter is None else target.generate(**kw, assistant_model=drafter, return_stats=True)


def _row_prefix_fn(batch_id, sent):
    """Each row of the batch may use its own range of tokens (plain generate passes the row's index)."""
    return list(range(30 * batch_id, 30 * batch_id + 60))


# --------------------------------------------------------------------------- 1. processors, row for row
# (generate kwargs, sampling with top_k=1: the sampled path, whose output is the greedy one)
PROCESSOR_CASES = [
    ({"repetition_penalty": 1.3}, False),
    ({"encoder_repetition_penalty": 1.5}, False),
    ({"no_repeat_ngram_size": 2}, False),
    ({"encoder_no_repeat_ngram_size": 1}, False),
    ({"prefix_allowed_tokens_fn": _row_prefix_fn}, False),
    ({"repetition_penalty": 1.3, "encoder_repetition_penalty": 1.5}, True),
]


@pytest.mark.parametrize("lengths", [[6], [7, 3, 9]], ids=["batch1", "padded3"])
@pytest.mark.parametrize("kw,sampled", PROCESSOR_CASES, ids=["+".join(c[0]) + ("-sampled" if c[1] else "") for c in PROCESSOR_CASES])
def test_processors_equal_plain_row_for_row(kw, sampled, lengths):
    target = target_model("qwen3", 80)
    ids, mask, _ = ragged_prompts(len(lengths), lengths, 80)
    ref = plain(target, ids, mask, **kw)
    assert not torch.equal(ref, plain(target, ids, mask))  # the processors matter here
    drafter = make_oracle(target, unpad(ref, mask), block_size=4)  # accepted: processors run over whole verify blocks
    extra = {"do_sample": True, "top_k": 1} if sampled else {}
    out, stats = _generate(target, drafter, input_ids=ids, attention_mask=mask, length_policy="fixed", **kw, **extra)
    assert torch.equal(out, ref)
    assert stats.tau > 3


def test_rows_leaving_the_batch_keep_their_own_processors():
    target = target_model("llama", 81)
    ids, mask, _ = ragged_prompts(3, [7, 3, 9], 81)
    kw = {"repetition_penalty": 1.3, "prefix_allowed_tokens_fn": _row_prefix_fn}
    cont = plain(target, ids, mask, **kw)[1, ids.shape[1]:].tolist()
    kw["eos_token_id"] = cont[first_unique(cont, 3, 7)]  # row 1 stops early; rows 0 and 2 move up the batch
    ref = plain(target, ids, mask, **kw)
    assert int(ref[1, -1]) == PAD_ID
    out, _ = spec(target, make_oracle(target, unpad(ref, mask), block_size=4), ids, mask, length_policy="fixed", **kw)
    assert torch.equal(out, ref)


# --------------------------------------------------------------------------- 2. inputs_embeds
# (prompt lengths, also pass input_ids, pass the attention mask, extra generate kwargs)
EMBEDS_CASES = [
    ([6], False, True, {}),
    ([6], False, False, {}),
    ([7, 3, 9], False, True, {}),
    ([7, 3, 9], False, True, {"repetition_penalty": 1.3}),
    ([7, 3, 9], True, True, {}),
    ([5, 8], True, True, {"fast_path": True}),  # the engine takes token ids: the eager loop, with a warning
]


@pytest.mark.filterwarnings("ignore:Passing `repetition_penalty` with `inputs_embeds`")  # transformers' note, true of both
@pytest.mark.parametrize("lengths,with_ids,with_mask,extra", EMBEDS_CASES,
                         ids=["b1", "b1-no-mask", "b3", "b3-repetition_penalty", "b3-with-input_ids", "b2-fast_path"])
def test_inputs_embeds_equal_plain(lengths, with_ids, with_mask, extra):
    target = target_model("qwen3", 82)
    ids, mask, _ = ragged_prompts(len(lengths), lengths, 82)
    # Not the embedding of `ids`: the prompt the target sees must be these embeddings, as in plain generate.
    embeds = target.get_input_embeddings()(ids).detach() * 1.5
    kw = dict(inputs_embeds=embeds, attention_mask=mask if with_mask else None, **({"input_ids": ids} if with_ids else {}))
    ref = _generate(target, **kw, **{k: v for k, v in extra.items() if k != "fast_path"})
    assert not torch.equal(ref[:, -5:], plain(target, ids, mask)[:, -5:])
    full = ref if with_ids else torch.cat([ids, ref], dim=1)  # plain returns only the new tokens without input_ids
    drafter = make_oracle(target, unpad(full, mask), block_size=4)
    with pytest.warns(RuntimeWarning, match="inputs_embeds") if "fast_path" in extra else contextlib.nullcontext():
        out, stats = _generate(target, drafter, **kw, length_policy="fixed", **extra)
    assert torch.equal(out, ref) and stats.tau > 3


@pytest.mark.parametrize("extra,message", [
    ({"speculation_type": "adaflash"}, r"inputs_embeds without input_ids.*Pass input_ids too"),
    ({"round_sink": Collect()}, r"round_sink .* needs the prompt's token ids"),
], ids=["transformers_route", "round_sink"])
def test_inputs_embeds_alone_is_refused_where_prompt_ids_are_needed(extra, message):
    target = target_model("qwen3", 83)
    drafter = make_drafter(target, block_size=4)
    calls = []
    handle = target.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match=message):
            target.generate(inputs_embeds=torch.randn(1, 4, 32), assistant_model=drafter, max_new_tokens=5, **extra)
    finally:
        handle.remove()
    assert calls == []  # refused before the first forward


# --------------------------------------------------------------------------- 3. arguments by position
ORIGINAL_GENERATE = GenerationMixin.generate.__wrapped__
NAMED = [p.name for p in inspect.signature(ORIGINAL_GENERATE).parameters.values()
         if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD][1:]  # after self
IDS = torch.tensor([[5, 9, 2, 7]])
COMMON = dict(max_new_tokens=5, do_sample=False, pad_token_id=PAD_ID)


def _greedy_custom(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None, **model_kwargs):
    return torch.cat([input_ids, input_ids[:, :1]], dim=1)


def _value(name: str):
    """A fresh value for each parameter of generate that changes (or checks) what it does."""
    return {
        "inputs": IDS,
        "generation_config": GenerationConfig(max_new_tokens=3, do_sample=False, pad_token_id=PAD_ID),
        "logits_processor": LogitsProcessorList([NoRepeatNGramLogitsProcessor(2)]),
        "stopping_criteria": StoppingCriteriaList([MaxLengthCriteria(IDS.shape[1] + 2)]),
        "prefix_allowed_tokens_fn": lambda batch_id, sent: list(range(40)),
        "synced_gpus": False,
        "assistant_model": make_target("qwen3", seed=85, layers=1),
        "streamer": CollectingStreamer(),
        "negative_prompt_ids": torch.tensor([[1, 2]]),
        "negative_prompt_attention_mask": torch.tensor([[1, 1]]),
        "custom_generate": _greedy_custom,
    }[name]


def _outcome(generate, *args, **kwargs):
    """What a generate call returns (with what its streamer saw), or the error it raises."""
    try:
        result = generate(*args, **kwargs)
    except (TypeError, ValueError) as exc:
        return type(exc), str(exc)
    streamer = next((v for v in (*args, *kwargs.values()) if isinstance(v, CollectingStreamer)), None)
    return result.tolist(), (streamer.puts if streamer is not None else None)


def _call(name: str, positional: bool):
    """Fresh arguments for generate: `name` by position (after `inputs` and Nones) or by keyword;
    "too_many": more positional arguments than generate has."""
    if name == "too_many":
        return [IDS] + [None] * len(NAMED), dict(COMMON)
    k = NAMED.index(name)
    if positional:
        return [IDS] + [None] * (k - 1) + [_value(name)] if k else [_value(name)], dict(COMMON)
    return ([] if k == 0 else [IDS]), dict(COMMON, **{name: _value(name)})


@pytest.mark.parametrize("positional", [True, False], ids=["positional", "keyword"])
@pytest.mark.parametrize("name", NAMED + ["too_many"])
def test_every_argument_binds_as_transformers_binds_it(name, positional):
    target = target_model("qwen3", 84)
    args, kwargs = _call(name, positional)
    ours = _outcome(target.generate, *args, **kwargs)
    args, kwargs = _call(name, positional)
    assert ours == _outcome(ORIGINAL_GENERATE, target, *args, **kwargs)
    if name != "too_many":
        assert not isinstance(ours[0], type)  # a valid call: it generated


def test_positional_drafter_and_streamer_reach_our_loop():
    target = target_model("qwen3", 86)
    ref_stream, stream = CollectingStreamer(), CollectingStreamer()
    ref = target.generate(IDS, None, None, None, None, None, None, ref_stream, **COMMON)
    drafter = make_oracle(target, [ref[0]], block_size=4)
    out, stats = target.generate(IDS, None, None, None, None, None, drafter, stream, **COMMON, length_policy="fixed", return_stats=True)
    assert torch.equal(out, ref) and stats.tau > 2  # return_stats: our loop ran, accepting whole blocks
    assert stream.puts == ref_stream.puts and stream.ends == 1


def test_drafter_as_second_positional_argument_names_the_fix():
    """`generate(ids, drafter)` puts the drafter where generate takes `generation_config`: one error that says
    so and how to pass it, before any work; the drafter by keyword (the fix it names) then works."""
    target = target_model("qwen3", 87)
    drafter = make_drafter(target, block_size=4)
    with pytest.raises(TypeError, match=r"generation_config.*assistant_model=drafter"):
        target.generate(IDS, drafter, **COMMON)
    out, stats = target.generate(IDS, assistant_model=drafter, **COMMON, return_stats=True)
    assert torch.equal(out, target.generate(IDS, **COMMON)) and stats.rounds > 0
