"""The prompt n-gram rule (`speculation.prompt_ngrams`): the candidate, the agree substitution, and identity with plain
decoding in every loop that applies it (generate's eager loop, the engine eager and static, packed layouts)."""

import pytest
import torch

from adaflash_hf.speculation.prompt_ngrams import NgramIndex, PromptNgrams, agree_wide, agree_with_drafts
from generation_helpers import plain_greedy_once


@pytest.mark.parametrize(
    "tokens, max_ngram, num_tokens, expected",
    [
        ([7, 1, 2, 3, 9, 1, 2], 2, 3, [3, 9, 1]),  # "1 2" at 1: what followed it
        ([7, 1, 2, 3, 9, 1, 2], 2, 10, [3, 9, 1, 2]),  # never past the list's end
        ([1, 2, 5, 8, 2, 6, 1, 2], 2, 2, [5, 8]),  # the 2-gram wins over the later 1-gram "2"
        ([1, 2, 5, 8, 2, 6, 3, 2], 2, 2, [5, 8]),  # no 2-gram match: the leftmost "2"
        ([1, 2, 5, 8, 2, 6, 3, 2], 1, 2, [5, 8]),
        ([4, 5, 6], 3, 4, []),  # no earlier occurrence
        ([4, 4], 2, 3, [4]),  # the suffix itself is never its own match
        ([1, 2, 3, 1, 2, 3, 1, 2], 3, 2, [3, 1]),  # leftmost occurrence of the longest n-gram
    ],
)
def test_candidate_table(tokens, max_ngram, num_tokens, expected):
    assert NgramIndex(tokens, max_ngram).candidates(num_tokens) == ([expected] if expected else [])  # one match: transformers' candidate


@pytest.mark.parametrize(
    "tokens, max_ngram, matches, num_tokens, expected",
    [
        ([5, 1, 4, 1, 2, 1], 1, 3, 2, [[4, 1], [2, 1]]),  # every earlier "1", leftmost first
        ([5, 1, 4, 1, 2, 1], 1, 1, 2, [[4, 1]]),  # one match: transformers' candidate
        ([1, 2, 5, 8, 2, 6, 1, 2], 2, 4, 2, [[5, 8], [6, 1]]),  # the 2-gram's, then the other "2"'s; each once
        ([3, 1, 2, 5, 1, 2], 2, 4, 3, [[5, 1, 2]]),  # "1 2" and "2" both continue at 3: one candidate
        ([7, 7, 7, 7], 1, 8, 2, [[7, 7], [7, 7], [7]]),  # the suffix is never its own match
        ([4, 5, 6], 2, 4, 2, []),
    ],
)
def test_candidates_table(tokens, max_ngram, matches, num_tokens, expected):
    assert NgramIndex(tokens, max_ngram, matches=matches).candidates(num_tokens) == expected


def test_candidate_follows_a_growing_list():
    tokens = [1, 2, 3]
    index = NgramIndex(tokens, 2)
    assert index.candidates(4) == []
    tokens.extend([9, 1, 2])  # the index reads the list it was given: appended tokens are indexed on demand
    assert index.candidates(4) == [[3, 9, 1, 2]]


@pytest.mark.parametrize(
    "drafts, candidates, expected, used",
    [
        ([[4, 5, 6]], [[[4, 8]]], [[4, 8, 6]], [True]),  # agrees: the candidate over its length, drafts after it
        ([[4, 5, 6]], [[[3, 8, 8]]], [[4, 5, 6]], [False]),  # first tokens differ: the drafter's block
        ([[4, 5, 6]], [[]], [[4, 5, 6]], [False]),  # no candidate
        ([[4, 5]], [[[4, 9, 9, 9]]], [[4, 9]], [True]),  # cut to the drafts' width
        ([[4, 5, 6], [1, 2, 3]], [[[4, 7, 7]], [[1, 0]]], [[4, 7, 7], [1, 0, 3]], [True, True]),
        ([[4, 5, 6, 0]], [[[3, 5, 6, 6], [4, 9, 9, 9], [4, 5, 7, 7]]], [[4, 5, 7, 7]], [True]),  # longest agreement
        ([[4, 5, 6, 0]], [[[4, 9, 1, 1], [4, 8, 2, 2]]], [[4, 9, 1, 1]], [True]),  # a tie: the earlier
        ([[4, 5, 6]], [[[4, 5]], [[4, 5, 6]]], None, None),  # candidates of two rows, one draft row: refused
    ],
)
def test_agree_table(drafts, candidates, expected, used):
    d = torch.tensor(drafts)
    if expected is None:
        with pytest.raises(ValueError, match="2 rows of candidates for 1 rows"):
            agree_with_drafts(d, candidates)
        return
    out, _, took = agree_with_drafts(d, candidates)
    assert out.tolist() == expected and took.tolist() == used
    assert d.tolist() == drafts  # the input is not modified


def test_sampled_rows_choose_by_the_first_draft_alone():
    """Under sampling the later drafts are random: the choice must not read them (the first agreeing candidate)."""
    q = torch.full((1, 4, 10), 0.1)
    cands = [[[4, 9, 9, 9], [4, 5, 6, 7]]]
    drafts, _, _ = agree_with_drafts(torch.tensor([[4, 5, 6, 7]]), cands, q)
    assert drafts.tolist() == [[4, 9, 9, 9]]
    greedy, _, _ = agree_with_drafts(torch.tensor([[4, 5, 6, 7]]), cands)  # control: greedy reads them
    assert greedy.tolist() == [[4, 5, 6, 7]]


def test_agree_makes_later_candidate_positions_one_hot():
    q = torch.full((1, 3, 5), 0.2)
    drafts, q2, used = agree_with_drafts(torch.tensor([[2, 0, 0]]), [[[2, 3]]], q)
    assert used.tolist() == [True] and drafts.tolist() == [[2, 3, 0]]
    assert torch.equal(q2[0, 0], q[0, 0])  # the first draft is the drafter's own sample: its q stays
    assert q2[0, 1].tolist() == [0, 0, 0, 1, 0]  # the candidate's token, deterministic given the first
    assert torch.equal(q2[0, 2], q[0, 2])  # past the candidate: the drafter's again
    _, q3, _ = agree_with_drafts(torch.tensor([[1, 0, 0]]), [[[2, 3]]], q)  # control: disagreeing leaves q alone
    assert torch.equal(q3, q)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4"])
def test_prompt_ngrams_setting_is_checked(bad):
    with pytest.raises(ValueError, match="prompt_ngrams"):
        PromptNgrams.of(bad)


@pytest.mark.parametrize("bad", [0, -3, 2.0, True, "31"])
def test_max_width_is_checked(bad):
    with pytest.raises(ValueError, match="max_width"):
        PromptNgrams(max_width=bad)


@pytest.mark.parametrize(
    "drafts, draft_len, candidates, max_width, budget, expected, expected_len",
    [
        # a candidate longer than the drafts: verified in full, the round widens to it
        ([[4, 5]], [2], [[[4, 5, 6, 7]]], 8, [9], [[4, 5, 6, 7]], [4]),
        ([[4, 5]], [2], [[[4, 5, 6, 7, 8, 9]]], 4, [9], [[4, 5, 6, 7]], [4]),  # up to max_width
        ([[4, 5]], [2], [[[4, 5, 6, 7, 8, 9]]], 8, [3], [[4, 5, 6]], [3]),  # up to the row's budget
        ([[4, 5]], [2], [[[3, 5, 6, 7]]], 8, [9], [[4, 5]], [2]),  # disagrees: the drafter's block, no widening
        ([[4, 5, 6]], [1], [[[4, 9, 9, 9, 9]]], 8, [9], [[4, 9, 9, 9, 9]], [5]),  # a short verify length grows too
        ([[4, 5, 6]], [3], [[[4, 5]]], 8, [9], [[4, 5, 6]], [3]),  # a shorter candidate never shortens the verify
        ([[4, 5]], [0], [[[4, 5, 6, 7]]], 8, [0], [[4, 5]], [0]),  # no draft verified (no budget): stays a plain step
        # two rows: the other keeps its drafts and length, padded to the widest
        ([[4, 5], [1, 2]], [2, 2], [[[4, 5, 6]], [[1, 3]]], 8, [9, 9], [[4, 5, 6], [1, 3, 0]], [3, 2]),
        ([[4, 5], [1, 2]], [2, 1], [[], [[7]]], 8, [9, 9], [[4, 5], [1, 2]], [2, 1]),
    ],
)
def test_agree_wide_table(drafts, draft_len, candidates, max_width, budget, expected, expected_len):
    d, n = torch.tensor(drafts), torch.tensor(draft_len)
    out, new_len, _ = agree_wide(d, n, candidates, max_width, torch.tensor(budget))
    assert out.tolist() == expected and new_len.tolist() == expected_len
    assert d.tolist() == drafts and n.tolist() == draft_len  # the inputs are not modified
    narrow, _, _ = agree_with_drafts(d, candidates)  # within the drafts' width: the same choice as the narrow rule
    assert out[:, : d.shape[1]].tolist() == narrow.tolist()


def test_agree_wide_at_a_known_width():
    """The engine's call: the width planned on the host (nothing read back), each row capped by its own budget."""
    out, n, used = agree_wide(torch.tensor([[4, 5], [1, 2]]), torch.tensor([2, 2]), [[[4, 5, 6, 7]], []], 8,
                              torch.tensor([3, 2]), width=4)
    assert out.tolist() == [[4, 5, 6, 7], [1, 2, 0, 0]] and n.tolist() == [3, 2] and used.tolist() == [True, False]


@pytest.fixture(scope="module")
def reference_pair():
    from adaflash_hf import load_reference_pair

    return load_reference_pair()


# Prompts that repeat themselves, so that the rule has candidates to verify.
_PROMPTS = [
    "Repeat this list exactly: apples, pears, plums, figs, dates, limes. Repeat this list exactly: apples, pears,",
    "The cat sat on the mat. The dog sat on the log. The cat sat on the",
]


@pytest.fixture(scope="module")
def prompt_ids(reference_pair):
    _, _, tok = reference_pair
    return [tok(p).input_ids for p in _PROMPTS]


@pytest.mark.parametrize("policy", ["fixed", "cost"])
def test_generate_with_the_rule_equals_plain(reference_pair, prompt_ids, policy):
    target, drafter, tok = reference_pair
    n = 24
    plain = [plain_greedy_once(target, ids, n) for ids in prompt_ids]
    batch = tok(_PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    with torch.inference_mode():
        out, stats = target.generate(**batch, assistant_model=drafter, max_new_tokens=n, do_sample=False,
                                     length_policy=policy, return_stats=True, prompt_ngrams=4, fast_path=False)
        _, alone = target.generate(**batch, assistant_model=drafter, max_new_tokens=n, do_sample=False,
                                   length_policy=policy, return_stats=True, prompt_ngrams=0, fast_path=False)
    assert [row[batch.input_ids.shape[1] :].tolist()[: len(p)] for row, p in zip(out, plain)] == plain
    assert stats.ngram_rounds > 0 and alone.ngram_rounds == 0  # the rule ran (control: off, it never does)


# Prompts whose continuation repeats them for more than a block: candidates longer than the drafts.
_LONG_PROMPTS = _PROMPTS + [
    "Copy the sentence twice. Sentence: the quick brown fox jumps over the lazy dog near the old river bank at dawn. "
    "Copy 1: the quick brown fox jumps over the lazy dog near the old river bank at dawn. Copy 2: the",
]


@pytest.mark.parametrize(
    "rows, policy, fast_path",
    [((0,), "fixed", False), ((1,), "fixed", False), ((2,), "fixed", False), ((2,), "cost", False),
     ((0, 1, 2), "fixed", False), ((2, 1), "cost", False),
     ((1,), "fixed", True), ((2,), "cost", True), ((2, 1), "cost", True)],
)
def test_generate_with_wide_candidates_equals_plain(reference_pair, rows, policy, fast_path):
    """``max_width=31``: a row verifies a candidate past the block, in the eager loop and on the engine (its graphs'
    buckets, eagerly on CPU); the output stays plain greedy's, token for token (the drafter's context after a wide
    round included: the next rounds draft from it); the default is the control."""
    target, drafter, tok = reference_pair
    n, prompts = 48, [_LONG_PROMPTS[r] for r in rows]
    plain = [plain_greedy_once(target, tok(p).input_ids, n) for p in prompts]
    batch = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
    stats = {}
    for width in (31, None):
        with torch.inference_mode():
            out, stats[width] = target.generate(**batch, assistant_model=drafter, max_new_tokens=n, do_sample=False,
                                                length_policy=policy, return_stats=True, fast_path=fast_path,
                                                prompt_ngrams=PromptNgrams(max_width=width))
        assert [row[batch.input_ids.shape[1] :].tolist()[: len(p)] for row, p in zip(out, plain)] == plain
    assert stats[31].wide_rounds > 0 and max(stats[31].verify_lengths) > drafter.config.block_size
    assert stats[None].wide_rounds == 0 and max(stats[None].verify_lengths) <= drafter.config.block_size  # control


@pytest.mark.parametrize("fast_path", [False, True])
def test_a_wide_candidate_is_accepted_past_the_block(reference_pair, fast_path):
    """The widening pays: some round accepts more drafts than a block holds (the second prompt, 48 tokens), in the
    eager loop and on the engine alike."""
    target, drafter, tok = reference_pair
    ids = torch.tensor([tok(_LONG_PROMPTS[1]).input_ids])
    with torch.inference_mode():
        _, stats = target.generate(ids, assistant_model=drafter, max_new_tokens=48, do_sample=False, length_policy="fixed",
                                   return_stats=True, fast_path=fast_path, prompt_ngrams=PromptNgrams(max_width=31))
    assert max(stats.accepted) >= drafter.config.block_size


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_engine_wide_candidates_equal_plain(reference_pair, cuda_graphs):
    """The engine built with ``max_width``: greedy requests beside a sampled one (which never widens) in one round;
    the greedy outputs are plain greedy's, rounds verified past the block, and the graphs' widest verify follows the
    width (the default engine, the control, keeps the block)."""
    from adaflash_hf.engine import Engine

    target, drafter, tok = reference_pair
    prompts = [tok(p).input_ids for p in _LONG_PROMPTS[1:]]
    plain = [plain_greedy_once(target, ids, 40) for ids in prompts]
    for width in (31, None):
        engine = Engine(target, drafter, length_policy="fixed", max_slots=4, max_len=256, cuda_graphs=cuda_graphs,
                        prompt_ngrams=PromptNgrams(max_width=width))
        greedy = [engine.submit(ids, 40) for ids in prompts]
        sampled = engine.submit(prompts[0], 40, temperature=1.0, seed=3)
        assert [h.result().token_ids for h in greedy] == plain
        assert len(sampled.result().token_ids) == 40
        B = drafter.config.block_size
        assert (engine.wide_rounds > 0 and engine.max_q == 32) if width else (engine.wide_rounds == 0 and engine.max_q == B)
        if cuda_graphs:
            assert max(key[1] for key in engine.graphs.replays) == (32 if width else B)


@pytest.mark.parametrize("cuda_graphs, policy", [(False, "fixed"), (True, "fixed"), (True, "cost")])
def test_engine_with_the_rule_equals_plain(reference_pair, prompt_ids, cuda_graphs, policy):
    from adaflash_hf.engine import Engine

    target, drafter, _ = reference_pair
    n = 24
    plain = [plain_greedy_once(target, ids, n) for ids in prompt_ids]
    used = {}
    for ngrams in (4, 0):
        engine = Engine(target, drafter, length_policy=policy, max_slots=2, max_len=256, token_budget=256,
                        cuda_graphs=cuda_graphs, prompt_ngrams=ngrams)
        assert [o.token_ids for o in engine.generate(prompt_ids, max_new_tokens=n)] == plain
        used[ngrams] = int(engine.ngram_used)
    assert used[4] > 0 and used[0] == 0


def test_the_rule_is_off_under_a_round_sink(reference_pair, prompt_ids):
    """The online adapter learns from the drafter's own rounds: every round it sees verifies the drafter's drafts."""
    target, drafter, _ = reference_pair
    rounds = []

    class Sink:
        def on_round(self, r):
            rounds.append(r)

    with torch.inference_mode():
        _, stats = target.generate(torch.tensor([prompt_ids[0]]), assistant_model=drafter, max_new_tokens=16,
                                   do_sample=False, length_policy="fixed", return_stats=True, round_sink=Sink(),
                                   fast_path=False)
    assert rounds and stats.ngram_rounds == 0


@pytest.mark.parametrize("turns, sampled", [(None, False), (1, False), (3, False), (0, False), (None, True)])
def test_index_while_the_device_runs_builds_the_index_drafting_would(turns, sampled):
    """A plain stretch's host indexes requests' n-grams while ``busy()``, in chunks: whatever it reached, the index
    after a drafting round's catch-up is the one built at once; ``busy`` False indexes nothing (the negative
    control), and sampled rows (outside the rule by default) are never indexed."""
    from adaflash_hf.engine.requests import Request
    from adaflash_hf.engine.round_ngrams import INDEX_CHUNK, index_while, round_candidates
    from adaflash_hf.engine.sampling import SamplingParams

    rule = PromptNgrams()
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.7 if sampled else 0.0)
    rows = []
    for i in range(2):
        r = Request(i, torch.randint(0, 9, (150,), generator=g).tolist(), 400, params, None)
        r.tokens = torch.randint(0, 9, (90,), generator=g).tolist()
        rows.append(r)
    calls = iter(range(10**6))
    busy = (lambda: True) if turns is None else (lambda: next(calls) < turns)
    done = index_while(rule, rows, busy)
    if sampled or turns == 0:
        assert done == 0 and all(r.ngrams is None for r in rows)
        return
    assert done == (480 if turns is None else turns * INDEX_CHUNK)
    ref = [rule.index(r.prompt + r.tokens) for r in rows]
    cands, _ = round_candidates(rule, rows, [7, 7], None)
    for r, want, got in zip(rows, ref, cands):
        assert got == want.candidates(7)
        assert r.ngrams.starts == want.starts and r.ngrams.length == len(r.prompt) + len(r.tokens)


@pytest.mark.parametrize("most_behind, lag, served", [(None, 200, True), (64, 200, False), (64, 64, True), (0, 1, False)])
def test_probe_candidates_skip_rows_whose_index_lags(most_behind, lag, served):
    """A probe round's candidates (``most_behind``) go only to requests whose index lags their tokens by at most that
    many; a lagging request gets none and its index is left for :func:`index_while` (not extended now)."""
    from adaflash_hf.engine.requests import Request
    from adaflash_hf.engine.round_ngrams import round_candidates
    from adaflash_hf.engine.sampling import SamplingParams

    rule = PromptNgrams()
    r = Request(0, [3, 1, 2, 3, 1, 2] * 20, 400, SamplingParams(), None)
    r.ngrams = rule.index(list(r.prompt))
    r.ngrams.extend_to(len(r.prompt))
    r.tokens = [3, 1, 2] * (lag // 3) + [3, 1, 2][: lag % 3]
    cands, lens = round_candidates(rule, [r], [5], None, most_behind)
    assert (cands[0] != []) is served and lens == [5]
    assert r.ngrams.length == (len(r.prompt) + lag if served else len(r.prompt))
