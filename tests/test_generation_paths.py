"""`generate(assistant_model=drafter)` beyond greedy identity (SPEC sections 1-3): sampling follows the target's
exact distribution (with negative controls), errors before decoding, a NaN drafter, other assistants left to
transformers, `custom_generate`, the round sink, and transformers' own assisted loop. CPU, tiny random targets."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from generation_helpers import (
    Collect,
    FlatDrafter,
    PAD_ID,
    char_tokenizer,
    force_length_head,
    make_drafter,
    make_oracle,
    make_target,
    ragged_prompts,
    unpad,
)
from transformers import LogitsProcessorList, Qwen3ForCausalLM, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.generation.utils import GenerationMixin

import adaflash_hf
import adaflash_hf.speculation.acceptance as acceptance
import adaflash_hf.generation.decoding as decoding
import adaflash_hf.speculation.prompt_ngrams as prompt_ngrams
import adaflash_hf.speculation.verify as verify
from adaflash_hf import AdaFlashDrafter
from adaflash_hf.generation import AdaFlashCandidateGenerator, hf_integration
from adaflash_hf.speculation.acceptance import AcceptResult
from adaflash_hf.generation.hf_integration import install_generate_hook
from generation_checks import MAX_NEW, target_model, plain, spec, first_unique


# --------------------------------------------------------------------------- 2. sampling is lossless
SV = 12  # tiny vocabulary: the target's distribution over a few tokens is far from degenerate
TEMP, TOP_K, TOP_P = 0.9, 8, 0.95
S_PROMPT = torch.tensor([[3, 7, 1, 5]])
S_NEW = 4


@functools.lru_cache(maxsize=None)
def sampling_setup():
    """Tiny target, its exact (processed) joint distribution of the first 4 tokens, and a drafter."""
    target = make_target("qwen3", seed=5, vocab=SV, layers=2, initializer_range=0.3)
    proc = LogitsProcessorList([TemperatureLogitsWarper(TEMP), TopKLogitsWarper(TOP_K), TopPLogitsWarper(TOP_P)])
    joint = torch.ones(1, dtype=torch.float64)
    prefixes = S_PROMPT
    for _ in range(S_NEW):  # p(x_t | prompt, x_<t) for every prefix, by plain forward passes
        with torch.no_grad():
            logits = target(prefixes).logits[:, -1].float()
        p = proc(prefixes, logits).softmax(-1).double()
        joint = (joint[:, None] * p).reshape(-1)
        prefixes = torch.cat([prefixes.repeat_interleave(SV, 0), torch.arange(SV).repeat(prefixes.shape[0])[:, None]], 1)
    joint = joint.view([SV] * S_NEW)
    torch.manual_seed(1)
    drafter = FlatDrafter.from_target(target, num_layers=1, block_size=4, mask_token_id=SV - 1).eval()
    # q: a flattened average of the target's second-token distributions, so drafts are often (not always) accepted
    drafter.q_logits = 0.5 * torch.log(joint.sum(dim=(0, 2, 3)).float() + 1e-2)
    return target, joint, drafter


def tv_and_bound(samples: torch.Tensor, joint: torch.Tensor, cols: tuple[int, ...], delta: float = 1e-3):
    """Total variation between the empirical and exact marginal of `cols`, and a bound it must stay under.

    E[TV] <= 1/2 sum sqrt(p(1-p)/N) (Jensen per cell); TV moves by <= 1/N per sample, so by McDiarmid
    P(TV > E[TV] + t) <= exp(-2 N t^2): t = sqrt(ln(1/delta) / (2N)).
    """
    n = samples.shape[0]
    other = [c for c in range(joint.dim()) if c not in cols]
    exact = joint.sum(dim=other) if other else joint
    idx = torch.zeros(n, dtype=torch.long)
    for c in cols:
        idx = idx * SV + samples[:, c]
    emp = torch.bincount(idx, minlength=SV ** len(cols)).double().view(exact.shape) / n
    tv = 0.5 * (emp - exact).abs().sum().item()
    bound = 0.5 * torch.sqrt(exact * (1 - exact) / n).sum().item() + math.sqrt(math.log(1 / delta) / (2 * n))
    return tv, bound


def _accept_everything(draft_tokens, draft_probs, target_probs, draft_len=None, generator=None):
    rows = torch.arange(draft_tokens.shape[0])
    nxt = torch.multinomial(target_probs[rows, draft_len], 1, generator=generator).squeeze(1)
    return AcceptResult(num_accepted=draft_len.clone(), next_tokens=nxt)


def _agree_keeping_drafter_q(drafts, candidates, q=None):
    """The prompt n-gram rule with its sampling half left out: candidates verified against the drafter's q."""
    new, _, used = prompt_ngrams.agree_with_drafts(drafts, candidates, None)
    return new, q, used


@pytest.mark.parametrize(
    "rule,n,ngrams",
    [("leviathan", 3000, None), ("leviathan", 3000, prompt_ngrams.PromptNgrams(4, sampled=True)),
     ("accept_every_draft", 1000, None), ("resample_from_p_not_residual", 3000, None),
     ("ngram_candidates_under_drafter_q", 3000, prompt_ngrams.PromptNgrams(4, sampled=True))],
)
def test_sampling_matches_the_exact_target_distribution(rule, n, ngrams, monkeypatch):
    target, joint, drafter = sampling_setup()
    if rule == "accept_every_draft":
        monkeypatch.setattr(verify, "speculative_accept", _accept_everything)
    elif rule == "resample_from_p_not_residual":
        monkeypatch.setattr(acceptance, "residual_distribution", lambda p, q: p)
    elif rule == "ngram_candidates_under_drafter_q":
        monkeypatch.setattr(decoding, "agree_with_drafts", _agree_keeping_drafter_q)
    torch.manual_seed(123)
    out, stats = target.generate(
        S_PROMPT.expand(n, -1), attention_mask=torch.ones(n, S_PROMPT.shape[1], dtype=torch.long),
        assistant_model=drafter, do_sample=True, temperature=TEMP, top_k=TOP_K, top_p=TOP_P,
        max_new_tokens=S_NEW, pad_token_id=SV - 2, length_policy="fixed", return_stats=True, prompt_ngrams=ngrams,
    )
    # the prompt n-gram rule (one-hot proposals at its candidate's later positions) runs in a good share of rounds
    # when asked to under sampling, and never by default
    assert (stats.ngram_rounds > 0.1 * n) if ngrams is not None else stats.ngram_rounds == 0
    samples = out[:, S_PROMPT.shape[1]:]
    assert samples.shape == (n, S_NEW)
    # both branches of the rule are exercised: drafts are accepted and rejected in good numbers
    first_round = stats.accepted[:n]
    assert stats.verify_lengths[:n] == [3] * n
    if rule != "accept_every_draft":
        assert 0.2 * n < sum(a > 0 for a in first_round) < 0.9 * n

    checks = {cols: tv_and_bound(samples, joint, cols) for cols in [(0, 1), (1, 2), (2, 3), (0, 1, 2), (1, 2, 3)]}
    ok = all(tv <= bound for tv, bound in checks.values())
    if rule == "leviathan":
        assert ok, checks
    else:  # the negative control: a wrong acceptance rule must fail the very same check
        assert not ok, checks


@pytest.mark.parametrize("fast_path", [False, True])
def test_num_return_sequences_samples_each_prompt_that_many_times(fast_path):
    """``num_return_sequences=n`` under sampling is the call with each prompt's row repeated n times, draw for draw
    (same seed); the rows' independence is what the distribution test above checks on repeated prompts."""
    target, _, drafter = sampling_setup()
    ids = torch.tensor([[3, 7, 1, 5], [SV - 2, 2, 9, 4]])  # the second left-padded
    mask = (ids != SV - 2).long()
    kw = dict(assistant_model=drafter, do_sample=True, temperature=TEMP, top_k=TOP_K, max_new_tokens=6,
              pad_token_id=SV - 2, fast_path=fast_path)
    torch.manual_seed(7)
    out = target.generate(ids, attention_mask=mask, num_return_sequences=3, **kw)
    torch.manual_seed(7)
    ref = target.generate(ids.repeat_interleave(3, 0), attention_mask=mask.repeat_interleave(3, 0), **kw)
    assert out.shape == (6, 10) and torch.equal(out, ref)
    assert torch.equal(out[:, :4], ids.repeat_interleave(3, 0))
    torch.manual_seed(8)
    assert not torch.equal(target.generate(ids, attention_mask=mask, num_return_sequences=3, **kw), out)  # control: a new seed


# --------------------------------------------------------------------------- 3. errors before decoding
def _err_cases():
    return [
        ("beam search", lambda t: dict(assistant_model=make_drafter(t), num_beams=2), r"beam search"),
        ("greedy num_return_sequences", lambda t: dict(assistant_model=make_drafter(t), num_return_sequences=2), r"num_return_sequences"),
        ("dtype", lambda t: dict(assistant_model=make_drafter(t).to(torch.float64)), r"float64.*float32"),
        ("hidden size", lambda t: dict(assistant_model=make_drafter(make_target("qwen3", hidden=64))), r"hidden size: target 32, drafter 64"),
        ("layer count", lambda t: dict(assistant_model=make_drafter(make_target("qwen3", layers=4))), r"layer count"),
        ("vocabulary", lambda t: dict(assistant_model=make_drafter(make_target("qwen3", vocab=64))), r"vocabulary: target 128, drafter 64"),
        ("policy", lambda t: dict(assistant_model=make_drafter(t), length_policy="longest"), r"unknown length_policy 'longest'"),
        ("no head", lambda t: dict(assistant_model=make_drafter(t, use_length_head=False), length_policy="adaptive"), r"length head"),
        ("options without drafter", lambda t: dict(length_policy="fixed", length_min=2), r"length_policy, length_min need an AdaFlash drafter"),
        ("stats without drafter", lambda t: dict(return_stats=True), r"return_stats need an AdaFlash drafter"),
        ("output_attentions", lambda t: dict(assistant_model=make_drafter(t), output_attentions=True, return_dict_in_generate=True),
         r"output_attentions .* rejected draft tokens"),
        ("adaflash route stats", lambda t: dict(assistant_model=make_drafter(t), speculation_type="adaflash", return_stats=True),
         r"return_stats need adaflash-hf's own loop"),
        ("guidance", lambda t: dict(assistant_model=make_drafter(t), guidance_scale=1.5),
         r"UnbatchedClassifierFreeGuidanceLogitsProcessor is not supported .*guidance_scale"),
        ("adaflash route without drafter", lambda t: dict(assistant_model=make_target("qwen3", seed=71, layers=1), speculation_type="adaflash"),
         r'speculation_type="adaflash" needs an AdaFlash drafter'),
    ]


@pytest.mark.parametrize("name,build,message", _err_cases(), ids=[c[0] for c in _err_cases()])
def test_errors_before_any_decoding(name, build, message):
    target = target_model("qwen3", 70)
    kwargs = build(target)
    calls = []
    handles = [target.register_forward_pre_hook(lambda *a: calls.append("target"))]
    if isinstance(kwargs.get("assistant_model"), AdaFlashDrafter):
        handles.append(kwargs["assistant_model"].register_forward_pre_hook(lambda *a: calls.append("drafter")))
    try:
        with pytest.raises(ValueError, match=message):
            target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=5, pad_token_id=PAD_ID, **kwargs)
    finally:
        for h in handles:
            h.remove()
    assert calls == []  # refused before the first forward


# --------------------------------------------------------------------------- 4. NaN drafter
@pytest.mark.parametrize("family,policy,batch", [("qwen3", "fixed", 1), ("llama", "adaptive", 3), ("qwen3", "expected_gain", 3)])
def test_nan_drafter_falls_back_to_plain_decoding(family, policy, batch):
    target = target_model(family, 80)
    ids, mask, _ = ragged_prompts(batch, [5, 8, 3], 80)
    drafter = make_drafter(target, block_size=8)
    with torch.no_grad():
        drafter.fc.weight.fill_(float("nan"))
    ref = plain(target, ids, mask)
    out, stats = spec(target, drafter, ids, mask, length_policy=policy)
    assert torch.equal(out, ref)
    assert stats.rounds == batch * (MAX_NEW - 1) > 0
    # every round that drafted fell back; a row's last token is decoded without the drafter (nothing to verify)
    assert stats.fallback_rounds == stats.rounds - batch
    assert stats.verify_lengths == [1] * stats.rounds


# --------------------------------------------------------------------------- 5. other assistants untouched
def test_regular_assistant_model_still_uses_transformers_assisted_decoding():
    target = target_model("qwen3", 90)
    assistant = make_target("qwen3", seed=91, layers=1)
    ids = torch.tensor([[5, 9, 2, 7]])
    calls = []
    assistant.register_forward_pre_hook(lambda *a: calls.append(1))
    out = target.generate(ids, assistant_model=assistant, do_sample=False, max_new_tokens=12)
    assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=12))
    assert calls  # transformers' own assisted loop really ran the assistant


def test_native_dflash_path_is_left_to_transformers(monkeypatch):
    target = target_model("llama", 92)
    ids = torch.tensor([[5, 9, 2, 7]])
    ours = []
    monkeypatch.setattr(hf_integration, "adaflash_decoding", lambda *a, **k: ours.append(1))
    out = target.generate(ids, assistant_model=make_drafter(target), speculation_type="dflash", do_sample=False, max_new_tokens=10)
    assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=10))
    assert ours == []


@pytest.mark.parametrize("name", ["generate", "_get_candidate_generator"])
def test_generate_hook_is_idempotent(name):
    hooked = getattr(GenerationMixin, name)
    assert getattr(hooked, "__adaflash_hook__", False)
    install_generate_hook()
    install_generate_hook()
    assert getattr(GenerationMixin, name) is hooked
    assert not getattr(hooked.__wrapped__, "__adaflash_hook__", False)  # one wrapper, around the original
    assert getattr(Qwen3ForCausalLM, name) is hooked


# --------------------------------------------------------------------------- 6. custom_generate
@pytest.mark.parametrize("family,batch", [("qwen3", 1), ("llama", 3)])
def test_custom_generate_equals_plain(family, batch):
    target = target_model(family, 100)
    ids, mask, _ = ragged_prompts(batch, [6, 3, 8], 100)
    drafter = make_drafter(target, block_size=4)
    ref = plain(target, ids, mask)
    out = target.generate(
        ids, attention_mask=mask, custom_generate=adaflash_hf.adaflash_decoding, drafter=drafter,
        do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=PAD_ID,
    )
    assert torch.equal(out, ref)
    out, stats = target.generate(
        ids, attention_mask=mask, custom_generate=adaflash_hf.adaflash_decoding, drafter=drafter, do_sample=False,
        max_new_tokens=MAX_NEW, pad_token_id=PAD_ID, length_policy="fixed", length_min=2, return_stats=True,
    )
    assert torch.equal(out, ref) and stats.policy == "fixed" and stats.verify_lengths[0] == 4


def test_custom_generate_with_stop_strings():
    target = target_model("qwen3", 101)
    ids = torch.tensor([[4, 8, 15, 16, 23]])
    cont = plain(target, ids)[0, 5:].tolist()
    tok, chars = char_tokenizer()
    i = first_unique(cont, 3, 8)
    kw = dict(stop_strings=chars[cont[i - 1]] + chars[cont[i]], tokenizer=tok)
    ref = plain(target, ids, **kw)
    assert ref.shape[1] - 5 < MAX_NEW
    out = target.generate(ids, custom_generate=adaflash_hf.adaflash_decoding, drafter=make_drafter(target), do_sample=False,
                          max_new_tokens=MAX_NEW, pad_token_id=PAD_ID, **kw)
    assert torch.equal(out, ref)


# --------------------------------------------------------------------------- 7. RoundSink
def _check_sink(sink, stats, out, mask, vocab):
    assert len(sink.rounds) == stats.rounds > 0
    assert [r.verify_len for r in sink.rounds] == stats.verify_lengths
    assert [r.num_accepted for r in sink.rounds] == stats.accepted
    assert [r.row for r in sink.rounds] == stats.rows
    rows = unpad(out, mask)
    for r in sink.rounds:
        seq, c = rows[r.row].tolist(), len(r.context_ids)
        assert r.context_ids.tolist() == seq[:c] and r.bonus_token == seq[c]  # padding removed, real prefix
        assert r.draft_tokens.shape == (r.verify_len - 1,) and r.draft_logits.shape == (r.verify_len - 1, vocab)
        assert r.target_logits.shape == (r.verify_len, vocab)
        assert r.draft_tokens[: r.num_accepted].tolist() == seq[c + 1 : c + 1 + r.num_accepted]  # accepted = committed


def test_round_sink_greedy_batch():
    target = target_model("llama", 110)
    ids, mask, _ = ragged_prompts(3, [3, 8, 5], 110)
    ref = plain(target, ids, mask)
    sink = Collect()
    drafter = make_oracle(target, unpad(ref, mask), block_size=8, correct_slots=2)
    out, stats = spec(target, drafter, ids, mask, length_policy="adaptive", round_sink=sink)
    assert torch.equal(out, ref)
    _check_sink(sink, stats, out, mask, 128)
    assert all(r.predicted_ratio is not None and 0 < r.predicted_ratio < 1 for r in sink.rounds)
    assert any(r.num_accepted == 2 for r in sink.rounds)


def test_round_sink_sampling_reports_the_sampled_drafts():
    target, _, drafter = sampling_setup()
    n = 6
    mask = torch.ones(n, S_PROMPT.shape[1] + 1, dtype=torch.long)
    mask[::2, 0] = 0  # ragged rows
    ids = torch.cat([torch.full((n, 1), 2), S_PROMPT.expand(n, -1)], 1)
    sink = Collect()
    torch.manual_seed(7)
    out, stats = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=True, temperature=TEMP,
                                 top_k=TOP_K, max_new_tokens=12, pad_token_id=SV - 2, length_policy="fixed",
                                 return_stats=True, round_sink=sink)
    _check_sink(sink, stats, out, mask, SV)
    assert sum(stats.accepted) > 0


# --------------------------------------------------------------------------- 8. transformers' own assisted loop
def spy_assisted(monkeypatch) -> list:
    """Count calls of transformers' `_assisted_decoding`."""
    calls, original = [], GenerationMixin._assisted_decoding

    def spy(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "_assisted_decoding", spy)
    return calls


def spy_candidates(monkeypatch) -> list[tuple[int, int]]:
    """Per drafting round of the transformers route: (drafts proposed, tokens the budget allowed)."""
    rounds, original = [], AdaFlashCandidateGenerator.get_candidates

    def spy(self, input_ids, model_kwargs, model_outputs, is_first_iteration, n_last_matches, **kwargs):
        out = original(self, input_ids, model_kwargs, model_outputs, is_first_iteration, n_last_matches, **kwargs)
        if not is_first_iteration:  # the first call only lets the target prefill
            rounds.append((out[0].shape[1] - input_ids.shape[1], self.main_model_max_length - input_ids.shape[1] - 1))
        return out

    monkeypatch.setattr(AdaFlashCandidateGenerator, "get_candidates", spy)
    return rounds


# (family, seed, block, policy, head, rate, drafter, drafts): drafts = k_hat - 1 each round, before the budget cuts it
HF_ROUTE_CASES = [
    ("qwen3", 120, 8, "fixed", None, 1.0, "oracle", 7),
    ("llama", 121, 4, "fixed", None, 1.0, "random", 3),
    ("llama", 122, 8, "adaptive", "high", 0.5, "oracle", 3),  # k_hat = floor(1 * 8 * 0.5) = 4
    ("qwen3", 123, 16, "adaptive", "high", 1.0, "oracle", 15),
    ("qwen3", 124, 8, "adaptive", "low", 1.0, "oracle", 0),  # k_hat = 1: plain decoding steps
    ("llama", 125, 8, "fixed", None, 1.0, "nan", 0),  # non-finite draft logits: no candidates
]


@pytest.mark.parametrize("family,seed,block,policy,head,rate,kind,drafts", HF_ROUTE_CASES)
def test_transformers_route_is_lossless_and_proposes_k_hat_minus_one(family, seed, block, policy, head, rate, kind, drafts, monkeypatch):
    target = target_model(family, seed)
    ids, mask, _ = ragged_prompts(1, [6], seed)
    ref = plain(target, ids, mask)
    if kind == "oracle":
        drafter = make_oracle(target, unpad(ref, mask), block_size=block)
    else:
        drafter = make_drafter(target, block_size=block, seed=seed)
    if head is not None:
        force_length_head(drafter, ratio_high=head == "high")
    if kind == "nan":
        with torch.no_grad():
            drafter.fc.weight.fill_(float("nan"))
    assisted, rounds = spy_assisted(monkeypatch), spy_candidates(monkeypatch)

    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, speculation_type="adaflash", do_sample=False,
                          max_new_tokens=MAX_NEW, pad_token_id=PAD_ID, length_policy=policy, length_rate=rate)

    assert torch.equal(out, ref)
    assert assisted == [1]  # transformers' own loop ran it
    assert rounds[0][0] == drafts
    assert [n for n, _ in rounds] == [min(drafts, max(budget, 0)) for _, budget in rounds]
    if kind == "oracle" and drafts:  # accepted: far fewer verify rounds than tokens
        assert len(rounds) <= MAX_NEW // 2
    else:
        assert len(rounds) >= MAX_NEW - 1


def test_default_route_is_ours(monkeypatch):
    target = target_model("qwen3", 126)
    ids = torch.tensor([[5, 9, 2, 7]])
    assisted, rounds = spy_assisted(monkeypatch), spy_candidates(monkeypatch)
    out, stats = target.generate(ids, assistant_model=make_drafter(target, block_size=4), do_sample=False, max_new_tokens=10,
                                 return_stats=True)
    assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=10))
    assert assisted == [] and rounds == [] and stats.rounds > 0
