"""PEFT LoRA on the drafter's attention projections: attach, train, save/reload, merge."""

import pytest
import torch
from conftest import build_drafter, build_tiny_target, drafter_inputs, spec_dflash_keys
from peft import LoraConfig, PeftModel, get_peft_model

from adaflash_hf import AdaFlashDrafter

TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]

# (family, drafter layers, LoRA rank)
PEFT_CASES = [("qwen3", 2, 4), ("llama", 1, 8)]


def _lora(init_lora_weights=True, r=4):
    return LoraConfig(r=r, lora_alpha=2 * r, target_modules=TARGET_MODULES, lora_dropout=0.0, init_lora_weights=init_lora_weights)


def _setup(family, num_layers):
    target = build_tiny_target(family)
    drafter = build_drafter(target, num_layers=num_layers, block_size=8)
    base_state = {k: v.clone() for k, v in drafter.state_dict().items()}
    return target, drafter, base_state


def _out(model, inputs):
    with torch.no_grad():
        return model(**inputs).last_hidden_state


def _fresh_base(family, num_layers, base_state):
    target = build_tiny_target(family)
    fresh = build_drafter(target, num_layers=num_layers, block_size=8, seed=123)  # different init ...
    fresh.load_state_dict(base_state)  # ... then the same base weights
    return fresh


@pytest.mark.parametrize("family, num_layers, r", PEFT_CASES)
def test_lora_attaches_and_trains_only_lora(family, num_layers, r):
    target, drafter, base_state = _setup(family, num_layers)
    model = get_peft_model(drafter, _lora(r=r))
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    # lora_A and lora_B on each of the four projections of every layer.
    assert len(trainable) == num_layers * len(TARGET_MODULES) * 2
    for module in TARGET_MODULES:
        assert any(f"self_attn.{module}.lora_A" in n for n in trainable), module
    # Only the drafter is adapted: the target it is bound to stays untouched.
    assert not any("lora_" in n for n, _ in target.named_parameters())
    target_ptrs = {p.data_ptr() for p in target.parameters()}
    assert not any(p.data_ptr() in target_ptrs for p in model.parameters())
    target.requires_grad_(False)  # frozen, as in training: the shared LM head is used, never trained
    target_before = {n: p.clone() for n, p in target.state_dict().items()}

    inputs = drafter_inputs(drafter, target, batch=2, ctx_len=5)
    base_out = _out(model, inputs)
    # Default LoRA init (B = 0) starts as the identity.
    with model.disable_adapter():
        torch.testing.assert_close(_out(model, inputs), base_out)

    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    hidden = model(**inputs).last_hidden_state
    logits = drafter.compute_logits(hidden[:, 1:])
    labels = torch.randint(0, logits.shape[-1], logits.shape[:-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    optimizer.step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed, "the LoRA step changed nothing"
    assert all("lora_B" in n for n in changed)  # A gets no gradient while B == 0
    assert len(changed) == num_layers * len(TARGET_MODULES)
    for n, p in target.state_dict().items():
        torch.testing.assert_close(p, target_before[n], rtol=0, atol=0)
    model.eval()
    assert not torch.allclose(_out(model, inputs), base_out)
    # The base weights under the adapter are unchanged.
    for k, v in model.get_base_model().state_dict().items():
        if "lora_" not in k:
            torch.testing.assert_close(v, base_state[k.replace(".base_layer", "")], rtol=0, atol=0)


@pytest.mark.parametrize("family, num_layers, r", PEFT_CASES)
def test_lora_save_reload_and_merge(tmp_path, family, num_layers, r):
    target, drafter, base_state = _setup(family, num_layers)
    model = get_peft_model(drafter, _lora(init_lora_weights=False, r=r))  # random B: the adapter matters
    inputs = drafter_inputs(drafter, target, batch=2, ctx_len=5)
    peft_out = _out(model, inputs)
    with model.disable_adapter():
        assert not torch.allclose(_out(model, inputs), peft_out, atol=1e-4)

    model.save_pretrained(tmp_path)
    assert (tmp_path / "adapter_model.safetensors").exists() and (tmp_path / "adapter_config.json").exists()
    assert not (tmp_path / "adapter_model.bin").exists()

    reloaded = PeftModel.from_pretrained(_fresh_base(family, num_layers, base_state), tmp_path)
    torch.testing.assert_close(_out(reloaded, inputs), peft_out, rtol=0, atol=0)

    merged = model.merge_and_unload()
    assert type(merged) is AdaFlashDrafter
    assert set(merged.state_dict()) == set(spec_dflash_keys(num_layers)) | {
        f"length_head.{m}.{t}" for m in ("down", "res.0", "out") for t in ("weight", "bias")
    }
    torch.testing.assert_close(_out(merged, inputs), peft_out, atol=1e-5, rtol=1e-4)
    # The merged drafter saves and reloads as a plain drafter.
    merged.save_pretrained(tmp_path / "merged")
    again = AdaFlashDrafter.from_pretrained(tmp_path / "merged").bind_target(target)
    torch.testing.assert_close(_out(again, inputs), _out(merged, inputs), rtol=0, atol=0)
