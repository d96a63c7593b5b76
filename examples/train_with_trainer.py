"""Offline drafter training with `transformers.Trainer` (`DrafterTrainer`), on the reference pair.

    python examples/train_with_trainer.py --out runs/drafter-ft           # fine-tune, 40 steps
    python examples/train_with_trainer.py --smoke                         # 3 steps (a few seconds)
    python examples/train_with_trainer.py --from-scratch --steps 200      # a fresh drafter instead

The DFlash recipe in a few lines. The drafter learns to predict the *target's* tokens, so its training
answers must be the target's own: the target answers the training prompts first (greedy), and each
sample is exactly the tokens it wrote, prompt and answer, the loss on the answer (``{"input_ids",
"loss_mask"}``: no decode and re-encode that could change a token). `DrafterTrainer` then trains the
drafter on random anchor blocks while the target stays frozen. Greedy tau on held-out prompts (none of
them trained on) is measured before and after; the trained drafter is saved (native layout), reloaded and
used for speculative decoding (still lossless). For real runs use many prompts (`adaflash train`).

Fine-tuning an already trained drafter on a handful of answers easily makes it worse elsewhere (answers the
target did not write, a dataset's reference answers, teach it text the target does not produce, which lowers
tau even more). So, as the online adapter's guard does, the example keeps the trained weights only where the
held-out tau did not fall, and the starting weights otherwise; with many prompts (`adaflash train`) the
check has a real set to decide on.
"""

import argparse
import copy
import tempfile

import torch
from transformers import TrainingArguments

from adaflash_hf import AdaFlashDrafter, load_reference_pair
from adaflash_hf.training.data import builtin_prompts
from adaflash_hf.training.trainer import DrafterDataCollator, DrafterTrainer, DrafterTrainingModel

DOMAINS = ("math", "code", "chat")
HELD_OUT_PER_DOMAIN = 2  # the last prompts of each domain's built-in sample: measured, never trained on


def prompt_split() -> tuple[list[str], list[str]]:
    """(training prompts, held-out prompts) from the package's built-in sample, every domain in both."""
    train, held_out = [], []
    for domain in DOMAINS:
        texts = [r["messages"][-1]["content"] for r in builtin_prompts(domain)]
        train += texts[:-HELD_OUT_PER_DOMAIN]
        held_out += texts[-HELD_OUT_PER_DOMAIN:]
    return train, held_out


def encode(tok, prompt: str) -> torch.Tensor:
    msgs = [{"role": "user", "content": prompt}]
    return tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]


@torch.no_grad()
def target_samples(target, tok, prompts, max_new_tokens: int) -> list[dict]:
    """Training samples of the target's own greedy answers, as the token ids it generated: ``input_ids`` =
    prompt + answer, ``loss_mask`` on the answer."""
    samples = []
    for p in prompts:
        ids = encode(tok, p)
        out = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0].tolist()
        n = ids.shape[1]
        samples.append({"input_ids": out, "loss_mask": [0] * n + [1] * (len(out) - n)})
    return samples


@torch.no_grad()
def held_out_tau(target, drafter, tok, prompts, max_new_tokens: int) -> float:
    """Greedy tau (tokens committed per verify round, whole blocks verified) over `prompts`, pooled."""
    committed = rounds = 0
    for p in prompts:
        _, stats = target.generate(encode(tok, p), assistant_model=drafter, max_new_tokens=max_new_tokens, do_sample=False,
                                   return_stats=True, length_policy="fixed", prompt_ngrams=0)  # fmt: skip
        committed += sum(stats.accepted) + stats.rounds
        rounds += stats.rounds
    return committed / max(rounds, 1)


def fine_tune(target, drafter, tok, samples, out_dir: str, steps: int, lr: float, quiet: bool = False):
    """Train `drafter` in place on `samples` with `DrafterTrainer` (frozen target); returns the trainer."""
    model = DrafterTrainingModel(target, drafter, max_anchors=32)  # frozen target + trainable drafter
    training_args = TrainingArguments(
        output_dir=out_dir, max_steps=steps, per_device_train_batch_size=2, learning_rate=lr,
        lr_scheduler_type="cosine", warmup_steps=0, max_grad_norm=1.0, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(), seed=0, disable_tqdm=quiet,
    )  # fmt: skip
    trainer = DrafterTrainer(model=model, args=training_args, train_dataset=samples,
                             data_collator=DrafterDataCollator(tok, max_length=512))  # fmt: skip
    trainer.train()
    drafter.eval()
    return trainer


def fine_tune_kept(target, drafter, tok, samples, held_out, out_dir: str, steps: int, lr: float, answer_tokens: int,
                   quiet: bool = False):
    """`fine_tune`, then the held-out check: the trained weights stay only where greedy tau on `held_out` did not
    fall, else the starting weights are put back. Returns ``(trainer, tau before, tau after, kept)``."""
    start = copy.deepcopy(drafter.state_dict())
    before = held_out_tau(target, drafter, tok, held_out, answer_tokens)
    trainer = fine_tune(target, drafter, tok, samples, out_dir, steps, lr, quiet=quiet)
    after = held_out_tau(target, drafter, tok, held_out, answer_tokens)
    kept = after >= before
    if not kept:
        drafter.load_state_dict(start)
    return trainer, before, after, kept


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny settings (3 training prompts, 3 steps)")
    ap.add_argument("--out", default=None, help="where the trained drafter is saved (default: a temporary folder)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--from-scratch", action="store_true", help="train a fresh 1-layer drafter instead of fine-tuning the reference one")
    args = ap.parse_args()
    torch.set_num_threads(1)
    steps, answer_tokens = (3, 24) if args.smoke else (args.steps, 96)
    tmp = None if args.out else tempfile.TemporaryDirectory(prefix="adaflash-trainer-")  # removed at exit
    out_dir = args.out or tmp.name

    target, drafter, tok = load_reference_pair()
    train_prompts, held_out = prompt_split()
    train_prompts = train_prompts[:3] if args.smoke else train_prompts
    samples = target_samples(target, tok, train_prompts, answer_tokens)
    print(f"{len(samples)} training samples answered by the target, {len(held_out)} held-out prompts")
    lr = args.lr  # fine-tuning the trained reference drafter: a small learning rate
    if args.from_scratch:
        drafter = AdaFlashDrafter.from_target(target, num_layers=1, block_size=16, tokenizer=tok)
        lr = 6e-4

    trainer, before, after, kept = fine_tune_kept(target, drafter, tok, samples, held_out, out_dir, steps, lr,
                                                  answer_tokens, quiet=args.smoke)  # fmt: skip
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    print(f"trained {trainer.state.global_step} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    print(f"held-out greedy tau: {before:.2f} before, {after:.2f} after: "
          + ("kept the trained weights" if kept else "it fell, so the starting weights are kept"))

    trainer.model.save_pretrained(out_dir)  # the drafter only, native layout
    trained = AdaFlashDrafter.from_pretrained(out_dir).eval().bind_target(target)
    print(f"saved and reloaded the drafter from {out_dir}")
    ids = encode(tok, held_out[0])
    out, stats = target.generate(ids, assistant_model=trained, max_new_tokens=32, do_sample=False, return_stats=True)
    identical = torch.equal(out, target.generate(ids, max_new_tokens=32, do_sample=False))
    print(f"generation with the reloaded drafter: tau {stats.tau:.2f}; identical: {identical}")
    if tmp is not None:
        tmp.cleanup()
        print("(the drafter was saved to a temporary folder, now removed: pass --out DIR to keep it)")
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
