"""One online update on the reference pair: does it fit its own rounds and hurt held-out ones?

Collects verified rounds (fixed policy) from held-out gsm8k prompts 1-8 and from prompts 9-11,
trains one OPD update on 128 rounds of the latter, and prints the OPD loss on both sets, the
held-out greedy tau, and the acceptance of draft slots 1-3, before and after the update.

    ADAFLASH_DATA=../shared/data python examples/reference_pair/diagnose_online_update.py

It studies round samples (``sample_unit="round"``), the unit that overfit; the adapter's default
unit is now the finished request (BENCHMARKS.md section 3).
"""

import argparse

import torch

import adaflash_hf
from adaflash_hf.online import OnlineAdapter
from adaflash_hf.online.adapter import copy_drafter
from adaflash_hf.training.data import eval_prompts


class Collect:
    def __init__(self):
        self.rounds = []

    def on_round(self, verified):
        self.rounds.append(verified)


def serve(target, drafter, tok, prompts, max_new_tokens):
    """Rounds, tau and slot-1..3 acceptance of greedy fixed-policy decoding of `prompts`."""
    sink, accepted = Collect(), []
    for p in prompts:
        ids = tok.apply_chat_template(p["messages"], add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
        _, stats = target.generate(ids, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False,
                                   length_policy="fixed", return_stats=True, round_sink=sink)  # fmt: skip
        accepted += stats.accepted
    tau = (sum(accepted) + len(accepted)) / len(accepted)
    return sink.rounds, tau, [round(sum(a >= j for a in accepted) / len(accepted), 3) for j in (1, 2, 3)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--label-modes", default="verified,rollout")
    p.add_argument("--max-new-tokens", type=int, default=96)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    target, base, tok = adaflash_hf.load_reference_pair()
    prompts = eval_prompts("gsm8k", limit=11)
    for mode in a.label_modes.split(","):
        drafter = copy_drafter(base, target)
        held, tau0, slots0 = serve(target, drafter, tok, prompts[:8], a.max_new_tokens)
        train, _, _ = serve(target, drafter, tok, prompts[8:11], a.max_new_tokens)
        adapter = OnlineAdapter(drafter, target, method="opd", sample_unit="round", samples_per_update=10**6, label_mode=mode)
        before = adapter.evaluate(held)["loss"], adapter.evaluate(train)["loss"]
        for r in train[:128]:
            adapter.on_round(r)
        adapter.flush(600)
        after = adapter.evaluate(held)["loss"], adapter.evaluate(train)["loss"]
        adapter.close()
        _, tau1, slots1 = serve(target, drafter, tok, prompts[:8], a.max_new_tokens)
        print(f"{mode}: OPD loss on its own rounds {before[1]:.3f} -> {after[1]:.3f}, on held-out rounds "
              f"{before[0]:.3f} -> {after[0]:.3f}; held-out tau {tau0:.3f} -> {tau1:.3f}; "
              f"slot 1-3 acceptance {slots0} -> {slots1}")  # fmt: skip


if __name__ == "__main__":
    main()
