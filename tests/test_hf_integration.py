"""Tripwires for the transformers seams adaflash-hf relies on (docs/transformers_internals.md).

If a transformers release changes one of these, this file fails first, naming the seam, instead of
the speculative loop failing somewhere obscure.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from generation_helpers import CollectingStreamer, char_tokenizer, make_drafter, make_target
from transformers import GenerationConfig
from transformers.cache_utils import DFlashCache, DynamicCache
from transformers.generation.logits_process import (
    EncoderNoRepeatNGramLogitsProcessor,
    EncoderRepetitionPenaltyLogitsProcessor,
    LogitsProcessorList,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)
from transformers.generation.stopping_criteria import MaxLengthCriteria, StoppingCriteriaList, StopStringCriteria
from transformers.generation.utils import GenerationMixin

import adaflash_hf  # noqa: F401  (installs the generate hook)
from adaflash_hf.generation.hf_integration import TESTED_TRANSFORMERS, check_transformers_version
from adaflash_hf.generation.processors import row_processors


def test_generate_has_the_parameters_the_hook_uses():
    params = inspect.signature(GenerationMixin.generate).parameters  # follows __wrapped__ to transformers' own
    for name in ("inputs", "generation_config", "custom_generate", "assistant_model", "streamer"):
        assert name in params, name
    assert getattr(GenerationMixin.generate, "__adaflash_hook__", False)
    assert GenerationMixin.generate.__wrapped__ is not GenerationMixin.generate


def _probe_call(**generate_kwargs):
    got = {}

    def probe(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None, my_option=None, **model_kwargs):
        got.update(model=model, input_ids=input_ids, logits_processor=logits_processor, stopping_criteria=stopping_criteria,
                   generation_config=generation_config, my_option=my_option, model_kwargs=model_kwargs)
        return input_ids

    target = make_target("qwen3", seed=0)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    mask = generate_kwargs.pop("attention_mask", torch.ones_like(ids))
    target.generate(ids, attention_mask=mask, custom_generate=probe, **generate_kwargs)
    return target, got


def test_callable_custom_generate_receives_prepared_processors_criteria_config_and_custom_kwargs():
    target, got = _probe_call(my_option=7, max_new_tokens=3, repetition_penalty=1.2)
    assert got["model"] is target and got["input_ids"].shape == (2, 3)
    assert isinstance(got["logits_processor"], LogitsProcessorList)
    assert any(isinstance(p, RepetitionPenaltyLogitsProcessor) for p in got["logits_processor"])
    assert isinstance(got["stopping_criteria"], StoppingCriteriaList)
    assert any(isinstance(c, MaxLengthCriteria) for c in got["stopping_criteria"])
    assert got["generation_config"].max_length == 6 and got["generation_config"].repetition_penalty == 1.2
    assert got["my_option"] == 7  # a parameter of the callable, not of `_sample`, is passed through
    mk = got["model_kwargs"]
    # an all-ones mask may arrive as None (the loop treats None as all ones)
    assert mk.get("attention_mask") is None or bool(mk["attention_mask"].all())
    assert isinstance(mk["past_key_values"], DynamicCache) and mk["past_key_values"].get_seq_length() == 0


def test_callable_custom_generate_receives_the_padding_mask_and_positions():
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    _, got = _probe_call(max_new_tokens=2, attention_mask=mask)
    assert torch.equal(got["model_kwargs"]["attention_mask"], mask)
    position_ids = got["model_kwargs"].get("position_ids")
    assert position_ids is None or torch.equal(position_ids[:, 1:], torch.tensor([[0, 1], [1, 2]]))


def test_callable_custom_generate_gets_neither_streamer_nor_tokenizer():
    """Why the hook binds the streamer to our loop and builds stop-string criteria itself.

    If transformers starts passing these through, this tripwire fails: the workaround in
    `hf_integration` can then be simplified (it stays correct either way).
    """
    streamer = CollectingStreamer()
    _, got = _probe_call(max_new_tokens=2, streamer=streamer)
    assert "streamer" not in got["model_kwargs"]
    assert streamer.puts == [[1, 2, 3, 4, 5, 6]] and streamer.ends == 0  # generate itself only streams the prompt
    tok, chars = char_tokenizer()
    with pytest.raises(ValueError, match="could not locate a tokenizer"):
        _probe_call(max_new_tokens=2, stop_strings=chars[5], tokenizer=tok)


# generate kwargs that build a processor holding per-row state, and its class (`row_processors` reads that state)
ROW_STATE_CASES = [
    ({"repetition_penalty": 1.3}, RepetitionPenaltyLogitsProcessor),
    ({"encoder_repetition_penalty": 1.3}, EncoderRepetitionPenaltyLogitsProcessor),
    ({"encoder_no_repeat_ngram_size": 1}, EncoderNoRepeatNGramLogitsProcessor),
    ({"prefix_allowed_tokens_fn": lambda batch_id, sent: [batch_id, 10 + batch_id, 20 + int(sent[-1])]}, PrefixConstrainedLogitsProcessor),
]


@pytest.mark.parametrize("kw,cls", ROW_STATE_CASES, ids=[c[1].__name__ for c in ROW_STATE_CASES])
def test_row_views_of_batch_processors_equal_the_batch_call(kw, cls):
    """Each row's view (`row_processors`: a copy with the batch state cut to the row) called on that row
    alone equals the processor called on the whole batch, as plain decoding calls it."""
    _, got = _probe_call(max_new_tokens=2, attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]), **kw)
    procs = got["logits_processor"]
    assert [type(p) for p in procs] == [cls]
    ids = torch.tensor([[1, 2, 3, 7, 1], [4, 5, 6, 8, 9]])  # the prompts generate saw + two generated tokens
    scores = torch.randn(2, 128, generator=torch.Generator().manual_seed(0))
    whole = procs(ids, scores.clone())
    views = row_processors(procs, 2)
    for r in range(2):
        assert torch.equal(views[r](ids[r : r + 1], scores[r : r + 1].clone()), whole[r : r + 1])
    assert not torch.equal(views[0](ids[1:], scores[1:].clone()), whole[1:])  # the state really is per row


def test_guidance_processor_is_refused_by_name():
    """guidance_scale builds a processor with its own cache of the unconditional branch: refused, not run."""
    _, got = _probe_call(max_new_tokens=2, guidance_scale=1.5)
    assert any(isinstance(p, UnbatchedClassifierFreeGuidanceLogitsProcessor) for p in got["logits_processor"])
    with pytest.raises(ValueError, match="UnbatchedClassifierFreeGuidanceLogitsProcessor .*guidance_scale"):
        row_processors(got["logits_processor"], 2)


def test_stop_string_criteria_accepts_a_char_tokenizer():
    tok, chars = char_tokenizer()
    crit = StopStringCriteria(stop_strings=chars[3] + chars[4], tokenizer=tok)
    ids = torch.tensor([[1, 2, 3, 4], [1, 3, 4, 2]])
    assert crit(ids, None).tolist() == [True, False]


def test_dflash_cache_and_candidate_generator_exist_and_crop_the_block():
    from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator  # noqa: F401

    assert hasattr(DFlashCache, "set_previous_accepted_tokens")
    target = make_target("qwen3", seed=1)
    drafter = make_drafter(target, block_size=4)
    cache = DFlashCache(config=drafter.config)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        ctx = drafter.select_context(target(ids, output_hidden_states=True).hidden_states)
        block = torch.tensor([[9] + [drafter.config.mask_token_id] * 3])
        drafter(noise_embeds=drafter.embed(block), context_hidden_states=ctx, position_ids=torch.arange(9)[None],
                past_key_values=cache)
    assert cache.get_seq_length() == 5 + 4  # context and block K/V appended
    cache.crop(-4)
    assert cache.get_seq_length() == 5  # the block is discarded, the context stays


def test_dflash_candidate_generator_state_and_contract_we_build_on():
    """`AdaFlashCandidateGenerator` reuses the parent's `__init__` state and is called as the parent is."""
    from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

    called_with = inspect.signature(DFlashTokenCandidateGenerator.get_candidates).parameters
    for name in ("input_ids", "model_kwargs", "model_outputs", "is_first_iteration", "n_last_matches"):
        assert name in called_with, name
    assert getattr(GenerationMixin._get_candidate_generator, "__adaflash_hook__", False)
    hooked = inspect.signature(GenerationMixin._get_candidate_generator).parameters  # the original's
    for name in ("generation_config", "assistant_model", "logits_processor"):
        assert name in hooked, name
    target = make_target("qwen3", seed=4)
    drafter = make_drafter(target, block_size=4)
    gen = DFlashTokenCandidateGenerator(drafter, target.get_input_embeddings(), target.get_output_embeddings(),
                                        GenerationConfig(max_length=20, do_sample=True), LogitsProcessorList())
    assert gen.requires_model_outputs and isinstance(gen.cache, DFlashCache) and gen.is_main_model_prefill
    assert gen.model_kwargs_overrides == {"output_hidden_states": [i + 1 for i in drafter.config.target_layer_ids]}
    assert gen.noise_ids_mask.tolist() == [[drafter.config.mask_token_id] * 3]
    assert (gen.block_size, gen.main_model_max_length, gen.do_sample) == (4, 20, True)


def test_dynamic_cache_crop_and_batch_select():
    target = make_target("llama", seed=2)
    ids = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15]])
    with torch.no_grad():
        cache = target(ids, use_cache=True).past_key_values
    assert isinstance(cache, DynamicCache) and cache.get_seq_length() == 5
    keys = cache.layers[0].keys.clone()
    cache.crop(0)  # the loop crops -(rejected) which may be -0: must be a no-op
    assert cache.get_seq_length() == 5
    cache.crop(-2)
    assert cache.get_seq_length() == 3 and torch.equal(cache.layers[0].keys, keys[:, :, :3])
    cache.batch_select_indices(torch.tensor([0, 2]))
    assert torch.equal(cache.layers[0].keys, keys[[0, 2], :, :3])
    with pytest.raises(ValueError):
        cache.crop(2)  # positive sizes (the old absolute form) are refused in 5.x


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_output_hidden_states_list_returns_listed_layers_at_their_indices(family):
    target = make_target(family, seed=3, layers=4)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        full = target(ids, output_hidden_states=True).hidden_states
        picked = target(ids, output_hidden_states=[1, 3]).hidden_states
    assert len(full) == len(picked) == 5
    for i in range(5):
        if i in (1, 3):
            assert torch.equal(picked[i], full[i])
        else:
            assert picked[i] is None


@pytest.mark.parametrize("version", ["6.0.0", "4.57.1", "7.1.0.dev0"])
def test_untested_major_version_is_refused_by_name(version):
    with pytest.raises(ImportError, match=rf"found {version}.*untested major"):
        check_transformers_version(version)


@pytest.mark.parametrize("version", ["5.23.0", "5.23.1", "5.30.0.dev0"])
def test_tested_major_version_passes(version):
    check_transformers_version(version)
    assert 5 in {major for major, _ in TESTED_TRANSFORMERS}
