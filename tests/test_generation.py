"""Lossless AdaFlash generation through `generate(assistant_model=drafter)` (issue 3, SPEC sections 1-3): greedy
identity, batches, stopping conditions, processors, streamers, scores and hidden states.

CPU only, tiny random Qwen3 / Llama targets. Greedy output must equal plain `generate` token for
token; sampled output must follow the target's exact distribution (with negative controls that
break the acceptance rule and must fail the same check). An oracle drafter (see
`generation_helpers.OracleDrafter`) is accepted for real, so stopping conditions land inside
verified blocks and the stats can be checked exactly.
"""

from __future__ import annotations

import pytest
import torch
from generation_helpers import (
    PAD_ID,
    CollectingStreamer,
    char_tokenizer,
    force_length_head,
    make_drafter,
    make_oracle,
    ragged_prompts,
    unpad,
)

import adaflash_hf
from adaflash_hf import speculative_generate
from generation_checks import MAX_NEW, target_model, plain, spec, full_block_lengths, committed_per_round_ok, first_unique


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
    ("qwen3", 12, 6, 8, "cost", "high", "oracle", "sdpa", "full"),  # batch 1: a verify costs ~a plain step
    ("llama", 13, 7, 8, "cost", "low", "oracle", "sdpa", "no_drafts"),  # nothing expected accepted: plain decoding
    ("qwen3", 14, 5, 16, "cost", "high", "random", "eager", "rejected"),
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

    # An oracle's blocks are right whole: the prompt n-gram rule (tests/test_prompt_ngrams.py) would swap in
    # candidates that are not, so the stats checks below run the drafter alone; random drafters keep the default.
    out, stats = spec(target, drafter, ids, mask, length_policy=policy, prompt_ngrams=0 if kind != "random" else None)

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
    out, stats = spec(target, make_oracle(target, unpad(ref, mask), block_size=8), ids, mask, max_new_tokens=40, length_policy="fixed",
                      prompt_ngrams=0)  # the oracle alone (see test_greedy_identity)
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
        length_policy=policy, return_stats=True, prompt_ngrams=0 if kind != "random" else None, **kw,
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
    drafter = make_oracle(target, unpad(ref if oracle_ref is None else oracle_ref, mask), block_size=8)

    out, stats = spec(target, drafter, ids, mask, length_policy="fixed", prompt_ngrams=0, **kw)  # the oracle alone

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
