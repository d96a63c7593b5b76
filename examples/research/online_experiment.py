"""Does online adaptation raise tau on new traffic? Measure it, method by method.

For each method (`opd`, `osd`, `off`) a fresh copy of the drafter serves a stream of prompts from a
domain it was not trained on, with an [`OnlineAdapter`] attached. After every update the adapter is
paused and greedy tau is measured on a fixed held-out prompt set of the same domain, whose outputs
are also compared with plain greedy decoding (lossless check). Result: tau per update per method,
the length head's mean absolute error on the held-out rounds at each measurement, and the adapter's
per-update records (head error on served rounds before / after each swap).

    python examples/research/online_experiment.py --target T --drafter D --dataset gsm8k --updates 6 --out runs/online
"""

import argparse
import json
import os
import random
import time

import torch

from adaflash_hf.generation.prompts import encode_prompt, left_pad
from adaflash_hf.modeling import AdaFlashDrafter
from adaflash_hf.online.adapter import OnlineAdapter, copy_drafter
from adaflash_hf.online.versions import write_text_atomic


class HeadError:
    """Round sink of one measurement: the length head's mean absolute error over the rounds whose
    real acceptance is known (`VerifiedRound.head_error`); None without a head."""

    def __init__(self, block_size: int):
        self.block_size, self.total, self.count = block_size, 0.0, 0

    def on_round(self, verified) -> None:
        err = verified.head_error(self.block_size)
        if err is not None:
            self.total, self.count = self.total + err, self.count + 1

    @property
    def mae(self) -> float | None:
        return self.total / self.count if self.count else None


def _measure(target, drafter, batches, max_new_tokens, references, policy, pad) -> dict:
    """Greedy tau over the held-out `batches` (adapter paused), whether every output equals the
    plain greedy `references` of the same batches, the mean verify length and the length head's
    error on these rounds. A row's rounds do not depend on the other rows (each verifies its own
    block), so batching changes the speed of the measurement, not tau."""
    accepted = rounds = verified = 0
    identical = True
    head = HeadError(drafter.config.block_size)
    for (ids, mask), ref in zip(batches, references):
        out, stats = target.generate(ids, attention_mask=mask, assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False, return_stats=True, length_policy=policy, pad_token_id=pad, round_sink=head)
        accepted, rounds, verified = accepted + sum(stats.accepted), rounds + stats.rounds, verified + sum(stats.verify_lengths)
        identical &= torch.equal(out, ref)
    n = max(rounds, 1)
    return {"tau": (accepted + rounds) / n, "identical": identical, "mean_verify_length": verified / n, "head_mae": head.mae, "head_rounds": head.count}


def stream_order(prompts: list, seed: int) -> list:
    """The stream's prompts in the order a run with ``seed`` serves them: file order for seed 0,
    a ``random.Random(seed)`` permutation otherwise (repeats of a run differ in what each update sees).

    Example:
        >>> stream_order([1, 2, 3], 0)
        [1, 2, 3]
        >>> sorted(stream_order([1, 2, 3], 5))
        [1, 2, 3]
    """
    out = list(prompts)
    if seed:
        random.Random(seed).shuffle(out)
    return out


def run_online_experiment(target, drafter, tokenizer, stream, held_out, methods=("opd", "osd"), updates=6, samples_per_update=128, epochs=2, max_new_tokens=128, seed=0, policy="fixed", lr=3e-4, head_lr=2e-4, label_mode="verified", sample_unit="request", stream_batch=16, measure_batch=16, checkpoint=None, alpha=0.8, clip=0.01, clip_mode="token", measure_fixed=False) -> dict:
    """Tau on `held_out` after each online update, for each method (see the module docstring).

    `policy` is the verify-length policy used both to serve the stream and to measure: `fixed`
    verifies whole blocks, so every round supervises B-1 draft positions and the measured tau is
    the drafter's own quality, not the length head's choice. The stream is served in left-padded
    batches of `stream_batch` prompts (batched speculative decoding; every row is a request).
    `checkpoint(result)`, when given, is called after every measurement (partial results survive
    a timeout). `alpha`, `clip`, `clip_mode`: the OPD loss settings (``adaflash_hf.training.losses.opd_loss``).
    `measure_fixed`: under another policy, also measure with `fixed` (``fixed_tau``: the drafter's own
    quality beside what the policy served).
    """
    device = next(target.parameters()).device
    stream_ids = [encode_prompt(tokenizer, p.get("messages", p.get("text"))) for p in stream]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    held_ids = [encode_prompt(tokenizer, p.get("messages", p.get("text"))) for p in held_out]
    held = [left_pad(held_ids[i : i + measure_batch], pad, device) for i in range(0, len(held_ids), measure_batch)]
    references = [target.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad) for ids, mask in held]

    def measure(d) -> dict:
        m = _measure(target, d, held, max_new_tokens, references, policy, pad)
        if measure_fixed and policy != "fixed":
            f = _measure(target, d, held, max_new_tokens, references, "fixed", pad)
            m.update(fixed_tau=f["tau"], identical=m["identical"] and f["identical"])
        return m

    result = {"methods": {}, "seed": seed, "samples_per_update": samples_per_update, "epochs": epochs, "max_new_tokens": max_new_tokens, "policy": policy, "lr": lr, "head_lr": head_lr, "label_mode": label_mode, "sample_unit": sample_unit, "stream_batch": stream_batch, "measure_batch": measure_batch, "alpha": alpha, "clip": clip, "clip_mode": clip_mode}
    for method in methods:
        torch.manual_seed(seed)
        d = copy_drafter(drafter, target)
        curve = [{"update": 0, **measure(d), "served_prompts": 0}]
        result["methods"][method] = {"curve": curve, "complete": False}
        adapter = OnlineAdapter(d, target, method=method, samples_per_update=samples_per_update, epochs=epochs, lr=lr, head_lr=head_lr, label_mode=label_mode, sample_unit=sample_unit, seed=seed, alpha=alpha, clip=clip, clip_mode=clip_mode)
        served, start = 0, time.perf_counter()
        for update in range(1, updates + 1):
            adapter.attach()
            while adapter.stats["updates"] + adapter.stats["failures"] < update and served < len(stream_ids):
                ids, mask = left_pad(stream_ids[served : served + stream_batch], pad, device)
                target.generate(ids, attention_mask=mask, assistant_model=d, max_new_tokens=max_new_tokens, do_sample=False, length_policy=policy, pad_token_id=pad)
                served += ids.shape[0]
                adapter.wait_for_update()
            adapter.detach()
            if adapter.stats["updates"] < update:
                break
            m = measure(d)
            curve.append({"update": update, **m, "served_prompts": served, "loss": adapter.stats["last_loss"]})
            result["methods"][method]["updates"] = adapter.stats["history"]
            print(f"[online] {method} update {update}: held-out tau {m['tau']:.3f} head MAE {m['head_mae']} identical={m['identical']} (served {served})", flush=True)
            if checkpoint is not None:
                checkpoint(result)
        adapter.close()
        result["methods"][method] = {"curve": curve, "updates": adapter.stats["history"], "failures": adapter.stats["failures"], "seconds": time.perf_counter() - start, "complete": True}
    return result


def plot_curves(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for method, r in result["methods"].items():
        ax.plot([c["update"] for c in r["curve"]], [c["tau"] for c in r["curve"]], marker="o", label=method)
    ax.set_xlabel("online update")
    ax.set_ylabel("held-out greedy tau")
    ax.set_title(f"online adaptation on {result.get('dataset', 'new traffic')}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from adaflash_hf.training.data import eval_prompts

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--dataset", default="gsm8k", help="eval dataset name (a domain the drafter did not see)")
    p.add_argument("--methods", default="opd,osd")
    p.add_argument("--updates", type=int, default=6)
    p.add_argument("--held-out", type=int, default=16)
    p.add_argument("--stream", type=int, default=400)
    p.add_argument("--samples-per-update", type=int, default=128)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-4, help="drafter learning rate (paper: 3e-4)")
    p.add_argument("--head-lr", type=float, default=2e-4)
    p.add_argument("--label-mode", default="verified", choices=("verified", "rollout"), help="round samples only")
    p.add_argument("--sample-unit", default="request", choices=("request", "round"))
    p.add_argument("--stream-batch", type=int, default=16, help="stream prompts served per batched generate call")
    p.add_argument("--measure-batch", type=int, default=16, help="held-out prompts measured per batched generate call")
    p.add_argument("--policy", default="fixed", choices=("fixed", "adaptive", "expected_gain"))
    p.add_argument("--alpha", type=float, default=0.8, help="OPD: weight of the hard-label term (paper: 0.8)")
    p.add_argument("--clip", type=float, default=0.01, help="OPD: per-entry clip of the reverse-KL terms (paper: 0.01)")
    p.add_argument("--clip-mode", default="token", choices=("entry", "token"),
                   help="OPD: clip per token (released code; the adapter's default) or per vocabulary entry (paper)")
    p.add_argument("--measure-fixed", action="store_true", help="also measure held-out tau with the fixed policy (fixed_tau)")
    p.add_argument("--seed", type=int, default=0, help="seeds the adapter and the stream's order (0: file order)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    tok = AutoTokenizer.from_pretrained(a.target)
    target = AutoModelForCausalLM.from_pretrained(a.target, dtype=torch.float32).to(a.device).eval()
    drafter = AdaFlashDrafter.from_pretrained(a.drafter, dtype=torch.float32).to(a.device).eval()
    prompts = eval_prompts(a.dataset, limit=a.held_out + a.stream)
    os.makedirs(a.out, exist_ok=True)
    command = "python examples/research/online_experiment.py " + " ".join(argv if argv is not None else __import__("sys").argv[1:])

    def save(result):
        result.update(dataset=a.dataset, command=command)
        write_text_atomic(os.path.join(a.out, "online.json"), json.dumps(result, indent=2))  # a killed run leaves its last checkpoint whole

    stream = stream_order(prompts[a.held_out :], a.seed)
    result = run_online_experiment(target, drafter, tok, stream, prompts[: a.held_out], seed=a.seed, methods=tuple(a.methods.split(",")), updates=a.updates, samples_per_update=a.samples_per_update, epochs=a.epochs, max_new_tokens=a.max_new_tokens, policy=a.policy, lr=a.lr, head_lr=a.head_lr, label_mode=a.label_mode, sample_unit=a.sample_unit, stream_batch=a.stream_batch, measure_batch=a.measure_batch, checkpoint=save, alpha=a.alpha, clip=a.clip, clip_mode=a.clip_mode, measure_fixed=a.measure_fixed)
    save(result)
    plot_curves(result, os.path.join(a.out, "online_tau.png"))
    return 0 if all(c["identical"] for r in result["methods"].values() for c in r["curve"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
