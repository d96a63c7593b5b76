"""Lossless AdaFlash generation through `generate(assistant_model=drafter)` (issue 3, SPEC sections 1-3).

CPU only, tiny random Qwen3 / Llama targets. Greedy output must equal plain `generate` token for
token; sampled output must follow the target's exact distribution (with negative controls that
break the acceptance rule and must fail the same check). An oracle drafter (see
`generation_helpers.OracleDrafter`) is accepted for real, so stopping conditions land inside
verified blocks and the stats can be checked exactly.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from generation_helpers import (
    MASK_ID,
    PAD_ID,
    CollectingStreamer,
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
import adaflash_hf.spec.acceptance as acceptance
import adaflash_hf.spec.verify as verify
from adaflash_hf import AdaFlashDrafter, speculative_generate
from adaflash_hf.generation import AdaFlashCandidateGenerator, hf_integration
from adaflash_hf.spec.acceptance import AcceptResult
from adaflash_hf.generation.hf_integration import install_generate_hook

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


# --------------------------------------------------------------------------- 1. greedy identity
# (family, seed, prompt_len, block, policy, head, drafter, attn, expect)
# head: None | "high" (ratio ~1) | "low" (ratio ~0); drafter: "oracle" | "oracle3" (right for 3
# slots) | "random"; expect: "full" (every draft accepted, full-block lengths), "first3",
# "no_drafts" (verify length 1 every round), "rejected" (tau ~1, drafts verified).
GREEDY_CASES = [
    ("qwen3", 0, 5, 4, "fixed", None, "oracle", "sdpa", "full"),
    ("llama", 1, 9, 8, "fixed", None, "oracle", "sdpa", "full"),
    ("qwen3", 2, 3, 16, "fixed", None, "oracle", "eager", "full"),
    ("llama", 3, 12, 16, "adaptive", "high", "oracle", "sdpa", "full"),
    ("qwen3", 4, 6, 8, "adaptive", "low", "oracle", "sdpa", "no_drafts"),
    ("llama", 5, 7, 4, "adaptive", "low", "random", "eager", "no_drafts"),
    ("qwen3", 6, 4, 8, "expected_gain", None, "oracle", "sdpa", "full"),
    ("llama", 7, 10, 16, "expected_gain", None, "random", "sdpa", "no_drafts"),
    ("qwen3", 8, 2, 8, "fixed", None, "random", "sdpa", "rejected"),
    ("llama", 9, 5, 16, "adaptive", "high", "random", "sdpa", "rejected"),
    ("qwen3", 10, 8, 8, "fixed", None, "oracle3", "sdpa", "first3"),
    ("llama", 11, 6, 4, "adaptive", None, "oracle", "eager", "some"),
]


@pytest.mark.parametrize("family,seed,prompt_len,block,policy,head,kind,attn,expect", GREEDY_CASES)
def test_greedy_identity(family, seed, prompt_len, block, policy, head, kind, attn, expect):
    target = target_model(family, seed, attn)
    ids, mask, _ = ragged_prompts(1, [prompt_len], seed)
    ref = plain(target, ids, mask)
    if kind == "random":
        drafter = make_drafter(target, block_size=block, seed=seed)
    else:
        drafter = make_oracle(target, unpad(ref, mask), block_size=block, correct_slots=3 if kind == "oracle3" else None)
    if head is not None:
        force_length_head(drafter, ratio_high=head == "high")

    out, stats = spec(target, drafter, ids, mask, length_policy=policy)

    assert torch.equal(out, ref)
    assert stats.new_tokens == MAX_NEW and committed_per_round_ok(stats, MAX_NEW)
    assert stats.policy == policy and stats.fallback_rounds == 0
    if expect == "full":  # the stats are real: an oracle is accepted whole, every round
        assert stats.verify_lengths == full_block_lengths(stats, block, MAX_NEW)
        assert stats.accepted == [v - 1 for v in stats.verify_lengths]
        assert stats.tau >= min(block, 8) * 0.75
    elif expect == "first3":
        assert stats.verify_lengths == full_block_lengths(stats, block, MAX_NEW)
        assert stats.accepted == [min(3, v - 1) for v in stats.verify_lengths]
    elif expect == "no_drafts":  # ratio ~0 (or no confident draft): nothing verified, still identical
        assert stats.verify_lengths == [1] * (MAX_NEW - 1)
        assert stats.accepted == [0] * (MAX_NEW - 1) and stats.tau == 1.0
    elif expect == "rejected":  # random drafts are verified and (almost) never accepted
        assert stats.verify_lengths == full_block_lengths(stats, block, MAX_NEW)
        assert stats.verify_lengths[0] == block
        assert stats.tau <= 1.3
    elif expect == "some":  # an untrained head: somewhere between the extremes, oracle drafts accepted
        assert all(1 <= v <= block for v in stats.verify_lengths)
        assert stats.accepted == [v - 1 for v in stats.verify_lengths]
        assert stats.tau > 1.0


def test_oracle_fixed_block8_reaches_tau_of_the_verify_length():
    target = target_model("qwen3", 21)
    ids, mask, _ = ragged_prompts(1, [6], 21)
    ref = plain(target, ids, mask, max_new_tokens=40)
    out, stats = spec(target, make_oracle(target, unpad(ref, mask), block_size=8), ids, mask, max_new_tokens=40, length_policy="fixed")
    assert torch.equal(out, ref)
    assert stats.tau >= 6 and stats.position_acceptance[:6] == [1.0] * 6
    out, stats = spec(target, make_drafter(target, block_size=8), ids, mask, max_new_tokens=40, length_policy="fixed")
    assert torch.equal(out, ref)
    assert stats.tau < 1.3 and stats.mean_verify_length > 4


# --------------------------------------------------------------------------- batches
# (family, seed, prompt lengths (one per row), block, policy, drafter, eos)
BATCH_CASES = [
    ("qwen3", 30, [6], 8, "fixed", "oracle", False),
    ("llama", 31, [4], 16, "fixed", "random", True),
    ("qwen3", 32, [3, 9, 5], 4, "adaptive", "oracle", False),
    ("llama", 33, [7, 2, 4], 16, "fixed", "random", True),
    ("qwen3", 34, [2, 11, 5, 8, 3, 7, 9, 4], 8, "expected_gain", "oracle", True),
    ("llama", 35, [5, 1, 12, 6, 6, 3, 10, 2], 16, "fixed", "oracle", False),
    ("qwen3", 36, [4, 8, 2, 6, 9, 3, 5, 7], 4, "fixed", "random", False),
]


@pytest.mark.parametrize("family,seed,lengths,block,policy,kind,eos", BATCH_CASES)
def test_batch_rows_equal_rows_alone(family, seed, lengths, block, policy, kind, eos):
    target = target_model(family, seed)
    batch = len(lengths)
    ids, mask, rows = ragged_prompts(batch, lengths, seed)
    kw = {}
    ref = free = plain(target, ids, mask)
    if eos:  # row 0 stops mid-way, the others run on (or stop at their own occurrence)
        first = ref[0, ids.shape[1]:].tolist()
        kw["eos_token_id"] = first[first_unique(first, 3, MAX_NEW)]
        ref = plain(target, ids, mask, **kw)
        assert ref.shape[1] - ids.shape[1] <= MAX_NEW and int(kw["eos_token_id"]) in ref[0].tolist()
    drafter = (
        make_drafter(target, block_size=block, seed=seed)
        if kind == "random"
        else make_oracle(target, unpad(free, mask), block_size=block)  # it drafts on past an EOS, as the target would
    )

    out, stats = speculative_generate(
        target, drafter, ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=PAD_ID,
        length_policy=policy, return_stats=True, **kw,
    )

    assert torch.equal(out, ref)  # the batch equals plain batched generate
    emitted = []
    for i, row in enumerate(rows):  # and each row equals that row generated alone
        alone = plain(target, row[None], **kw)[0]
        got = unpad(out, mask)[i]
        assert torch.equal(got[: alone.shape[0]], alone)
        assert (got[alone.shape[0]:] == PAD_ID).all()
        emitted.append(alone.shape[0] - row.shape[0])
    assert sorted(set(stats.rows)) == list(range(batch))
    assert all(1 <= v <= block for v in stats.verify_lengths)
    for i in range(batch):  # rounds count emitted tokens: the prefill's first token + (accepted + 1) per round
        assert 1 + sum(a + 1 for r, a in zip(stats.rows, stats.accepted) if r == i) == emitted[i]
    if kind == "oracle":  # the stats are real: every round but a row's last (it may stop inside) is accepted whole
        for i in range(batch):
            mine = [(a, v) for r, a, v in zip(stats.rows, stats.accepted, stats.verify_lengths) if r == i]
            assert all(a == v - 1 for a, v in mine[:-1]) and mine[-1][0] <= mine[-1][1] - 1
        if policy == "fixed":
            assert stats.tau >= min(block, MAX_NEW / 2) * 0.5
    else:
        assert stats.tau <= 1.3


# --------------------------------------------------------------------------- stopping conditions, processors
STOP_CASES = ["max_new_inside_block", "eos_mid_block", "eos_mid_block_batch", "min_new_tokens", "repetition_penalty", "stop_strings"]


def first_fresh_ngram(tokens: list[int], n: int, lo: int, hi: int) -> int:
    """End index in [lo, hi) of an n-gram that does not occur earlier in `tokens`."""
    for i in range(max(lo, n - 1), hi):
        gram = tokens[i - n + 1 : i + 1]
        if all(tokens[j - n + 1 : j + 1] != gram for j in range(n - 1, i)):
            return i
    raise AssertionError(f"no fresh {n}-gram ending in {lo}..{hi} of {tokens}")


def _stop_case(case, target, ids, mask):
    """Generate kwargs for `case`, and the greedy continuation the oracle should draft from.

    For EOS and stop strings the oracle follows the target *past* the stop (what the verify forward
    will agree with), so the stop falls inside a block that was accepted whole.
    """
    p = ids.shape[1]
    free = plain(target, ids, mask)
    cont = free[0, p:].tolist()
    if case == "max_new_inside_block":
        return {"max_new_tokens": 11}, free
    if case in ("eos_mid_block", "eos_mid_block_batch"):
        return {"eos_token_id": cont[first_fresh_ngram(cont, 1, 3, 7)]}, free
    if case == "min_new_tokens":
        eos = cont[first_fresh_ngram(cont, 1, 1, 3)]
        kw = {"eos_token_id": eos, "min_new_tokens": 9}
        out = plain(target, ids, mask, **kw)
        assert out.shape[1] - p >= 9 and not torch.equal(out, plain(target, ids, mask, eos_token_id=eos))
        return kw, None
    if case == "repetition_penalty":
        kw = {"repetition_penalty": 1.5}
        assert not torch.equal(plain(target, ids, mask, **kw), free)  # the processor matters here
        return kw, None
    if case == "stop_strings":
        tok, chars = char_tokenizer()
        i = first_fresh_ngram(cont, 3, 3, 7)
        return {"stop_strings": "".join(chars[t] for t in cont[i - 2 : i + 1]), "tokenizer": tok}, free
    raise AssertionError(case)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("case", STOP_CASES)
def test_stopping_and_processors_inside_accepted_blocks(case, family):
    seed = 40 + STOP_CASES.index(case)
    target = target_model(family, seed)
    batch_lengths = [7, 4, 9] if case.endswith("batch") else [7]
    ids, mask, _ = ragged_prompts(len(batch_lengths), batch_lengths, seed)
    kw, oracle_ref = _stop_case(case, target, ids, mask)
    ref = plain(target, ids, mask, **kw)
    max_new = kw.get("max_new_tokens", MAX_NEW)
    drafter = make_oracle(target, unpad(ref if oracle_ref is None else oracle_ref, mask), block_size=8)

    out, stats = spec(target, drafter, ids, mask, length_policy="fixed", **kw)

    assert torch.equal(out, ref)
    new = ref.shape[1] - ids.shape[1]
    for i in range(len(batch_lengths)):  # every round but a row's last is accepted whole (the oracle knows
        mine = [(a, v) for r, a, v in zip(stats.rows, stats.accepted, stats.verify_lengths) if r == i]
        assert all(a == v - 1 for a, v in mine[:-1])  # the processed output only up to where it stopped)
    if case == "max_new_inside_block":
        assert new == 11 and stats.verify_lengths == [8, 2]  # the last block is cut to the budget
    if case in ("eos_mid_block", "eos_mid_block_batch", "stop_strings"):
        # row 0 stops early, inside a block the target accepted whole: the stats count what it emitted
        cont = ref[0, ids.shape[1]:].tolist()
        kept = len(cont) if "eos_token_id" not in kw else cont.index(kw["eos_token_id"]) + 1
        assert kept < MAX_NEW
        row0 = [(a, v) for r, a, v in zip(stats.rows, stats.accepted, stats.verify_lengths) if r == 0]
        assert 1 + sum(a + 1 for a, _ in row0) == kept  # the prefill's token + each round's emitted tokens
        assert row0[-1][0] < row0[-1][1] - 1  # the stop cut the last block short
    if case == "eos_mid_block_batch":
        assert out.shape[1] - ids.shape[1] > kept and int(out[0, -1]) == PAD_ID  # others ran on; row 0 padded


@pytest.mark.parametrize("path", ["assistant_model", "custom_generate"])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_streamer_sees_the_same_tokens(family, path):
    target = target_model(family, 50)
    ids, mask, _ = ragged_prompts(1, [5], 50)
    ref_stream = CollectingStreamer()
    ref = plain(target, ids, mask, streamer=ref_stream)
    drafter = make_oracle(target, unpad(ref, mask), block_size=8)
    stream = CollectingStreamer()
    if path == "assistant_model":
        out, stats = spec(target, drafter, ids, mask, streamer=stream, length_policy="fixed")
    else:
        out, stats = target.generate(
            ids, attention_mask=mask, custom_generate=adaflash_hf.adaflash_decoding, drafter=drafter, streamer=stream,
            do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=PAD_ID, length_policy="fixed", return_stats=True,
        )
    assert torch.equal(out, ref) and stats.tau > 4
    assert stream.puts == ref_stream.puts and stream.ends == ref_stream.ends == 1


@pytest.mark.parametrize(
    "family,kind,extra",
    [("qwen3", "oracle", {"repetition_penalty": 1.3}), ("llama", "random", {}), ("llama", "oracle", {"min_new_tokens": 5, "eos": 0})],
)
def test_scores_and_logits_equal_plain(family, kind, extra):
    target = target_model(family, 60)
    ids, mask, _ = ragged_prompts(1, [6], 60)
    kw = dict(return_dict_in_generate=True, output_scores=True, output_logits=True, max_new_tokens=13, **extra)
    if "eos" in kw:  # the first greedy token is the EOS: min_new_tokens masks it (scores != logits)
        kw["eos_token_id"] = int(plain(target, ids, mask, max_new_tokens=1)[0, -1 - kw.pop("eos")])
    ref = plain(target, ids, mask, **kw)
    steps = ref.sequences.shape[1] - ids.shape[1]
    drafter = (
        make_drafter(target, block_size=8) if kind == "random" else make_oracle(target, unpad(ref.sequences, mask), block_size=8)
    )
    out, stats = spec(target, drafter, ids, mask, length_policy="fixed", **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) == steps >= 5 and len(out.logits) == steps
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    if extra:  # processed scores differ from raw logits here, so the right one was returned
        assert any(not torch.allclose(a, b) for a, b in zip(out.scores, out.logits))


# (family, route, prompt lengths, eos): route "ours" (the default) or "transformers"
# (speculation_type="adaflash", batch 1); with eos, row 0 stops after a few tokens, the others run on.
HIDDEN_CASES = [
    ("qwen3", "ours", [6], False),
    ("llama", "transformers", [5], False),
    ("llama", "ours", [7, 3, 9], False),
    ("qwen3", "ours", [7, 4, 9], True),
]


@pytest.mark.parametrize("family,route,lengths,eos", HIDDEN_CASES)
def test_hidden_states_equal_plain(family, route, lengths, eos):
    target = target_model(family, 62)
    ids, mask, _ = ragged_prompts(len(lengths), lengths, 62)
    free = plain(target, ids, mask)
    kw = dict(return_dict_in_generate=True, output_hidden_states=True)
    if eos:
        cont = free[0, ids.shape[1]:].tolist()
        kw["eos_token_id"] = cont[first_unique(cont, 3, 7)]
    ref = plain(target, ids, mask, **kw)
    drafter = make_oracle(target, unpad(free, mask), block_size=8)  # accepted whole: many tokens per verify forward
    route_kw = {"speculation_type": "adaflash"} if route == "transformers" else {}
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, do_sample=False, pad_token_id=PAD_ID,
                          max_new_tokens=MAX_NEW, length_policy="fixed", **route_kw, **kw)

    assert torch.equal(out.sequences, ref.sequences)
    steps, p = ref.sequences.shape[1] - ids.shape[1], ids.shape[1]
    assert len(out.hidden_states) == len(ref.hidden_states) == steps
    # each row's own steps: its tokens up to and including its EOS; later steps hold zeros (documented)
    own = [row.index(kw["eos_token_id"]) + 1 if eos and kw["eos_token_id"] in row else steps for row in ref.sequences[:, p:].tolist()]
    assert (min(own) < steps) == eos
    shape = (target.config.num_hidden_layers + 1, len(lengths), target.config.hidden_size)
    for t, (got, want) in enumerate(zip(out.hidden_states, ref.hidden_states)):
        assert len(got) == len(want) == shape[0]
        for g, w in zip(got, want):
            assert g.shape == w.shape == (shape[1], p if t == 0 else 1, shape[2])
            for r in range(len(lengths)):
                if t < own[r]:
                    torch.testing.assert_close(g[r], w[r], atol=1e-4, rtol=1e-4)
                else:
                    assert not g[r].any()


# --------------------------------------------------------------------------- 2. sampling is lossless
SV = 12  # tiny vocabulary: the target's distribution over a few tokens is far from degenerate
TEMP, TOP_K, TOP_P = 0.9, 8, 0.95
S_PROMPT = torch.tensor([[3, 7, 1, 5]])
S_NEW = 4


class FlatDrafter(AdaFlashDrafter):
    """A drafter with a fixed, deliberately wrong draft distribution `q` at every slot (not `p`)."""

    q_logits: torch.Tensor

    def compute_logits(self, hidden_states):
        raw = super().compute_logits(hidden_states)
        return raw * 0.0 + self.q_logits.to(raw.dtype)


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


@pytest.mark.parametrize(
    "rule,n",
    [("leviathan", 3000), ("accept_every_draft", 1000), ("resample_from_p_not_residual", 3000)],
)
def test_sampling_matches_the_exact_target_distribution(rule, n, monkeypatch):
    target, joint, drafter = sampling_setup()
    if rule == "accept_every_draft":
        monkeypatch.setattr(verify, "speculative_accept", _accept_everything)
    elif rule == "resample_from_p_not_residual":
        monkeypatch.setattr(acceptance, "residual_distribution", lambda p, q: p)
    torch.manual_seed(123)
    out, stats = target.generate(
        S_PROMPT.expand(n, -1), attention_mask=torch.ones(n, S_PROMPT.shape[1], dtype=torch.long),
        assistant_model=drafter, do_sample=True, temperature=TEMP, top_k=TOP_K, top_p=TOP_P,
        max_new_tokens=S_NEW, pad_token_id=SV - 2, length_policy="fixed", return_stats=True,
    )
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


# --------------------------------------------------------------------------- 3. errors before decoding
def _err_cases():
    return [
        ("beam search", lambda t: dict(assistant_model=make_drafter(t), num_beams=2), r"beam search"),
        ("num_return_sequences", lambda t: dict(assistant_model=make_drafter(t), num_return_sequences=2, do_sample=True), r"num_return_sequences"),
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
    assert stats.fallback_rounds == stats.rounds == batch * (MAX_NEW - 1) > 0
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
class Sink:
    def __init__(self):
        self.rounds = []

    def on_round(self, verified):
        self.rounds.append(verified)


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
    sink = Sink()
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
    sink = Sink()
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
