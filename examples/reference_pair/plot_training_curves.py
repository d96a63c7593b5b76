"""Plot the reference pair's training curves from the committed logs.

    python examples/reference_pair/plot_training_curves.py [--out docs/logs/training_curves.png]
"""

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LOGS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "logs")


def read(name):
    with open(os.path.join(LOGS, name), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(LOGS, "training_curves.png"))
    a = p.parse_args(argv)
    target, drafter = read("target_train_log.jsonl"), read("drafter_train_log.jsonl")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    train = [r for r in target if "loss" in r]
    ax1.plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    evals = [r for r in target if "eval_loss" in r]
    for domain in ("math", "code", "chat", "prose"):
        ax1.plot([r["step"] for r in evals], [r["eval_loss"][domain] for r in evals], "--", label=f"held-out {domain}")
    ax1.set(title="target (12.6M Qwen3)", xlabel="step (128 x 512 tokens)", ylabel="loss", ylim=(1.5, 6))
    ax1.legend(fontsize=7)
    rows = [r for r in drafter if r.get("ce_loss") is not None]
    ax2.plot([r["step"] for r in rows], [r["ce_loss"] for r in rows], label="block CE (weighted)")
    ax2.set(title="drafter v2 (2 layers, block 16)", xlabel="step (16 sequences)", ylabel="loss", ylim=(2, 8))
    twin = ax2.twinx()
    twin.plot([r["step"] for r in rows], [r["accept_len"] for r in rows], color="tab:orange", label="train accept length")
    twin.set_ylabel("accept length (train blocks)")
    ax2.legend(loc="upper left", fontsize=7)
    twin.legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
