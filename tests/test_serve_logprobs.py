"""logprobs / top_logprobs, echo, prompt lists and presence / frequency penalties through the official `openai` client
against one real server on the reference pair (float32, CPU), with speculation on: every answer and logprob equals
plain transformers decoding of the reference target under the same penalties (an OpenAI-formula LogitsProcessor in
`generate`), within 1e-4; drafts are accepted meanwhile (the server's /metrics counts them)."""

from __future__ import annotations

import pytest
import torch

from adaflash_hf import load_reference_pair
from adaflash_hf.engine import Engine
from adaflash_hf.engine.sampling import SamplingParams

from reference_server import (TOL, OpenAIPenalties, accepted_drafts, check_chat_logprobs, check_completion_logprobs,
                              plain, start_reference_server)

PROMPTS = ["Once upon a time there was", "The little dog ran to the", "She opened the door and"]


@pytest.fixture(scope="module")
def srv():
    s = start_reference_server()
    yield s
    s["server"].close()


def teacher_forced(s, ids: list[int], gen: list[int], presence: float = 0.0, frequency: float = 0.0):
    """The processed logprobs [len(gen), V] plain decoding gives at each of `gen`'s positions (one forward)."""
    with torch.no_grad():
        logits = s["target"](torch.tensor([ids + gen])).logits[0, len(ids) - 1 : -1].float()
    proc = OpenAIPenalties(len(ids), presence, frequency)
    rows = [proc(torch.tensor([ids + gen[:i]]), logits[i : i + 1])[0] for i in range(len(gen))]
    return torch.stack(rows).log_softmax(-1)


def ids_of(s, text: str) -> list[int]:
    return s["tok"](text)["input_ids"]


@pytest.mark.parametrize("presence,frequency", [(0.0, 0.0), (1.2, 0.0), (-0.5, 0.7)])
def test_greedy_completions_with_logprobs_and_penalties_equal_plain_decoding(srv, presence, frequency):
    """Non-streamed, streamed and echoed answers: tokens, logprobs and top-3 alternatives equal `generate`'s; drafts
    were accepted (speculation stayed on)."""
    before, changed = accepted_drafts(srv), []
    for prompt in PROMPTS[:2]:
        ids = ids_of(srv, prompt)
        ref, ref_lp = plain(srv, ids, 24, presence, frequency)
        changed.append(bool(presence or frequency) and ref != plain(srv, ids, 24)[0])
        kw = dict(model="ref", prompt=prompt, max_tokens=24, temperature=0, logprobs=3, presence_penalty=presence,
                  frequency_penalty=frequency)
        check_completion_logprobs(srv, kw, ref, ref_lp, 3)
    assert accepted_drafts(srv) > before
    assert any(changed) == bool(presence or frequency)  # control: the penalties change the answers


def test_chat_logprobs_streamed_and_not_equal_plain_decoding(srv):
    messages = [{"role": "user", "content": "Tell me a story about a cat."}]
    ids = srv["server"].service.parse({"messages": messages}, "chat").prompts[0]
    ref, ref_lp = plain(srv, ids, 20, 0.4, 0.4)
    kw = dict(model="ref", messages=messages, max_tokens=20, temperature=0, logprobs=True, top_logprobs=2,
              presence_penalty=0.4, frequency_penalty=0.4)
    check_chat_logprobs(srv, kw, ref, ref_lp, 2)
    plain_chat = srv["client"].chat.completions.create(model="ref", messages=messages, max_tokens=4, temperature=0)
    assert plain_chat.choices[0].logprobs is None  # not asked: none


def test_sampled_logprobs_are_the_targets_and_seeds_reproduce(srv):
    """Sampled with a seed and penalties: each token's logprob is plain decoding's at that position of the sampled
    text (teacher forced); the same seed gives the same text, another seed another (control)."""
    ids = ids_of(srv, PROMPTS[2])
    kw = dict(model="ref", prompt=PROMPTS[2], max_tokens=20, temperature=0.8, logprobs=1, frequency_penalty=0.5)
    a = srv["client"].completions.create(**kw, seed=5).choices[0]
    b = srv["client"].completions.create(**kw, seed=5).choices[0]
    c = srv["client"].completions.create(**kw, seed=6).choices[0]
    assert a.text == b.text and a.text != c.text
    gen = srv["tok"](a.text, add_special_tokens=False)["input_ids"]
    assert srv["tok"].decode(gen) == a.text and len(gen) == len(a.logprobs.token_logprobs)
    ref = teacher_forced(srv, ids, gen, 0.0, 0.5)
    assert max(abs(v - float(ref[i, t])) for i, (t, v) in enumerate(zip(gen, a.logprobs.token_logprobs))) < TOL


def test_echo_gives_the_prompts_logprobs_with_max_tokens_0_and_1(srv):
    """lm-evaluation-harness' loglikelihood request: echo + logprobs, a batch of token-id prompts; the prompt's
    logprobs equal one plain forward's (the first token has none), each prompt its own choice index."""
    batch = [ids_of(srv, p) for p in PROMPTS]
    for max_tokens in (0, 1):
        res = srv["client"].completions.create(model="ref", prompt=batch, max_tokens=max_tokens, temperature=0,
                                               logprobs=1, echo=True)
        assert [c.index for c in res.choices] == [0, 1, 2]
        assert res.usage.prompt_tokens == sum(map(len, batch)) and res.usage.completion_tokens == max_tokens * 3
        for choice, ids in zip(res.choices, batch):
            lp = choice.logprobs
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            assert len(lp.token_logprobs) == len(ids) + max_tokens
            with torch.no_grad():
                ref = srv["target"](torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
            want = ref.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
            assert torch.allclose(torch.tensor(lp.token_logprobs[1 : len(ids)]), want, atol=TOL)
            greedy = [max(t.values()) == v for t, v in zip(lp.top_logprobs[1 : len(ids)], lp.token_logprobs[1 : len(ids)])]
            assert greedy == (ref.argmax(-1) == torch.tensor(ids[1:])).tolist()  # lm-eval's is_greedy
            assert choice.text.startswith(srv["tok"].decode(ids)) and lp.text_offset[0] == 0
            if max_tokens:
                assert choice.text == srv["tok"].decode(ids + plain(srv, ids, 1)[0])


def test_prompt_lists_number_choices_prompt_by_prompt(srv):
    """Two prompts x n = 2, streamed and not: choice p * 2 + j answers prompt p, each equal to plain greedy."""
    res = srv["client"].completions.create(model="ref", prompt=PROMPTS[:2], n=2, max_tokens=6, temperature=0)
    want = [srv["tok"].decode(plain(srv, ids_of(srv, p), 6)[0], skip_special_tokens=True) for p in PROMPTS[:2]]
    assert sorted(c.index for c in res.choices) == [0, 1, 2, 3]
    assert [c.text for c in sorted(res.choices, key=lambda c: c.index)] == [want[0], want[0], want[1], want[1]]
    texts = {}
    for chunk in srv["client"].completions.create(model="ref", prompt=PROMPTS[:2], n=2, max_tokens=6, temperature=0,
                                                  stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(4)] == [want[0], want[0], want[1], want[1]]


def test_engine_penalties_and_logprobs_under_sampling_are_the_processed_rows():
    """Engine level, every verify layout's rows and plain decoding's: a seeded sampled request's tokens carry the
    logprobs of plain decoding's processed rows at their positions; penalised greedy equals the penalised plain loop."""
    target, drafter, tok = load_reference_pair()
    s = {"target": target}
    ids = tok(PROMPTS[0])["input_ids"]
    for policy in ("fixed", "adaptive", "off"):  # off: no drafter, plain decoding's rows
        pair = (drafter, policy) if policy != "off" else (None, None)
        engine = Engine(target, pair[0], length_policy=pair[1], max_slots=4, max_len=96, token_budget=192)
        greedy = engine.submit(ids, 16, SamplingParams(presence_penalty=1.0, frequency_penalty=0.3, logprobs=0))
        sampled = engine.submit(ids, 16, SamplingParams(temperature=1.0, seed=3, presence_penalty=1.0, logprobs=0))
        g, r = greedy.result(), sampled.result()
        assert g.token_ids == plain(s, ids, 16, 1.0, 0.3)[0]
        ref = teacher_forced(s, ids, r.token_ids, 1.0, 0.0)
        assert [int(t) for t in r.logprobs] == r.token_ids
        assert max(abs(t.logprob - float(ref[i, t])) for i, t in enumerate(r.logprobs)) < TOL
        assert (sum(g.accepted) + sum(r.accepted) > 0) == (policy != "off")
