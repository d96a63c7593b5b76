"""Data loaders, tokenizer, pretokenizer and target-training smoke tests (CPU, small).

The data tests read whatever folder ``D.data_dir()`` resolves. ``conftest.py`` sets
``$ADAFLASH_DATA`` to ``tests/fixtures/data`` (a small verbatim excerpt of shared/data, see its
README) unless the variable is already set, so the suite is hermetic; run
``ADAFLASH_DATA=../shared/data pytest tests/test_data.py`` to check the same assertions on the full
datasets. Expected counts are computed from the files of the configured folder, never hard-coded,
except the documented full-data sizes, checked only when the folder is the full data.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from adaflash_hf.training import data as D
from adaflash_hf.training.tokenizer import IM_END, IM_START, MASK, stop_token_ids, train_tokenizer

# Sizes documented in shared/data/README.md, checked when the configured folder is the full data.
FULL_EVAL_SIZES = {"gsm8k": 1319, "mbpp": 257, "aime2025": 30, "eagle_bench": 400}
FULL_TRAIN_SIZES = {"code": 4535 + 374, "math": 7473 + 4500}  # codealpaca + mbpp 601-974; gsm8k + MATH


@pytest.fixture(scope="module")
def data_root():
    try:
        return D.data_dir()
    except FileNotFoundError as e:
        pytest.fail(f"data folder not found (conftest.py points ADAFLASH_DATA at tests/fixtures/data). {e}",
                    pytrace=False)


def _raw(root, rel):
    """The records of one JSONL file, read directly (independently of the loaders under test)."""
    with open(root / rel, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _is_full(root):
    return len(_raw(root, "gsm8k/test.jsonl")) == FULL_EVAL_SIZES["gsm8k"]


def _check_messages(msgs, last_role):
    assert isinstance(msgs, list) and msgs
    for m in msgs:
        assert set(m) >= {"role", "content"}
        assert m["role"] in ("user", "assistant")
        assert isinstance(m["content"], str) and m["content"].strip()
    assert msgs[0]["role"] == "user" and msgs[-1]["role"] == last_role
    for a, b in zip(msgs, msgs[1:]):
        assert a["role"] != b["role"], "roles must alternate"


@pytest.mark.parametrize("name", D.EVAL_DATASETS)
def test_eval_prompts_structure(data_root, name):
    rows = D.eval_prompts(name, limit=8)
    assert 1 <= len(rows) <= 8
    for r in rows:
        assert r["dataset"] == name
        if name == "prose":  # a continuation task: raw text, the rest of the chunk as reference
            assert "messages" not in r and 20 <= len(r["text"]) <= D.PROSE_PROMPT_CHARS and r["reference"]
            assert not r["text"].endswith(" ") and r["reference"].startswith(" ")
            continue
        _check_messages(r["messages"], "user")
        assert len(r["messages"]) == 1
        assert "reference" in r
        assert r["reference"] is None or isinstance(r["reference"], str)


def test_eval_prompts_sizes_and_references(data_root):
    assert len(D.eval_prompts("gsm8k")) == len(_raw(data_root, "gsm8k/test.jsonl"))
    assert len(D.eval_prompts("aime2025")) == len(_raw(data_root, "aime2025/aime2025.jsonl"))
    assert D.eval_prompts("gsm8k", limit=1)[0]["reference"] == "18"
    assert D.eval_prompts("aime2025", limit=1)[0]["reference"] == "70"
    assert [r["messages"] for r in D.eval_prompts("gsm8k", limit=3)] == [
        r["messages"] for r in D.eval_prompts("gsm8k")[:3]
    ]

    # mbpp: sanitized records with test ids 11-510 only, in file order; reference = fenced code
    sanitized = _raw(data_root, "mbpp/sanitized-mbpp.jsonl")
    test_ids = [r["task_id"] for r in sanitized if 11 <= r["task_id"] <= 510]
    assert 0 < len(test_ids) < len(sanitized), "the data should hold mbpp ids outside 11-510"
    mbpp = D.eval_prompts("mbpp")
    assert [r["task_id"] for r in mbpp] == test_ids
    for r in mbpp:
        assert r["reference"].startswith("```python\n") and r["reference"].endswith("\n```")
        assert r["test_list"] and all(t in r["messages"][0]["content"] for t in r["test_list"])

    # eagle_bench: all five tasks in order; one task alone with eagle_bench:<task>
    eagle = D.eval_prompts("eagle_bench")
    per_task = [len(_raw(data_root, f"eagle_bench/{t}.jsonl")) for t in D.EAGLE_TASKS]
    assert len(eagle) == sum(per_task)
    assert [r["task"] for r in eagle] == [t for t, n in zip(D.EAGLE_TASKS, per_task) for _ in range(n)]
    assert {r["task"] for r in D.eval_prompts("eagle_bench:gsm8k")} == {"gsm8k"}
    with pytest.raises(ValueError, match="nope"):
        D.eval_prompts("eagle_bench:nope")

    # sharegpt: first user turn as prompt, first assistant turn as reference
    sg = D.eval_prompts("sharegpt")
    raw_sg = _raw(data_root, "sharegpt/sharegpt_eval500.jsonl")
    assert [r["id"] for r in sg] == [r["id"] for r in raw_sg]
    assert sg[0]["messages"][0]["content"] == raw_sg[0]["conversations"][0]["value"].strip()
    assert sg[0]["reference"] == raw_sg[0]["conversations"][1]["value"].strip()

    # multi-turn sets keep all user turns
    mt = D.eval_prompts("mt_bench")
    assert all(len(r["turns"]) == 2 and r["messages"][0]["content"] == r["turns"][0] for r in mt)
    assert any(r["reference"] for r in mt)

    if _is_full(data_root):
        for name, n in FULL_EVAL_SIZES.items():
            assert len(D.eval_prompts(name)) == n, name


def test_blend_is_balanced_and_deterministic(data_root):
    a = D.eval_prompts("blend", limit=40, seed=3)
    b = D.eval_prompts("blend", limit=40, seed=3)
    c = D.eval_prompts("blend", limit=40, seed=4)
    assert len(a) == 40
    assert [r["messages"] for r in a] == [r["messages"] for r in b]
    assert [r["messages"] for r in a] != [r["messages"] for r in c]
    counts = {s: sum(r["source"] == s for r in a) for s in D.BLEND_PARTS}
    assert counts == {s: 10 for s in D.BLEND_PARTS}
    assert [r["source"] for r in a[:8]] == list(D.BLEND_PARTS) * 2  # round-robin: any prefix is balanced
    assert all(r["dataset"] == "blend" for r in a)
    # without a limit: every part contributes as many prompts as the smallest part has
    full = D.eval_prompts("blend", seed=3)
    smallest = min(len(D.eval_prompts(p)) for p in D.BLEND_PARTS)
    assert len(full) == len(D.BLEND_PARTS) * smallest
    assert {s: sum(r["source"] == s for r in full) for s in D.BLEND_PARTS} == {s: smallest for s in D.BLEND_PARTS}


def test_unknown_dataset_error(data_root):
    with pytest.raises(ValueError, match="no_such_set"):
        D.eval_prompts("no_such_set")
    with pytest.raises(ValueError, match="gsm8k"):  # the message lists the known names
        D.eval_prompts("no_such_set")
    with pytest.raises(ValueError, match="cooking"):
        D.chat_samples("cooking")
    with pytest.raises(ValueError, match="'test'"):
        D.chat_samples("math", "test")


def test_missing_data_error(tmp_path, monkeypatch):
    missing = tmp_path / "nowhere"
    monkeypatch.setenv(D.ENV_VAR, str(missing))
    with pytest.raises(FileNotFoundError) as ei:
        D.eval_prompts("gsm8k")
    assert str(missing) in str(ei.value) and D.ENV_VAR in str(ei.value)
    (missing / "gsm8k").mkdir(parents=True)
    with pytest.raises(FileNotFoundError) as ei:
        D.eval_prompts("gsm8k")
    assert "test.jsonl" in str(ei.value) and D.ENV_VAR in str(ei.value)


def test_data_dir_argument_overrides_env(data_root, tmp_path, monkeypatch):
    monkeypatch.setenv(D.ENV_VAR, str(tmp_path / "nowhere"))
    assert D.data_dir(data_root) == data_root
    assert D.eval_prompts("aime2025", limit=1, data_dir=data_root)[0]["reference"] == "70"


@pytest.mark.parametrize("domain", D.TRAIN_DOMAINS)
def test_chat_samples(data_root, domain):
    for split in ("train", "eval"):
        rows = D.chat_samples(domain, split, limit=5)
        assert len(rows) == 5
        for r in rows:
            assert r["domain"] == domain
            if domain == "prose":
                assert "messages" not in r and 20 <= len(r["text"]) <= 2000
            else:
                _check_messages(r["messages"], "assistant")


def test_train_domain_sizes(data_root):
    mbpp = _raw(data_root, "mbpp/mbpp.jsonl")
    mbpp_train = [r for r in mbpp if 601 <= r["task_id"] <= 974]
    assert 0 < len(mbpp_train) < len(mbpp), "the data should hold mbpp ids outside 601-974"
    code = D.chat_samples("code", "train")
    n_alpaca = len(_raw(data_root, "codealpaca/new_codealpaca.jsonl"))
    assert len(code) == n_alpaca + len(mbpp_train)
    assert [s["messages"][1]["content"] for s in code[n_alpaca:]] == [
        "```python\n" + r["code"].replace("\r\n", "\n").strip("\n") + "\n```" for r in mbpp_train
    ]
    math = D.chat_samples("math", "train")
    assert len(math) == len(_raw(data_root, "gsm8k/train.jsonl")) + len(_raw(data_root, "math_train4500/train.jsonl"))
    assert not any("<<" in s["messages"][1]["content"] for s in math)  # gsm8k calculator annotations dropped
    if _is_full(data_root):
        assert {"code": len(code), "math": len(math)} == FULL_TRAIN_SIZES

    # chat: empty turns dropped, consecutive same-role turns merged, so roles always alternate
    raw_chat = _raw(data_root, "sharegpt/sharegpt_train.jsonl")
    chat = D.chat_samples("chat", "train")
    assert 0 < len(chat) <= len(raw_chat)
    for s in chat:
        _check_messages(s["messages"], "assistant")
    assert sum(len(s["messages"]) for s in chat) < sum(len(r["conversations"]) for r in raw_chat)

    prose = D.chat_samples("prose", "train")
    prose_eval = D.chat_samples("prose", "eval")
    assert max(len(r["text"]) for r in prose + prose_eval) <= 2000
    assert sum(len(r["text"]) for r in prose) / len(prose) > 1000
    sources = set(D.TRAIN_SOURCES["prose"])
    assert {r["source"] for r in prose} <= sources and {r["source"] for r in prose_eval} == sources
    assert not {r["text"] for r in prose} & {r["text"] for r in prose_eval}


def test_chunk_text():
    text = ("word " * 50 + "\n\n") * 40
    chunks = D.chunk_text(text, 600)
    assert all(len(c) <= 800 for c in chunks)
    assert all(len(c) >= 400 for c in chunks[:-1])
    assert "".join(c.replace(" ", "").replace("\n", "") for c in chunks) == text.replace(" ", "").replace("\n", "")


# --------------------------------------------------------------------------------- tokenizer

_TINY_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n",
    "Natalia sold 48 clips in April and half as many in May: 48 / 2 = 24. #### 72",
    "It is a truth universally acknowledged, that a single man in possession of a good fortune.",
] * 20


def test_tokenizer_chat_template_roundtrip(tmp_path):
    from transformers import AutoTokenizer

    tok = train_tokenizer(_TINY_CORPUS, vocab_size=400)
    assert tok.mask_token == MASK
    assert len(tok.encode(MASK, add_special_tokens=False)) == 1
    assert tok.encode(MASK, add_special_tokens=False)[0] == tok.mask_token_id
    for t in (IM_START, IM_END, tok.eos_token, tok.pad_token):
        assert len(tok.encode(t, add_special_tokens=False)) == 1
    assert tok.pad_token_id != tok.eos_token_id
    assert len({tok.eos_token_id, tok.pad_token_id, tok.mask_token_id} | set(stop_token_ids(tok))) == 4

    msgs = [{"role": "user", "content": "What is 2+2?"}]
    prompt = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert prompt.endswith("<|im_start|>assistant\n")
    full = tok.apply_chat_template(msgs + [{"role": "assistant", "content": "4"}], tokenize=False)
    assert full == prompt + "4<|im_end|>\n"
    ids = tok.encode(full, add_special_tokens=False)
    assert tok.decode(ids) == full
    enc = tok.apply_chat_template(
        msgs + [{"role": "assistant", "content": "4"}], tokenize=True, return_dict=True,
        return_assistant_tokens_mask=True,
    )
    resp = [i for i, m in zip(enc["input_ids"], enc["assistant_masks"]) if m]
    assert tok.decode(resp) == "4<|im_end|>"

    tok.save_pretrained(tmp_path / "tok")
    tok2 = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert tok2.mask_token_id == tok.mask_token_id
    assert tok2.eos_token_id == tok.eos_token_id and tok2.pad_token_id == tok.pad_token_id
    assert tok2.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == prompt
    assert tok2.encode(full, add_special_tokens=False) == ids


# ------------------------------------------------------------------- pretokenize + train_target


@pytest.fixture(scope="module")
def tiny_corpus(data_root, tmp_path_factory):
    from pretokenize import loss_mask, pretokenize

    out = tmp_path_factory.mktemp("pretok")
    meta = pretokenize(out, vocab_size=512, limit_per_domain=12, eval_tokens_per_domain=2000, progress=False)
    tokens = np.load(out / "train_tokens.npy")
    docs = np.load(out / "train_docs.npy")
    spans = np.load(out / "train_loss_spans.npy")
    assert tokens.dtype == np.uint16 and len(tokens) == meta["train"]["n_tokens"]
    assert docs.shape == (48, 3) and int(docs[-1, 0] + docs[-1, 1]) == len(tokens)
    assert sorted(set(docs[:, 2].tolist())) == [0, 1, 2, 3]
    assert (tokens[docs[:, 0] + docs[:, 1] - 1] == meta["eos_token_id"]).all()
    mask = loss_mask(len(tokens), spans)
    for d in D.TRAIN_DOMAINS:
        assert meta["train"]["domains"][d]["loss_tokens"] > 0
    assert mask.sum() == sum(meta["train"]["domains"][d]["loss_tokens"] for d in D.TRAIN_DOMAINS)
    assert (out / "tokenizer" / "tokenizer.json").exists()
    json.loads((out / "meta.json").read_text())
    return out


def test_train_target_smoke(tiny_corpus, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from train_target import TargetRecipe, train

    s = train(TargetRecipe(tiny_corpus, tmp_path / "run", steps=3, device="cpu", tiny=True, batch_size=4, seq_len=64,
                           eval_windows=2, sample_tokens=4, quiet=True, minutes=5))
    assert s["steps"] == 3 and s["stopped_by"] == "steps"
    log = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()]
    train_lines = [r for r in log if "loss" in r]
    assert train_lines and set(train_lines[0]) >= {"step", "tokens", "loss", "lr", "elapsed"}
    target = tmp_path / "run" / "target"
    model = AutoModelForCausalLM.from_pretrained(target)
    tok = AutoTokenizer.from_pretrained(target)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert str(model.dtype) == "torch.bfloat16"
    assert list(model.generation_config.eos_token_id) == stop_token_ids(tok)
    assert tok.mask_token_id is not None
    assert len(s["samples"]) == 4


def test_train_target_loss_decreases_on_fixed_batch(tiny_corpus, tmp_path):
    from train_target import TargetRecipe, train

    s = train(TargetRecipe(tiny_corpus, tmp_path / "fit", steps=20, device="cpu", tiny=True, batch_size=4, seq_len=64,
                           fixed_batch=True, log_every=1, sample_tokens=0, save=False, quiet=True, lr=3e-3, minutes=5))
    losses = [l for _, l in s["losses"]]
    assert len(losses) >= 20
    assert losses[-1] < losses[0] - 1.0, losses


def test_train_samples_fall_back_to_the_builtin_sample(tmp_path, monkeypatch):
    """No training data in the data folder (here an empty ADAFLASH_DATA): `chat_samples` serves the
    built-in sample as prompts (6 train, 2 held-out eval per domain); a folder with the domain's data does not."""
    monkeypatch.setenv(D.ENV_VAR, str(tmp_path))
    for domain in D.TRAIN_DOMAINS:
        assert D.uses_builtin_samples(domain, "train") and D.uses_builtin_samples(domain, "eval")
        train, held = D.chat_samples(domain, "train"), D.chat_samples(domain, "eval")
        assert (len(train), len(held)) == (8 - D.BUILTIN_EVAL_PER_DOMAIN, D.BUILTIN_EVAL_PER_DOMAIN)
        assert all(r["domain"] == domain for r in train + held)
        key = "text" if domain == "prose" else "messages"
        assert not {str(r[key]) for r in train} & {str(r[key]) for r in held}
        if domain != "prose":
            assert all([m["role"] for m in r["messages"]] == ["user"] for r in train)
    (tmp_path / "gsm8k").mkdir()
    assert not D.uses_builtin_samples("math", "train")
    with pytest.raises(FileNotFoundError):  # partial data is an error, not a silent fallback
        D.chat_samples("math", "train")
