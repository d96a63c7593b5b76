"""Offline drafter training (SPEC section 5): anchors, block masks, losses, Trainer glue, PEFT, cache."""

import dataclasses
import json
import math

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, TrainingArguments

from adaflash_hf import AdaFlashDrafter
from adaflash_hf.training.losses import default_gamma
from adaflash_hf.training.blocks import (
    IGNORE_INDEX,
    anchor_candidates,
    block_attention_mask,
    build_block_inputs,
    sample_anchors,
)
from adaflash_hf.training.trainer import (  # noqa: I001
    DrafterDataCollator,
    DrafterTrainer,
    DrafterTrainingModel,
    FeatureCacheDataset,
    build_feature_cache,
    drafter_state_dict,
    encode_sample,
    train_length_head,
)

VOCAB, MASK = 128, 127


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models: one intra-op thread is fastest and immune to oversubscription on busy machines."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_target(attn="sdpa", seed=0, vocab=VOCAB):
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      attn_implementation=attn)
    return Qwen3ForCausalLM(cfg).eval()


def tiny_pair(attn="sdpa", block_size=4, num_layers=2, seed=0):
    target = tiny_target(attn, seed)
    torch.manual_seed(seed + 1)
    drafter = AdaFlashDrafter.from_target(target, num_layers=num_layers, block_size=block_size, mask_token_id=MASK,
                                          attn_implementation=attn)
    return target, drafter


def fixed_batch(b=2, T=24, prompt=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 100, (b, T), generator=g)
    am = torch.ones(b, T, dtype=torch.bool)
    am[1, T - 5:] = False  # second row right padded
    lm = am.clone()
    lm[:, :prompt] = False
    return {"input_ids": ids, "attention_mask": am, "loss_mask": lm}


# ----------------------------------------------------------------------------- anchors


@pytest.mark.parametrize("seed", range(5))
def test_anchors_only_in_response_and_never_past_end(seed):
    g = torch.Generator().manual_seed(seed)
    b, T, B = 4, 40, 8
    lm = torch.rand(b, T, generator=g) < 0.5
    lm[0] = False  # a row without any response
    lm[1, :] = False
    lm[1, -1] = True  # only the last token is a response: anchor T-2
    anchors, valid = sample_anchors(lm, B, max_anchors=512, generator=g)
    cand = anchor_candidates(lm, B)
    assert not valid[0].any()
    for r in range(b):
        a = anchors[r][valid[r]]
        assert (a + 1 < T).all()
        assert lm[r, a + 1].all()
        assert len(set(a.tolist())) == len(a)  # without replacement
        assert a.tolist() == sorted(a.tolist())
        assert len(a) == int(cand[r].sum())  # max_anchors not binding: every candidate drawn
    assert anchors[1][valid[1]].tolist() == [T - 2]


def test_anchor_cap_and_full_block_option():
    lm = torch.ones(3, 100, dtype=torch.bool)
    lm[:, :10] = False
    anchors, valid = sample_anchors(lm, 16, max_anchors=7, generator=torch.Generator().manual_seed(0))
    assert anchors.shape == (3, 7) and valid.all()
    assert ((anchors >= 9) & (anchors <= 98)).all()
    a2, v2 = sample_anchors(lm, 16, require_full_block=True)
    assert (a2[v2] + 15 <= 99).all() and int(v2[0].sum()) == 100 - 15 - 9
    # different draws differ, same generator seed reproduces
    x1, _ = sample_anchors(lm, 16, 7, generator=torch.Generator().manual_seed(1))
    x2, _ = sample_anchors(lm, 16, 7, generator=torch.Generator().manual_seed(1))
    assert torch.equal(x1, x2)


# ----------------------------------------------------------------------------- block inputs


def test_block_labels_and_positions():
    ids = torch.arange(100, 112).view(1, 12)  # token at position p is 100 + p
    lm = torch.zeros(1, 12, dtype=torch.bool)
    lm[0, 3:8] = True  # response 3..7, then a non-response "user turn" 8..11
    anchors = torch.tensor([[2, 6, 10, 0]])
    valid = torch.tensor([[True, True, True, False]])
    blk, lab, pos = build_block_inputs(ids, anchors, valid, 4, MASK, loss_mask=lm)
    blk, lab, pos = blk.view(4, 4), lab.view(4, 4), pos.view(4, 4)
    assert blk[:3, 0].tolist() == [102, 106, 110] and (blk[:, 1:] == MASK).all() and blk[3, 0] == MASK
    assert lab[0].tolist() == [IGNORE_INDEX, 103, 104, 105]
    assert lab[1].tolist() == [IGNORE_INDEX, 107, IGNORE_INDEX, IGNORE_INDEX]  # 8, 9 are not response
    assert lab[2].tolist() == [IGNORE_INDEX] * 4  # 11 not response, 12-13 past the end
    assert lab[3].tolist() == [IGNORE_INDEX] * 4  # invalid block
    assert pos[0].tolist() == [2, 3, 4, 5] and pos[2].tolist() == [10, 11, 12, 13]
    # without loss_mask only the sequence end cuts labels
    _, lab2, _ = build_block_inputs(ids, anchors, valid, 4, MASK)
    assert lab2.view(4, 4)[2].tolist() == [IGNORE_INDEX, 111, IGNORE_INDEX, IGNORE_INDEX]


# ----------------------------------------------------------------------------- block mask

MASK_CASES = [
    # (context_len, anchors, block_size)
    (10, [0], 4),
    (10, [3], 4),
    (10, [9], 2),
    (10, [2, 5, 7], 3),
    (16, [1, 4, 8, 15], 4),
]


@pytest.mark.parametrize("T,anchors,B", MASK_CASES)
def test_block_mask_rule(T, anchors, B):
    a = torch.tensor([anchors])
    v = torch.ones_like(a, dtype=torch.bool)
    m = block_attention_mask(T, a, v, B)[0, 0]
    n = len(anchors)
    assert m.shape == (n * B, T + n * B)
    for i, anc in enumerate(anchors):
        rows = m[i * B:(i + 1) * B]
        ctx = rows[:, :T]
        assert ctx[:, :anc].all()  # all context strictly before the anchor
        assert not ctx[:, anc:].any()  # never its own anchor's (or any later) target state
        blocks = rows[:, T:].view(B, n, B)
        assert blocks[:, i].all()  # its whole block, bidirectionally
        others = torch.cat([blocks[:, :i], blocks[:, i + 1:]], dim=1)
        assert not others.any()  # never another block


def test_block_mask_padding_and_invalid_blocks():
    a = torch.tensor([[3, 0]])
    v = torch.tensor([[True, False]])
    kpm = torch.tensor([[True, False, True, True, True, True]])
    m = block_attention_mask(6, a, v, 2, key_padding_mask=kpm)[0, 0].int()
    assert m[:2].tolist() == [[1, 0, 1, 0, 0, 0, 1, 1, 0, 0]] * 2
    # an invalid block sees only itself (no empty rows -> no NaN in attention)
    assert m[2:].tolist() == [[0, 0, 0, 0, 0, 0, 0, 0, 1, 1]] * 2


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_batched_blocks_equal_inference_forward(attn):
    """Each block of the many-blocks training pass equals a drafter call as at inference:
    context = target features of tokens < anchor, block = [anchor token, mask...] at positions anchor+k."""
    target, drafter = tiny_pair(attn, block_size=4)
    drafter.eval()
    ids = torch.randint(0, 100, (1, 20), generator=torch.Generator().manual_seed(3))
    model = DrafterTrainingModel(target, drafter)
    feats = model.target_features(ids)
    anchors = torch.tensor([[0, 5, 11, 18]])
    valid = torch.ones_like(anchors, dtype=torch.bool)
    blk, _, pos = build_block_inputs(ids, anchors, valid, 4, MASK)
    mask = block_attention_mask(20, anchors, valid, 4)
    with torch.no_grad():
        h = drafter(noise_embeds=drafter.embed(blk), context_hidden_states=feats,
                    position_ids=torch.cat([torch.arange(20).view(1, -1), pos], 1), attention_mask=mask).last_hidden_state
        for i, a in enumerate(anchors[0].tolist()):
            ref = drafter(noise_embeds=drafter.embed(blk[:, i * 4:(i + 1) * 4]), context_hidden_states=feats[:, :a],
                          position_ids=torch.arange(a + 4).view(1, -1)).last_hidden_state
            torch.testing.assert_close(h[:, i * 4:(i + 1) * 4], ref, atol=2e-5, rtol=1e-4)


# ----------------------------------------------------------------------------- losses


def test_position_weighted_ce_matches_manual():
    target, drafter = tiny_pair(block_size=4)
    model = DrafterTrainingModel(target, drafter, length_head_weight=0.0)
    batch = fixed_batch()
    anchors = torch.tensor([[8, 12, 20], [9, 15, 0]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    out = model(**batch, anchors=anchors, anchor_valid=valid)
    gamma = default_gamma(4)
    assert gamma == 2.0 and default_gamma(16) == 7.0
    # manual
    ids, lm = batch["input_ids"], batch["loss_mask"] & batch["attention_mask"]
    blk, lab, pos = build_block_inputs(ids, anchors, valid, 4, MASK, loss_mask=lm)
    mask = block_attention_mask(24, anchors, valid, 4, key_padding_mask=batch["attention_mask"])
    ctx_pos = torch.arange(24).expand(2, -1)
    with torch.no_grad():
        h = drafter(noise_embeds=drafter.embed(blk), context_hidden_states=model.target_features(ids, batch["attention_mask"]),
                    position_ids=torch.cat([ctx_pos, pos], 1), attention_mask=mask).last_hidden_state
        logp = torch.log_softmax(drafter.compute_logits(h).float(), -1)
    num = den = 0.0
    for r in range(2):
        for c in range(lab.shape[1]):
            if lab[r, c] == IGNORE_INDEX:
                continue
            k = c % 4
            w = math.exp(-(k - 1) / gamma)
            num += -w * logp[r, c, lab[r, c]].item()
            den += w
    assert out["ce_loss"].item() == pytest.approx(num / den, rel=1e-4)
    assert out["loss"].item() == pytest.approx(out["ce_loss"].item(), rel=1e-6)


def test_length_head_loss_does_not_change_drafter_grads():
    target, drafter = tiny_pair(block_size=4)
    batch = fixed_batch()
    anchors, valid = sample_anchors(batch["loss_mask"], 4, generator=torch.Generator().manual_seed(0))
    grads = []
    for w in (0.0, 5.0):
        drafter.zero_grad(set_to_none=True)
        model = DrafterTrainingModel(target, drafter, length_head_weight=w)
        out = model(**batch, anchors=anchors, anchor_valid=valid)
        out["loss"].backward()
        grads.append({n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None})
        if w > 0:
            assert out["length_loss"] > 0
    body = [n for n in grads[0] if not n.startswith("length_head.")]
    assert body and set(body) == {n for n in grads[1] if not n.startswith("length_head.")}
    for n in body:
        torch.testing.assert_close(grads[0][n], grads[1][n], atol=0, rtol=0)
    assert not any(n.startswith("length_head.") for n in grads[0])
    assert any(n.startswith("length_head.") and g.abs().sum() > 0 for n, g in grads[1].items())
    assert all(p.grad is None for p in target.parameters())


def test_length_label_counts_leading_matches():
    """With a drafter whose every slot is right, accepted = B-1 on full blocks (label 1.0)."""
    target, drafter = tiny_pair(block_size=4)
    model = DrafterTrainingModel(target, drafter)
    ids = torch.full((1, 12), 5)  # constant sequence; make the LM head predict 5 everywhere
    with torch.no_grad():
        target.lm_head.weight.zero_()
        target.lm_head.weight[5] = 1.0
        drafter.norm.weight.fill_(1.0)
    out = model(ids, anchors=torch.tensor([[1, 5]]))
    assert out["accept_len"].item() == pytest.approx(4.0) and out["accuracy"].item() == 1.0


# ----------------------------------------------------------------------------- Trainer


def _args(tmp_path, steps, lr=3e-3, **kw):
    return TrainingArguments(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, learning_rate=lr,
                             max_steps=steps, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                             lr_scheduler_type="constant", max_grad_norm=1.0, seed=0, disable_tqdm=True, **kw)


def _samples(n=2, T=24, prompt=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 100, (T,), generator=g).tolist()
        out.append({"input_ids": ids, "loss_mask": [0] * prompt + [1] * (T - prompt)})
    return out


def test_trainer_steps_reduce_loss_and_checkpoint_reloads(tmp_path):
    target, drafter = tiny_pair(block_size=4)
    model = DrafterTrainingModel(target, drafter)
    target_before = {k: v.clone() for k, v in target.state_dict().items()}
    trainer = DrafterTrainer(model=model, args=_args(tmp_path, 25), train_dataset=_samples(2) * 8,
                             data_collator=DrafterDataCollator(pad_token_id=0))
    trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert len(losses) >= 20 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < 0.8 * losses[0]
    assert {"ce_loss", "length_loss", "accuracy", "accept_len"} <= set(trainer.state.log_history[0])
    for k, v in target.state_dict().items():  # the target never moves
        assert torch.equal(v, target_before[k])
    # the saved checkpoint is the drafter alone, native layout, loadable
    trainer.save_model(str(tmp_path / "ckpt"))
    reloaded = AdaFlashDrafter.from_pretrained(str(tmp_path / "ckpt"))
    sd = drafter.state_dict()
    for k, v in reloaded.state_dict().items():
        torch.testing.assert_close(v, sd[k])
    assert not any("embed" in k or "lm_head" in k for k in reloaded.state_dict())
    # resuming reloads the drafter weights
    with torch.no_grad():
        drafter.fc.weight.zero_()
    trainer._load_from_checkpoint(str(tmp_path / "ckpt"))
    torch.testing.assert_close(drafter.fc.weight, reloaded.fc.weight)
    # bf16 native save through the wrapper
    model.save_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    r16 = AdaFlashDrafter.from_pretrained(str(tmp_path / "bf16"))
    assert r16.fc.weight.dtype == torch.bfloat16
    cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert cfg["model_type"] == "adaflash"


def test_peft_lora_training(tmp_path):
    from peft import LoraConfig

    target, drafter = tiny_pair(block_size=4)
    base_before = {k: v.clone() for k, v in drafter.state_dict().items()}
    model = DrafterTrainingModel(target, drafter, peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    lora_before = {n: p.detach().clone() for n, p in model.drafter.named_parameters() if "lora_" in n}
    assert lora_before and all(p.requires_grad == ("lora_" in n) for n, p in model.drafter.named_parameters())
    trainer = DrafterTrainer(model=model, args=_args(tmp_path, 4), train_dataset=_samples(2) * 4,
                             data_collator=DrafterDataCollator(pad_token_id=0))
    trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert losses and all(math.isfinite(x) for x in losses)
    after = dict(model.drafter.named_parameters())
    assert any(not torch.equal(after[n], v) for n, v in lora_before.items())
    base_after = model.base_drafter.state_dict()
    for k, v in base_before.items():
        k2 = k if k in base_after else k.replace(".weight", ".base_layer.weight")
        assert torch.equal(base_after[k2], v), k
    # a merged native checkpoint reproduces the PEFT drafter's outputs
    trainer.save_model(str(tmp_path / "merged"))
    merged = AdaFlashDrafter.from_pretrained(str(tmp_path / "merged")).bind_target(target)
    batch = fixed_batch()
    anchors, valid = sample_anchors(batch["loss_mask"], 4, generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        a = model(**batch, anchors=anchors, anchor_valid=valid)["ce_loss"]
        b = DrafterTrainingModel(target, merged)(**batch, anchors=anchors, anchor_valid=valid)["ce_loss"]
    assert a.item() == pytest.approx(b.item(), rel=1e-5)
    assert set(drafter_state_dict(model.drafter)) == set(merged.state_dict())


def test_feature_cache_matches_on_the_fly(tmp_path):
    target, drafter = tiny_pair(block_size=4)
    model = DrafterTrainingModel(target, drafter)
    samples = _samples(3, seed=1)
    samples[2] = {"input_ids": samples[2]["input_ids"][:17], "loss_mask": samples[2]["loss_mask"][:17]}
    collator = DrafterDataCollator(pad_token_id=0)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        path = build_feature_cache(target, samples, tmp_path / str(dtype), drafter.config.target_layer_ids,
                                   collator=collator, batch_size=2, shard_bytes=4000, dtype=dtype, progress=False)
        ds = FeatureCacheDataset(path, layer_ids=drafter.config.target_layer_ids)
        assert len(ds) == 3 and len(ds.index["shards"]) >= 2
        cached = collator([ds[i] for i in range(3)])
        results[dtype] = cached
    plain = collator(samples)
    with torch.no_grad():  # cached features are exactly select_context(hidden_states) of the target
        hs = target(plain["input_ids"], attention_mask=plain["attention_mask"], output_hidden_states=True).hidden_states
        torch.testing.assert_close(model.target_features(plain["input_ids"], plain["attention_mask"]),
                                   drafter.select_context(hs))
    anchors, valid = sample_anchors(plain["loss_mask"], 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(**plain, anchors=anchors, anchor_valid=valid)["loss"]
        f32 = model(**results[torch.float32], anchors=anchors, anchor_valid=valid)["loss"]
        bf16 = model(**results[torch.bfloat16], anchors=anchors, anchor_valid=valid)["loss"]
    for k in ("input_ids", "attention_mask", "loss_mask"):
        assert torch.equal(results[torch.float32][k], plain[k])
    assert f32.item() == pytest.approx(ref.item(), rel=1e-5)
    assert bf16.item() == pytest.approx(ref.item(), rel=2e-2)
    with pytest.raises(ValueError, match="layers"):
        FeatureCacheDataset(path, layer_ids=[0])
    # the Trainer runs from the cache too
    trainer = DrafterTrainer(model=model, args=_args(tmp_path, 2), train_dataset=FeatureCacheDataset(path),
                             data_collator=collator)
    trainer.train()


def test_train_length_head_only_touches_head(capsys):
    target, drafter = tiny_pair(block_size=4)
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    loader = [DrafterDataCollator(pad_token_id=0)(_samples(2))] * 3
    losses = train_length_head(drafter, target, loader, steps=30, lr=1e-2, log_every=10)
    assert len(losses) == 30 and losses[-1] < losses[0]
    logged = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[length head]")]
    assert [line.split()[3] for line in logged] == ["10/30", "20/30", "30/30"]
    after = drafter.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith("length_head.") for k in changed)
    assert drafter.config.length_head_trained
    assert all(p.requires_grad for p in drafter.parameters())  # flags restored


# ----------------------------------------------------------------------------- data


@pytest.fixture(scope="module")
def chat_tokenizer():
    from adaflash_hf.training.tokenizer import train_tokenizer

    texts = ["hello world, how are you?", "the quick brown fox jumps over the lazy dog 12345"] * 20
    return train_tokenizer(texts, vocab_size=300)


def test_collator_chat_masks_assistant_tokens(chat_tokenizer):
    tok = chat_tokenizer
    msgs = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world fox"},
            {"role": "user", "content": "how"}, {"role": "assistant", "content": "lazy dog"}]
    enc = encode_sample(tok, {"messages": msgs})
    resp = tok.decode([t for t, m in zip(enc["input_ids"], enc["loss_mask"]) if m])
    assert resp == "world fox<|im_end|>lazy dog<|im_end|>"
    text = encode_sample(tok, {"text": "the quick fox"})
    assert all(text["loss_mask"])
    pr = encode_sample(tok, {"prompt": "hello ", "response": "world"})
    assert tok.decode([t for t, m in zip(pr["input_ids"], pr["loss_mask"]) if m]) == "world"
    batch = DrafterDataCollator(tok, max_length=8)([{"messages": msgs}, {"text": "fox"}])
    assert batch["input_ids"].shape[1] == 8
    assert not batch["loss_mask"][1, batch["attention_mask"][1].sum():].any()
    assert (batch["input_ids"][1, ~batch["attention_mask"][1]] == tok.pad_token_id).all()


@pytest.fixture
def target_dir(tmp_path, chat_tokenizer):
    """A tiny target and the chat tokenizer saved together in ``tmp_path / "target"``, as train_drafter loads them."""
    target = tiny_target(vocab=320)
    target.config.eos_token_id = chat_tokenizer.eos_token_id
    target.save_pretrained(tmp_path / "target")
    chat_tokenizer.save_pretrained(tmp_path / "target")
    return tmp_path / "target"


def test_cli_smoke(tmp_path, chat_tokenizer, target_dir):
    """Regeneration + a few Trainer steps + save, on CPU, from a tiny target folder."""
    from adaflash_hf.training import train_drafter

    out = tmp_path / "drafter"
    rc = train_drafter.main([
        "--target", str(target_dir), "--out", str(out), "--device", "cpu", "--domains", "chat,prose",
        "--num-prompts", "4", "--max-new-tokens", "12", "--gen-batch-size", "2", "--steps", "3",
        "--block-size", "4", "--batch-size", "2", "--max-length", "64", "--logging-steps", "1",
        "--eval-per-domain", "1", "--eval-domains", "chat", "--no-progress", "--temperature", "1.0",
        "--regen-cache", str(tmp_path / "regen.jsonl"), "--sampled-answers", "2",
    ])
    assert rc == 0
    d = AdaFlashDrafter.from_pretrained(str(out))
    assert d.config.block_size == 4 and d.config.mask_token_id == chat_tokenizer.mask_token_id and d.config.length_head_trained
    assert d.fc.weight.dtype == torch.bfloat16
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert any("loss" in r and "lr" in r for r in log)
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] == 3 and "chat" in summary["eval_accept_proxy"]
    per = summary["regeneration"]["per_domain"]  # 2 chat prompts, each answered once greedily + 2 sampled
    assert per["prose"] <= 2 < per["chat"] <= 6
    assert (tmp_path / "regen.jsonl").is_file()


def test_init_from_continues_a_checkpoint_and_refuses_a_mismatch_before_regenerating(tmp_path, target_dir, monkeypatch):
    """A run cut into several calls: ``--init-from`` starts from the checkpoint's weights (with lr 0 the saved
    drafter is the checkpoint, bit for bit; the control, a fresh start, is not; ``--length-head-type`` puts a fresh
    head of that form on the checkpoint's body), and layer flags that disagree with the checkpoint stop the run
    with one error naming them, before any regeneration."""
    from adaflash_hf.training import train_drafter

    common = ["--target", str(target_dir), "--device", "cpu", "--domains", "chat", "--num-prompts", "2",
              "--max-new-tokens", "8", "--gen-batch-size", "2", "--block-size", "4", "--batch-size", "2",
              "--max-length", "48", "--eval-per-domain", "0", "--no-progress", "--regen-cache", str(tmp_path / "regen.jsonl")]
    assert train_drafter.main(common + ["--out", str(tmp_path / "a"), "--steps", "2"]) == 0
    a_dir = str(tmp_path / "a")
    for init, out in ((["--init-from", a_dir], "b"), ([], "c"), (["--init-from", a_dir, "--length-head-type", "paper"], "p")):
        assert train_drafter.main(common + ["--out", str(tmp_path / out), "--steps", "1", "--lr", "0"] + init) == 0
    a, b, c = (AdaFlashDrafter.from_pretrained(str(tmp_path / x)).state_dict() for x in "abc")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    paper = AdaFlashDrafter.from_pretrained(str(tmp_path / "p"))  # the checkpoint's body under a fresh paper-form head
    assert paper.config.length_head_type == "paper" and type(paper.length_head).__name__ == "AdaFlashPaperLengthHead"
    body = {k: v for k, v in paper.state_dict().items() if not k.startswith("length_head.")}
    assert body and all(torch.equal(a[k], v) for k, v in body.items())
    monkeypatch.setattr(train_drafter, "regenerate", lambda *a, **k: pytest.fail("regenerated before the check"))
    (tmp_path / "regen.jsonl").unlink()
    with pytest.raises(SystemExit, match=r"--num-layers 3 \(the checkpoint has 2\).*--block-size 8 \(the checkpoint has 4\)"):
        train_drafter.main(common[:-2] + ["--out", str(tmp_path / "d"), "--init-from", str(tmp_path / "a"),
                                          "--num-layers", "3", "--block-size", "8"])


def test_flash_attention_drafter_is_refused():
    target, drafter = tiny_pair()
    drafter.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="block attention mask"):
        DrafterTrainingModel(target, drafter)


@pytest.mark.parametrize("per_sample", [1, 3])
def test_build_prompts_draws_several_prompts_per_sample(chat_tokenizer, per_sample):
    """Each conversation gives its first user turns (with history), each prose chunk prefixes at offsets."""
    from adaflash_hf.training.train_drafter import build_prompts

    tok = chat_tokenizer
    ps = build_prompts(tok, ["chat", "prose"], 10_000, "train", seed=0, prose_prefix=8, prompts_per_sample=per_sample)
    by = {d: [p["prompt_ids"] for p in ps if p["domain"] == d] for d in ("chat", "prose")}
    base = {d: len([p for p in build_prompts(tok, [d], 10_000, "train", seed=0, prose_prefix=8)]) for d in by}
    for d, ids in by.items():
        assert all(1 <= len(x) for x in ids)
        if per_sample == 1:
            assert len(ids) == base[d]
        else:
            assert base[d] < len(ids) <= per_sample * base[d]
            assert len({tuple(x) for x in ids}) > 0.9 * len(ids)  # distinct prompts, not copies
    assert all(len(x) <= 8 for x in by["prose"])
    capped = build_prompts(tok, ["chat", "prose"], 7, "train", seed=0, prompts_per_sample=per_sample)
    assert len(capped) == 7
    with pytest.raises(ValueError, match="prompts_per_sample"):
        build_prompts(tok, ["chat"], 4, prompts_per_sample=0)


def test_regen_cache_is_reused_only_with_the_settings_that_made_it(tmp_path, target_dir, monkeypatch):
    """``--regen-cache`` writes its settings beside the samples; a later call with the same settings reuses the
    samples without regenerating, one with another ``--seed`` / ``--max-prompt-tokens`` (or a cache without its
    settings file) stops with one error naming the difference, before any regeneration."""
    from adaflash_hf.training import train_drafter

    cache = tmp_path / "regen.jsonl"
    common = ["--target", str(target_dir), "--device", "cpu", "--domains", "chat", "--num-prompts", "2",
              "--max-new-tokens", "8", "--gen-batch-size", "2", "--no-progress", "--regen-cache", str(cache),
              "--regen-only", "--out", str(tmp_path / "r")]
    assert train_drafter.main(common) == 0
    saved = json.loads((tmp_path / "regen.jsonl.settings.json").read_text())
    assert saved["seed"] == 0 and saved["domains"] == ["chat"] and cache.read_text().count("\n") >= 2
    assert not list(tmp_path.glob(".tmp-adaflash-*"))  # written beside, then renamed
    monkeypatch.setattr(train_drafter, "regenerate", lambda *a, **k: pytest.fail("regenerated a cached run"))
    assert train_drafter.main(common) == 0  # control: the same settings reuse the cache
    from_python = train_drafter.config_from_args(train_drafter.parse_args(common))
    train_drafter.check_regen_cache(dataclasses.replace(from_python, domains=("chat",)))  # a tuple is the saved list
    for extra, message in ((["--seed", "1"], r"seed 0 there, 1 here"),
                           (["--max-prompt-tokens", "64"], r"max_prompt_tokens 384 there, 64 here")):
        with pytest.raises(SystemExit, match=message):
            train_drafter.main(common + extra)
    (tmp_path / "regen.jsonl.settings.json").unlink()
    with pytest.raises(SystemExit, match="regen.jsonl.settings.json"):
        train_drafter.main(common)


def test_train_domains_train_on_part_of_one_shared_regeneration(tmp_path, target_dir, monkeypatch):
    """Drafters that each leave a domain out share one regeneration: ``--train-domains`` keeps that domain's samples
    out of training (the control, the same cache without it, trains on both), regenerating nothing; a domain that is
    not regenerated is refused before any work."""
    from adaflash_hf.training import train_drafter

    cache = tmp_path / "regen.jsonl"
    common = ["--target", str(target_dir), "--device", "cpu", "--domains", "chat,prose", "--num-prompts", "4",
              "--max-new-tokens", "8", "--gen-batch-size", "4", "--no-progress", "--regen-cache", str(cache),
              "--block-size", "4", "--batch-size", "2", "--max-length", "48", "--eval-per-domain", "0", "--steps", "1"]
    assert train_drafter.main(common + ["--out", str(tmp_path / "both")]) == 0
    monkeypatch.setattr(train_drafter, "regenerate", lambda *a, **k: pytest.fail("regenerated a cached run"))
    assert train_drafter.main(common + ["--out", str(tmp_path / "no-prose"), "--train-domains", "chat"]) == 0
    per = {d: json.loads((tmp_path / d / "train_summary.json").read_text())["regeneration"]["per_domain"]
           for d in ("both", "no-prose")}
    cached = [json.loads(line)["domain"] for line in cache.read_text().splitlines()]
    assert per["both"] == {"chat": cached.count("chat"), "prose": cached.count("prose")} and per["both"]["prose"] > 0
    assert per["no-prose"] == {"chat": cached.count("chat")}
    with pytest.raises(SystemExit, match="--train-domains math is not a subset of --domains chat,prose"):
        train_drafter.main(common + ["--out", str(tmp_path / "x"), "--train-domains", "math"])
