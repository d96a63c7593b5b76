"""Eval slices deduplicated against the training prompts (`adaflash_hf.training.splits`), on a tiny
sharegpt-shaped data folder in tmp_path (math and code fall back to the built-in samples)."""

import json

import pytest

from adaflash_hf.bench.prompts import load_prompts
from adaflash_hf.training import splits as S

TRAIN = [
    "Please write a short poem about the sea at night with waves and stars",
    "Explain how a hash table handles collisions when two keys map to the same bucket in memory",
]
EXACT = "  please WRITE a short poem about the sea at night with waves and stars "  # case and spaces differ
NEAR = "Explain how a hash table handles collisions when two keys map to the same bucket in RAM"  # 1 of 15 words
SHARES_A_FEW_WORDS = "Write a short story about a dragon who learns to bake bread in a small village"
OTHERS = [f"Question number {i}: what is {i} times {i + 3}, and why does it matter for topic {i}?" for i in range(20)]


def _conv(i, user):
    return {"id": f"c{i}_0", "conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": "ok"}]}


def _write(root, eval_users):
    (root / "sharegpt").mkdir(exist_ok=True)
    for name, users in (("sharegpt_train.jsonl", TRAIN), ("sharegpt_eval500.jsonl", eval_users)):
        lines = [json.dumps(_conv(i, u)) for i, u in enumerate(users)]
        (root / "sharegpt" / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    S.training_index.cache_clear()  # the index is cached per folder; the tests rewrite theirs


def _users(records):
    return [r["messages"][0]["content"] for r in records]


@pytest.fixture
def data(tmp_path):
    _write(tmp_path, [EXACT, NEAR, SHARES_A_FEW_WORDS, *OTHERS])
    return tmp_path


def test_duplicates_removed_and_counted(data):
    kept = _users(S.eval_split("sharegpt", "all", data_dir=data))
    assert kept == [SHARES_A_FEW_WORDS, *OTHERS]  # the negative control stays, file order kept
    counts = S.split_counts("sharegpt", data_dir=data)
    assert counts["total"] == 23 and counts["exact_duplicates"] == 1 and counts["near_duplicates"] == 1
    assert counts["validation"] + counts["test"] == 21


def test_slices_deterministic_disjoint_and_complete(data):
    val, test = (_users(S.eval_split("sharegpt", s, data_dir=data)) for s in ("validation", "test"))
    assert val and test and not set(val) & set(test)
    assert sorted(val + test) == sorted(_users(S.eval_split("sharegpt", "all", data_dir=data)))
    assert val == _users(S.eval_split("sharegpt", "validation", data_dir=data))
    with pytest.raises(ValueError, match="unknown split"):
        S.eval_split("sharegpt", "train", data_dir=data)


def test_adding_records_moves_no_old_one(data):
    before = {s: set(_users(S.eval_split("sharegpt", s, data_dir=data))) for s in ("validation", "test")}
    _write(data, ["A brand new prompt about gardening in spring", EXACT, NEAR, SHARES_A_FEW_WORDS, *OTHERS])
    after = {s: set(_users(S.eval_split("sharegpt", s, data_dir=data))) for s in ("validation", "test")}
    assert all(before[s] <= after[s] for s in before)


def test_bench_loads_a_slice(data):
    label, prompts = load_prompts("sharegpt", 100, data, split="test")
    assert label == "sharegpt"
    assert [m[0]["content"] for m in prompts] == _users(S.eval_split("sharegpt", "test", data_dir=data))
    assert len(load_prompts("sharegpt", 100, data)[1]) == 23  # "all": today's behaviour, nothing removed
    with pytest.raises(ValueError, match="named eval sets"):
        load_prompts("jsonl:x.jsonl", 5, None, split="validation")
