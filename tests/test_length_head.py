"""The length head's two forms (``length_head_type``): the released one and the paper's (per-slot Linear +
SiLU, mean over the block, Linear, sigmoid): built from the config, saved and loaded, trainable."""

from __future__ import annotations

import pytest
import torch

from adaflash_hf import AdaFlashDrafter
from adaflash_hf.modeling import AdaFlashConfig, AdaFlashLengthHead, AdaFlashPaperLengthHead, write_dflash_checkpoint
from adaflash_hf.training.losses import length_head_loss

from generation_helpers import make_drafter, make_target

B = 8


@pytest.fixture(scope="module")
def target():
    return make_target("qwen3", seed=2)


@pytest.mark.parametrize("kind,cls", [("released", AdaFlashLengthHead), ("paper", AdaFlashPaperLengthHead)])
def test_head_type_round_trips_through_a_checkpoint(target, tmp_path, kind, cls):
    d = make_drafter(target, block_size=B, length_head_type=kind)
    assert isinstance(d.length_head, cls)
    d.save_pretrained(tmp_path)
    back = AdaFlashDrafter.from_pretrained(tmp_path).bind_target(target).eval()
    assert back.config.length_head_type == kind and isinstance(back.length_head, cls)
    h = torch.randn(3, B, d.config.hidden_size)
    torch.testing.assert_close(back.predict_accept_ratio(h), d.predict_accept_ratio(h))


def test_paper_head_is_per_slot_then_mean_pool():
    head = AdaFlashPaperLengthHead(hidden_size=6, dim=4)
    h = torch.randn(2, B, 6)
    manual = torch.sigmoid(head.out(torch.stack([torch.nn.functional.silu(head.proj(h[:, j])) for j in range(B)], 1)
                                     .mean(1)).squeeze(-1))
    torch.testing.assert_close(head(h), manual)
    assert not torch.equal(head(h), head(h.flip(0)))  # rows are independent blocks


@pytest.mark.parametrize("kind", ["released", "paper"])
def test_both_heads_learn_the_acceptance_label(kind):
    torch.manual_seed(0)
    cfg = AdaFlashConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=8, vocab_size=64, mask_token_id=63, num_target_layers=2,
                         block_size=B, length_head_dim=8, length_head_type=kind)
    head = AdaFlashDrafter(cfg).length_head
    h = torch.randn(32, B, 16)
    accepted = (h[:, :, 0].mean(1) > 0).long() * (B - 2)  # a label the block states determine
    opt = torch.optim.Adam(head.parameters(), lr=3e-2)
    first = float(length_head_loss(head(h), accepted, B).detach())
    for _ in range(60):
        loss = length_head_loss(head(h), accepted, B)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.3 * first


def test_unknown_head_type_is_refused():
    with pytest.raises(ValueError, match="length_head_type"):
        AdaFlashConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, vocab_size=64, mask_token_id=63,
                       length_head_type="tiny")


def test_paper_head_has_no_dflash_layout(target, tmp_path):
    d = make_drafter(target, block_size=B, length_head_type="paper")
    with pytest.raises(ValueError, match="paper's length-head variant"):
        write_dflash_checkpoint(d, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
