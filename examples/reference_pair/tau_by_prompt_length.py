"""Greedy `fixed` tau of the reference pair on one eval set, short prompts against long ones.

Up to v7 the drafter's recipe cut its training prompts to their last 384 tokens (`--max-prompt-tokens`), while the
sharegpt set's first turns run to thousands. This probe measures whether long prompts cost tau: the first
`--per-group` prompts of each length group, each generated alone (batch 1) with
`target.generate(ids, assistant_model=drafter, length_policy="fixed")`, pooled tau = committed tokens / rounds over the group; beside it,
prompt lookup's tau on the same prompts (`prompt_lookup_rounds`, exact under greedy decoding, the prefill a round).

    ADAFLASH_DATA=/tmp/ev/data python examples/reference_pair/tau_by_prompt_length.py --dataset sharegpt
    ... --drafter DIR    # another drafter on the reference target
"""

import argparse
import json
import os

import torch

from adaflash_hf.bench.prompt_lookup_tau import PromptLookupSettings, as_generation_stats, prompt_lookup_rounds
from adaflash_hf.loading import load_models
from adaflash_hf.reference import REFERENCE_DIR
from adaflash_hf.speculation.rounds import mean_tokens_per_round
from adaflash_hf.training.data import eval_prompts


def group_tau(target, drafter, prompts: list[torch.Tensor], max_new_tokens: int) -> dict:
    """Pooled and per-prompt mean tau of ``prompts`` (each ``[1, n]``), every output checked against plain greedy,
    and prompt lookup's pooled tau (10 tokens) on the same greedy outputs."""
    eos = target.generation_config.eos_token_id
    eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    accepted, taus, lookup = [], [], []
    for ids in prompts:
        out, stats = target.generate(ids, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False,
                                     length_policy="fixed", return_stats=True)
        plain = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        if not torch.equal(out, plain):
            raise AssertionError("speculative output differs from plain greedy")
        lookup.append(prompt_lookup_rounds(ids[0].tolist(), plain[0, ids.shape[1]:].tolist(), max_new_tokens, eos))
        accepted += stats.accepted  # every verify round of the group, pooled by tau's one definition
        taus.append(stats.tau)
    return {"prompts": len(prompts), "mean_prompt_tokens": sum(p.shape[1] for p in prompts) / max(len(prompts), 1),
            "tau_pooled": mean_tokens_per_round(accepted) if accepted else None, "tau_mean": sum(taus) / max(len(taus), 1),
            "prompt_lookup_tau": as_generation_stats(lookup, PromptLookupSettings()).tau if lookup else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="sharegpt")
    ap.add_argument("--num-prompts", type=int, default=500, help="the set's first prompts the groups are drawn from")
    ap.add_argument("--per-group", type=int, default=30)
    ap.add_argument("--split", type=int, default=384, help="short: <= this many prompt tokens; long: above it")
    ap.add_argument("--longest", type=int, default=1900, help="long prompts stop here (the target knows 2048 positions)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drafter", default=None, help="another drafter folder for the reference target (default: the shipped one)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    # another drafter goes through the CLI's loader, which checks the folder and binds it to the target
    own = {"target": os.path.join(REFERENCE_DIR, "target"), "drafter": args.drafter} if args.drafter else {"reference": True}
    target, drafter, tok, _ = load_models(**own, device="cpu", dtype=torch.float32)
    ids = [tok.apply_chat_template(p["messages"], add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
           for p in eval_prompts(args.dataset)[: args.num_prompts]]
    groups = {f"short (<= {args.split})": [x for x in ids if x.shape[1] <= args.split][: args.per_group],
              f"long ({args.split + 1}-{args.longest})": [x for x in ids if args.split < x.shape[1] <= args.longest][: args.per_group]}
    share = sum(x.shape[1] > args.split for x in ids) / len(ids)
    print(f"{args.dataset}: {share:.1%} of the first {len(ids)} prompts are over {args.split} tokens", flush=True)
    for name, group in groups.items():
        print(name, json.dumps(group_tau(target, drafter, group, args.max_new_tokens)), flush=True)
    print("identical: True (every output equals plain greedy)")


if __name__ == "__main__":
    main()
