"""`examples/reference_pair/tau_by_prompt_length.py`: pooled tau over a group, and its identity check."""

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "reference_pair" / "tau_by_prompt_length.py"
spec = importlib.util.spec_from_file_location("tau_by_prompt_length", SCRIPT)
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)


def test_group_tau_pools_rounds_and_refuses_a_differing_output(tiny_target, make_drafter):
    target = tiny_target()
    drafter = make_drafter(target)
    prompts = [torch.tensor([[3, 4, 5, 6]]), torch.tensor([[7, 8, 9, 10, 11, 12, 13]])]
    res = probe.group_tau(target, drafter, prompts, max_new_tokens=12)
    assert res["prompts"] == 2 and res["mean_prompt_tokens"] == 5.5
    assert 1.0 <= res["tau_pooled"] <= drafter.config.block_size
    assert 1.0 <= res["tau_mean"] <= drafter.config.block_size
    assert 1.0 <= res["prompt_lookup_tau"] <= 11  # 10 candidates + the target's own token
    _, alone = target.generate(prompts[1], assistant_model=drafter, max_new_tokens=12, do_sample=False,
                               length_policy="fixed", return_stats=True)
    assert probe.group_tau(target, drafter, prompts[1:], max_new_tokens=12)["tau_pooled"] == pytest.approx(alone.tau)

    # negative control: a target whose plain decoding differs from its speculative one must be caught
    class Skewed(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.generation_config = inner.generation_config

        def generate(self, ids, **kw):
            out = self.inner.generate(ids, **kw)
            return out if "assistant_model" in kw else out.roll(1, dims=1)

    with pytest.raises(AssertionError, match="differs from plain greedy"):
        probe.group_tau(Skewed(target), drafter, prompts[:1], max_new_tokens=12)
