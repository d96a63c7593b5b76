"""Offline drafter training with `transformers.Trainer` (`DrafterTrainer`), on the reference pair.

    python examples/train_with_trainer.py --out runs/drafter-ft           # fine-tune, 40 steps
    python examples/train_with_trainer.py --smoke                         # 3 steps (a few seconds)
    python examples/train_with_trainer.py --from-scratch --steps 200      # a fresh drafter instead

The DFlash recipe (SPEC section 5) in a few lines: the target answers a handful of chat prompts
itself (the drafter learns the *target's* distribution), the answers become chat samples whose
assistant turn is the loss mask, and `DrafterTrainer` trains the drafter on random anchor blocks
while the target stays frozen. The result is saved in the native layout, reloaded, and used for
speculative decoding (still lossless). For real runs use many prompts (`adaflash train`).
"""

import argparse
import tempfile

import torch
from transformers import TrainingArguments

from adaflash_hf import AdaFlashDrafter, load_reference_pair
from adaflash_hf.training.trainer import DrafterDataCollator, DrafterTrainer, DrafterTrainingModel

PROMPTS = [
    "Tell me a short story about a dog.",
    "What is the capital of France?",
    "Write a Python function that returns the square of a number.",
    "Give me two tips for sleeping better.",
    "What is 9 times 8?",
    "Describe a sunny day in two sentences.",
    "How do I sort a list in Python?",
    "Why is the sky blue?",
]


@torch.no_grad()
def target_answers(target, tok, prompts, max_new_tokens):
    """Chat samples whose assistant turn is the target's own greedy answer."""
    samples = []
    for p in prompts:
        msgs = [{"role": "user", "content": p}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
        out = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        answer = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        samples.append({"messages": msgs + [{"role": "assistant", "content": answer}]})
    return samples


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny settings (4 samples, 3 steps)")
    ap.add_argument("--out", default=None, help="where the trained drafter is saved (default: a temporary folder)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--from-scratch", action="store_true", help="train a fresh 1-layer drafter instead of fine-tuning the reference one")
    args = ap.parse_args()
    torch.set_num_threads(1)
    steps, n_prompts, answer_tokens = (3, 4, 24) if args.smoke else (args.steps, len(PROMPTS), 96)
    tmp = None if args.out else tempfile.TemporaryDirectory(prefix="adaflash-trainer-")  # removed at exit
    out_dir = args.out or tmp.name

    target, drafter, tok = load_reference_pair()
    samples = target_answers(target, tok, PROMPTS[:n_prompts], answer_tokens)
    print(f"{len(samples)} chat samples answered by the target")
    if args.from_scratch:
        drafter = AdaFlashDrafter.from_target(target, num_layers=1, block_size=16, tokenizer=tok)
        lr = 6e-4
    else:
        lr = args.lr  # fine-tuning the trained reference drafter: a small learning rate

    model = DrafterTrainingModel(target, drafter, max_anchors=32)  # frozen target + trainable drafter
    training_args = TrainingArguments(
        output_dir=out_dir, max_steps=steps, per_device_train_batch_size=2, learning_rate=lr,
        lr_scheduler_type="cosine", warmup_steps=0, max_grad_norm=1.0, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(), seed=0,
        disable_tqdm=args.smoke,
    )  # fmt: skip
    trainer = DrafterTrainer(
        model=model, args=training_args, train_dataset=samples, data_collator=DrafterDataCollator(tok, max_length=512)
    )
    result = trainer.train()
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    print(f"trained {trainer.state.global_step} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f} (final mean {result.training_loss:.3f})")

    model.save_pretrained(out_dir)  # the drafter only, native layout
    trained = AdaFlashDrafter.from_pretrained(out_dir).eval().bind_target(target)
    print(f"saved and reloaded the drafter from {out_dir}")

    ids = tok.apply_chat_template(
        [{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    policy = "adaptive" if trained.config.length_head_trained else "fixed"
    out, stats = target.generate(ids, assistant_model=trained, max_new_tokens=32, do_sample=False, return_stats=True, length_policy=policy)
    plain = target.generate(ids, max_new_tokens=32, do_sample=False)
    identical = torch.equal(out, plain)
    print(f"generation with the trained drafter: tau {stats.tau:.2f} ({policy}); identical: {identical}")
    if tmp is not None:
        tmp.cleanup()
        print("(the drafter was saved to a temporary folder, now removed: pass --out DIR to keep it)")
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
