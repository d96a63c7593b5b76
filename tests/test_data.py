"""Data loaders, tokenizer, pretokenizer and target-training smoke tests (CPU, small).

These tests need the shared data folder (``../shared/data`` beside the repository, or
``$ADAFLASH_DATA``). When it is missing they FAIL with a message saying so; they never skip.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from adaflash_hf.training import data as D
from adaflash_hf.training.tokenizer import IM_END, IM_START, MASK, stop_token_ids, train_tokenizer


@pytest.fixture(scope="module")
def data_root():
    try:
        return D.data_dir()
    except FileNotFoundError as e:
        pytest.fail(
            "shared data folder not found: these tests need ../shared/data next to the repository "
            f"(or ADAFLASH_DATA pointing to it). {e}",
            pytrace=False,
        )


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
        _check_messages(r["messages"], "user")
        assert len(r["messages"]) == 1
        assert "reference" in r
        assert r["reference"] is None or isinstance(r["reference"], str)


def test_eval_prompts_full_sizes_and_references(data_root):
    assert len(D.eval_prompts("gsm8k")) == 1319
    assert len(D.eval_prompts("mbpp")) == 257
    assert len(D.eval_prompts("aime2025")) == 30
    assert D.eval_prompts("gsm8k", limit=1)[0]["reference"] == "18"
    assert D.eval_prompts("aime2025", limit=1)[0]["reference"] == "70"
    assert len(D.eval_prompts("eagle_bench")) == 400
    assert {r["task"] for r in D.eval_prompts("eagle_bench:gsm8k")} == {"gsm8k"}


def test_blend_is_balanced_and_deterministic(data_root):
    a = D.eval_prompts("blend", limit=40, seed=3)
    b = D.eval_prompts("blend", limit=40, seed=3)
    c = D.eval_prompts("blend", limit=40, seed=4)
    assert len(a) == 40
    assert [r["messages"] for r in a] == [r["messages"] for r in b]
    assert [r["messages"] for r in a] != [r["messages"] for r in c]
    counts = {s: sum(r["source"] == s for r in a) for s in D.BLEND_PARTS}
    assert counts == {s: 10 for s in D.BLEND_PARTS}
    assert all(r["dataset"] == "blend" for r in a)


def test_unknown_dataset_error(data_root):
    with pytest.raises(ValueError, match="no_such_set"):
        D.eval_prompts("no_such_set")
    with pytest.raises(ValueError, match="gsm8k"):  # the message lists the known names
        D.eval_prompts("no_such_set")
    with pytest.raises(ValueError, match="cooking"):
        D.chat_samples("cooking")


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
    assert len(D.chat_samples("code", "train")) == 4535 + 374  # codealpaca + mbpp ids 601-974
    assert len(D.chat_samples("math", "train")) == 7473 + 4500
    prose = D.chat_samples("prose", "train")
    assert max(len(r["text"]) for r in prose) <= 2000
    assert sum(len(r["text"]) for r in prose) / len(prose) > 1000


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
    from adaflash_hf.training.pretokenize import loss_mask, pretokenize

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

    from adaflash_hf.training.train_target import train

    s = train(tiny_corpus, tmp_path / "run", steps=3, device="cpu", tiny=True, batch_size=4, seq_len=64,
              eval_windows=2, sample_tokens=4, quiet=True, minutes=5)
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
    from adaflash_hf.training.train_target import train

    s = train(tiny_corpus, tmp_path / "fit", steps=20, device="cpu", tiny=True, batch_size=4, seq_len=64,
              fixed_batch=True, log_every=1, sample_tokens=0, save=False, quiet=True, lr=3e-3, minutes=5)
    losses = [l for _, l in s["losses"]]
    assert len(losses) >= 20
    assert losses[-1] < losses[0] - 1.0, losses
