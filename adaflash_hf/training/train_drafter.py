"""Train an AdaFlash drafter offline for a target, on the target's own answers.

    python -m adaflash_hf.training.train_drafter --target DIR --out DIR --domains chat,prose --minutes 6
    python -m adaflash_hf.training.train_drafter --target DIR --out DIR --device cpu --steps 3 \\
        --num-prompts 8 --max-new-tokens 16 --eval-per-domain 0          # CPU smoke test

Three stages, one command:

1. **Regeneration.** ``--num-prompts`` prompts (split evenly over ``--domains``, drawn with
   ``--seed`` from the training split of ``adaflash_hf.training.data``; with no training data in the
   data folder, from the built-in prompt sample, with a one-line note) are answered by the target
   itself with batched, left-padded ``target.generate`` (greedy unless ``--temperature > 0``,
   ``--max-new-tokens``, stop at ``<|im_end|>`` / eos). Chat-style domains use the first user turn
   through the chat template; prose uses the first ``--prose-prefix`` tokens of a chunk as the
   prompt; ``--sampled-answers N`` adds N answers sampled at ``--sampled-temperature`` per prompt
   of ``--sampled-domains`` (where prompts are scarce, e.g. ShareGPT's ~2k conversations). The
   drafter learns the target's distribution, not the data's. ``--regen-cache FILE``
   stores (or reuses) the regenerated samples as jsonl, with the settings that made them beside it
   (``FILE.settings.json``); a cache made with other settings (seed, target, prompts...) is refused.
   ``--train-domains`` trains on some of the regenerated domains only, so drafters that each leave a domain
   out can share one regeneration and its cache.
2. **Training** with :class:`~adaflash_hf.training.trainer.DrafterTrainer`: a fresh drafter
   (``--num-layers`` 2, ``--block-size`` 16, mask token from the tokenizer), AdamW lr 6e-4,
   warmup 4 % then cosine, grad clip 1.0, bf16 autocast on CUDA, length head trained jointly on
   detached features. ``--minutes`` is the *training* wall-clock budget and the LR schedule runs
   over that time; ``--steps N`` (alias ``--max-steps``) fixes a step count instead (step-based cosine; ``--minutes``
   then only acts as a safety stop). ``--length-head-steps`` adds an offline length-head pass on
   the frozen drafter afterwards.
3. **Outputs** in ``--out``: the drafter in the native layout (bf16 safetensors shards of at most
   ``--max-shard-size``; ``AdaFlashDrafter.from_pretrained(out)`` loads it), ``train_log.jsonl``
   (step, loss, lr, ce_loss, length_loss, accuracy, accept_len, elapsed_s) and
   ``train_summary.json`` (arguments, timings, regeneration stats, and a held-out *acceptance
   proxy* per domain: mean ``accepted + 1`` over all block anchors of the target's own greedy answers
   to ``--eval-per-domain`` eval-split prompts of every domain, the teacher-forced analogue of
   tau).

From Python: ``run(DrafterRecipe(target=..., out=..., domains=["chat", "prose"], minutes=6))``
(:func:`config_from_args` turns parsed flags into a recipe); a user-fixable problem raises
:class:`~adaflash_hf.training.RecipeError` (the command line prints it and exits non-zero).

Several GPUs: ``accelerate launch --num_processes N -m adaflash_hf.training.train_drafter ...``
trains data-parallel (DDP through the Trainer), the same recipe as one process:

* the samples come from one ``--regen-cache FILE`` made beforehand by one process (the same flags with
  ``--regen-only``), which every process reads: a launch without it is refused before any work;
* ``--batch-size`` is per process; the processes take each optimizer step's batches in turn from one order drawn
  from ``--seed`` (each sees different samples), so one process with ``--grad-accum N`` takes the same steps as N
  processes (tests/test_train_distributed.py checks the weights agree);
* ``--minutes`` runs on the main process's clock (every process stops after the same step);
* only the main process evaluates and writes the drafter, ``train_log.jsonl`` and ``train_summary.json``
  (``train_samples_per_s`` counts the samples of every process).
"""

from __future__ import annotations

import time

_T_START = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
from dataclasses import asdict  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from ..atomic_io import write_text_atomic  # noqa: E402
from ..loading import set_cpu_threads  # noqa: E402
from . import RecipeError  # noqa: E402
from .block_attention import flex_available  # noqa: E402
from .drafter_recipe import DrafterRecipe, add_arguments, config_from_args  # noqa: E402,F401

CHAT_DOMAINS = ("math", "code", "chat")


# ------------------------------------------------------------------------------ prompts


def _chat_prompt_ids(tok, messages: list[dict]) -> list[int]:
    enc = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
    return list(enc["input_ids"])


def _prose_prefixes(tok, text: str, n: int, prose_prefix: int) -> list[list[int]]:
    """Up to ``n`` prompts of ``prose_prefix`` tokens starting at evenly spaced word boundaries of ``text``."""
    starts = [0]
    for j in range(1, n):
        cut = text.find(" ", j * len(text) // n)
        if cut == -1 or len(text) - cut < 8 * prose_prefix:  # keep room for a continuation
            break
        starts.append(cut + 1)
    # a prefix of the chunk is plenty for `prose_prefix` tokens (avoids tokenising 2k chars)
    return [tok(text[s : s + 16 * prose_prefix], add_special_tokens=False)["input_ids"][:prose_prefix] for s in starts]


def _chat_turn_prompts(tok, messages: list[dict], n: int, max_prompt_tokens: int) -> list[list[int]]:
    """Up to ``n`` prompts from one conversation: user turn j with the conversation before it."""
    out = []
    for j, m in enumerate(messages):
        if m["role"] == "user":
            out.append(_chat_prompt_ids(tok, messages[: j + 1])[-max_prompt_tokens:])
            if len(out) == n:
                break
    return out


def build_prompts(
    tok,
    domains: list[str],
    num_prompts: int,
    split: str = "train",
    seed: int = 0,
    prose_prefix: int = 32,
    max_prompt_tokens: int = 384,
    data_dir=None,
    prompts_per_sample: int = 1,
) -> list[dict]:
    """``num_prompts`` prompts split evenly over ``domains``: ``{"domain", "prompt_ids"}``.

    Samples are drawn in a ``seed``-shuffled order; each gives up to ``prompts_per_sample`` prompts
    (a conversation's first user turns, each with the turns before it; a prose chunk's prefixes at
    evenly spaced offsets), so a domain with few samples still yields many distinct prompts.
    """
    from . import data as D

    if prompts_per_sample < 1:
        raise ValueError(f"prompts_per_sample must be >= 1, got {prompts_per_sample}")
    rng = random.Random(seed)
    per = [num_prompts // len(domains) + (1 if i < num_prompts % len(domains) else 0) for i in range(len(domains))]
    out = []
    for d, k in zip(domains, per):
        if k <= 0:
            continue
        samples = D.chat_samples(d, split, data_dir=data_dir)
        got = 0
        for s in rng.sample(samples, len(samples)):
            if "messages" in s:
                ids_list = _chat_turn_prompts(tok, s["messages"], prompts_per_sample, max_prompt_tokens)
            else:
                ids_list = _prose_prefixes(tok, s["text"], prompts_per_sample, prose_prefix)
            for ids in ids_list[: k - got]:
                if len(ids) >= 1:
                    out.append({"domain": d, "prompt_ids": ids})
                    got += 1
            if got >= k:
                break
    return out


@torch.no_grad()
def regenerate(
    target,
    tok,
    prompts: list[dict],
    max_new_tokens: int = 256,
    batch_size: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    progress: bool = True,
    min_response_tokens: int = 2,
) -> list[dict]:
    """Answer every prompt with the target (batched, left padded). Returns pre-tokenised samples
    ``{"input_ids": prompt + response, "loss_mask": [0]*P + [1]*R, "domain"}``; the response ends
    with the stop token when one was produced."""
    from tqdm.auto import tqdm

    from .tokenizer import STOP_TOKENS

    stops = [i for i in (tok.convert_tokens_to_ids(t) for t in STOP_TOKENS) if i is not None and i != tok.unk_token_id]
    if not stops and tok.eos_token_id is not None:
        stops = [tok.eos_token_id]
    pad = tok.pad_token_id if tok.pad_token_id is not None else (stops[0] if stops else 0)
    device = next(target.parameters()).device
    target.eval()
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]["prompt_ids"]))
    results: list[dict | None] = [None] * len(prompts)
    gen_kw = dict(max_new_tokens=max_new_tokens, eos_token_id=stops or None, pad_token_id=pad)
    if temperature > 0:
        gen_kw.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
    else:
        gen_kw.update(do_sample=False)
    bar = tqdm(total=len(prompts), desc="regenerate", unit="prompt", disable=not progress)
    for s in range(0, len(order), batch_size):
        idx = order[s : s + batch_size]
        plens = [len(prompts[i]["prompt_ids"]) for i in idx]
        P = max(plens)
        ids = torch.full((len(idx), P), pad, dtype=torch.long)
        am = torch.zeros(len(idx), P, dtype=torch.long)
        for r, i in enumerate(idx):
            p = prompts[i]["prompt_ids"]
            ids[r, P - len(p) :] = torch.tensor(p)
            am[r, P - len(p) :] = 1
        y = target.generate(input_ids=ids.to(device), attention_mask=am.to(device), **gen_kw)
        gen = y[:, P:].tolist()
        for r, i in enumerate(idx):
            resp = []
            for t in gen[r]:
                resp.append(t)
                if t in stops:
                    break
            p = list(prompts[i]["prompt_ids"])
            results[i] = {
                "input_ids": p + resp,
                "loss_mask": [0] * len(p) + [1] * len(resp),
                "domain": prompts[i]["domain"],
            }
        bar.update(len(idx))
    bar.close()
    return [r for r in results if r is not None and sum(r["loss_mask"]) >= min_response_tokens]


# ------------------------------------------------------------------------------ evaluation


@torch.no_grad()
def acceptance_proxy(model, samples: list[dict], collator, batch_size: int = 16, autocast_dtype=None) -> dict:
    """Mean ``accepted + 1`` per block (every response anchor) and slot-1 accuracy, per domain."""
    device = model.base_drafter.fc.weight.device
    was = model.training
    model.eval()
    by_domain: dict[str, list[dict]] = {}
    for s in samples:
        by_domain.setdefault(s.get("domain", "all"), []).append(s)
    res = {}
    for d, ss in by_domain.items():
        tot_len, tot_blocks, tot_acc, tot_first = 0.0, 0, 0.0, 0
        for i in range(0, len(ss), batch_size):
            batch = {k: v.to(device) for k, v in collator(ss[i : i + batch_size]).items()}
            ctx = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None
                   else torch.autocast(device.type, enabled=False))
            with ctx:
                out = model(**batch)
            nb = int(out["num_blocks"])
            tot_len += float(out["accept_len"]) * nb
            tot_blocks += nb
            tot_acc += float(out["accuracy"]) * nb
            tot_first += nb
        res[d] = {
            "accept_len": round(tot_len / max(tot_blocks, 1), 4),
            "accuracy": round(tot_acc / max(tot_first, 1), 4),
            "blocks": tot_blocks,
            "samples": len(ss),
        }
    model.train(was)
    return res


# ------------------------------------------------------------------------------ main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    return add_arguments(ap).parse_args(argv)


def _load_target(path: str, device: torch.device):
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return target.to(device).eval().requires_grad_(False)


def main(argv=None) -> int:
    try:
        return run(config_from_args(parse_args(argv)))
    except RecipeError as e:
        raise SystemExit(str(e)) from None


def _device_name(name: str) -> str:
    """``"auto"`` resolved: ``"cuda"`` when available, else ``"cpu"``."""
    if name != "auto":
        return name
    return "cuda" if torch.cuda.is_available() else "cpu"


def _device(name: str) -> torch.device:
    device = torch.device(_device_name(name))
    if device.type == "cuda" and device.index is None:  # one process per GPU under accelerate launch
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return device


# the recipe fields that decide which samples a regeneration makes
REGEN_SETTINGS = ("target", "data", "domains", "seed", "num_prompts", "max_new_tokens", "temperature", "top_p",
                  "sampled_answers", "sampled_domains", "sampled_temperature", "prose_prefix", "max_prompt_tokens",
                  "prompts_per_sample")  # fmt: skip


def _regen_settings(r: DrafterRecipe) -> dict:
    # through JSON, as the settings file holds them: a tuple of domains compares equal to the saved list
    return json.loads(json.dumps({k: getattr(r, k) for k in REGEN_SETTINGS}))


def _settings_file(cache: Path) -> Path:
    return cache.with_name(cache.name + ".settings.json")


def check_regen_cache(r: DrafterRecipe) -> None:
    """Refuse an existing ``--regen-cache`` regenerated with other settings (a new ``--seed`` would
    otherwise silently train on the old seed's samples), naming each difference."""
    cache = Path(r.regen_cache) if r.regen_cache else None
    if cache is None or not cache.is_file():
        return
    side = _settings_file(cache)
    if not side.is_file():
        raise RecipeError(f"--regen-cache {cache} has no {side.name} (the settings it was made with): delete it to regenerate")
    saved = json.loads(side.read_text())
    wrong = [f"{k} {saved.get(k)!r} there, {v!r} here" for k, v in _regen_settings(r).items() if saved.get(k) != v]
    if wrong:
        raise RecipeError(f"--regen-cache {cache} was regenerated with other settings: " + "; ".join(wrong)
                          + ": pass the same settings, another cache file, or delete it")  # fmt: skip


def _training_samples(r: DrafterRecipe, target, tok, main_process: bool, timings: dict) -> list[dict]:
    """Stage 1: the target's answers to the training prompts (or the regeneration cache, checked by
    :func:`check_regen_cache` before any work)."""
    t = time.time()
    cache = Path(r.regen_cache) if r.regen_cache else None
    if cache is not None and cache.is_file():
        samples = [json.loads(line) for line in cache.read_text().splitlines() if line.strip()]
        print(f"[train_drafter] reusing {len(samples)} regenerated samples from {cache}", flush=True)
    else:
        prompts = build_prompts(tok, r.domains, r.num_prompts, "train", r.seed, r.prose_prefix, r.max_prompt_tokens, r.data,
                                prompts_per_sample=r.prompts_per_sample)  # fmt: skip
        samples = regenerate(target, tok, prompts, r.max_new_tokens, r.gen_batch_size, r.temperature, r.top_p, r.progress)
        extra = [p for p in prompts if p["domain"] in set(r.sampled_domains)] * r.sampled_answers
        if extra:
            samples += regenerate(target, tok, extra, r.max_new_tokens, r.gen_batch_size, r.sampled_temperature, 1.0,
                                  r.progress)  # fmt: skip
        if cache is not None and main_process:
            cache.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(_settings_file(cache), json.dumps(_regen_settings(r), indent=1))  # first: see check_regen_cache
            write_text_atomic(cache, "".join(json.dumps(s) + "\n" for s in samples))
    timings["regenerate_s"] = round(time.time() - t, 1)
    return samples


def _builtin_note(r: DrafterRecipe, cached: bool) -> str | None:
    """The one-line note when training (or eval) prompts come from the built-in sample, else None."""
    from . import data as D

    train = [] if cached else [d for d in r.domains if D.uses_builtin_samples(d, "train", r.data)]
    evals = [d for d in r.eval_domains if D.uses_builtin_samples(d, "eval", r.data)] if r.eval_per_domain > 0 else []
    if not train and not evals:
        return None
    where = D.data_dir(r.data) if D.local_data_dir(r.data) is not None else "no data folder"
    n_train = 8 - D.BUILTIN_EVAL_PER_DOMAIN
    parts = ([f"training prompts of {','.join(train)} from the built-in sample ({n_train} per domain)"] if train else []) + (
        [f"eval prompts of {','.join(evals)} from its last {D.BUILTIN_EVAL_PER_DOMAIN}"] if evals else [])
    return (f"note: {where} holds no training data ({D.ENV_VAR} / --data); " + "; ".join(parts)
            + ", answered by the target as usual")


def _eval_samples(r: DrafterRecipe, target, tok, timings: dict) -> list[dict]:
    """Held-out prompts of every eval domain, answered greedily by the target."""
    t = time.time()
    prompts = build_prompts(tok, r.eval_domains, r.eval_per_domain * len(r.eval_domains), "eval", r.seed,
                            r.prose_prefix, r.max_prompt_tokens, r.data)  # fmt: skip
    samples = regenerate(target, tok, prompts, r.max_new_tokens, r.gen_batch_size, 0.0, 1.0, r.progress)
    timings["eval_regenerate_s"] = round(time.time() - t, 1)
    return samples


def _initial_drafter(r: DrafterRecipe, target, tok):
    """The fp32 drafter training starts from: a fresh one for ``target``, or ``--init-from``'s weights (checked
    against the recipe's layer flags and the target before any regeneration; ``--length-head-type`` given: a
    fresh head of that form on them)."""
    from ..modeling import AdaFlashDrafter

    if r.init_from is None:
        mask_id = r.mask_token_id if r.mask_token_id is not None else tok.mask_token_id
        if mask_id is None:
            raise RecipeError("the tokenizer has no mask token: pass --mask-token-id")
        drafter = AdaFlashDrafter.from_target(target, num_layers=r.num_layers, block_size=r.block_size,
                                              target_layer_ids=r.target_layer_ids, mask_token_id=mask_id,
                                              length_head_type=r.length_head_type or "released")  # fmt: skip
        return drafter.float()  # fp32 master weights; bf16 autocast on CUDA
    try:
        drafter = AdaFlashDrafter.from_pretrained(r.init_from, dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise RecipeError(f"--init-from {r.init_from}: not a drafter folder ({exc})") from exc
    c = drafter.config
    wrong = [f"{flag} {mine} (the checkpoint has {theirs})" for flag, mine, theirs in (
        ("--num-layers", r.num_layers, c.num_hidden_layers), ("--block-size", r.block_size, c.block_size),
        ("--target-layer-ids", r.target_layer_ids, list(c.target_layer_ids)),
        ("--mask-token-id", r.mask_token_id, c.mask_token_id)) if mine is not None and mine != theirs]
    if wrong:
        raise RecipeError(f"--init-from {r.init_from}: " + "; ".join(wrong) + ": pass the checkpoint's values")
    try:
        drafter.check_target(target)
    except ValueError as exc:
        raise RecipeError(f"--init-from {r.init_from} does not fit the target: {exc}") from exc
    if r.length_head_type is not None:  # a fresh head of that form on the checkpoint's drafter
        from ..modeling.modeling_adaflash import build_length_head

        c.length_head_type, c.length_head_trained = r.length_head_type, False
        drafter.length_head = build_length_head(c)
    return drafter


def _training_model(r: DrafterRecipe, target, drafter):
    """``drafter`` (from :func:`_initial_drafter`) inside the training wrapper."""
    from .model import DrafterTrainingModel

    model = DrafterTrainingModel(target, drafter, max_anchors=r.max_anchors, gamma=r.gamma,
                                 length_head_weight=r.length_head_weight, block_attention=r.block_attention)  # fmt: skip
    n_params = sum(p.numel() for p in drafter.parameters())
    print(f"[train_drafter] drafter: {drafter.config.num_hidden_layers} layers, block {drafter.config.block_size}, "
          f"target layers {drafter.config.target_layer_ids}, {n_params / 1e6:.2f}M params, {r.block_attention} block attention"
          + (f", from {r.init_from}" if r.init_from else ""), flush=True)
    return model, n_params


def _trainer(r: DrafterRecipe, model, samples, collator, out: Path, device: torch.device, main_process: bool = True):
    """A ``DrafterTrainer`` whose LR schedule runs over the wall-clock budget (or ``steps``)."""
    from transformers import PrinterCallback, TrainingArguments

    from .trainer import DrafterTrainer, JsonlLogCallback, WallClockCallback, wall_clock_cosine_schedule

    log_path = out / "train_log.jsonl"
    if main_process and log_path.exists():  # only the main process writes the log
        log_path.unlink()
    clock = WallClockCallback(r.minutes * 60.0)
    timed = r.steps is None  # LR schedule over wall-clock time; tqdm would show a meaningless total
    callbacks = [clock] + ([JsonlLogCallback(log_path, verbose=timed or not r.progress, budget_s=r.minutes * 60.0)]
                           if main_process else [])
    # output_dir: the run's own folder (save_strategy "no": the Trainer writes nothing there; a temporary folder per
    # run was left behind by every run)
    targs = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=r.batch_size,
        gradient_accumulation_steps=r.grad_accum,
        learning_rate=r.lr, weight_decay=r.weight_decay, max_grad_norm=r.grad_clip, lr_scheduler_type="cosine",
        warmup_steps=r.warmup_ratio, max_steps=r.steps if r.steps is not None else 10**9,
        logging_steps=r.logging_steps, logging_first_step=True, save_strategy="no", report_to=[],
        bf16=device.type == "cuda", use_cpu=device.type == "cpu", seed=r.seed, dataloader_num_workers=r.num_workers,
        train_sampling_strategy=r.train_sampling_strategy,
        remove_unused_columns=False, disable_tqdm=timed or not r.progress,
    )  # fmt: skip
    optimizers = (None, None)
    if timed:
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=r.lr, weight_decay=r.weight_decay, fused=device.type == "cuda")
        optimizers = (opt, wall_clock_cosine_schedule(opt, clock, r.warmup_ratio))
    trainer = DrafterTrainer(model=model, args=targs, train_dataset=samples, data_collator=collator,
                             callbacks=callbacks, optimizers=optimizers)  # fmt: skip
    trainer.remove_callback(PrinterCallback)  # JsonlLogCallback prints compact lines instead
    return trainer


def _after_training(r: DrafterRecipe, model, target, samples, eval_samples, collator, autocast_dtype, timings):
    """The optional offline length-head pass and the held-out acceptance proxy: ``(head losses, eval)``."""
    from .trainer import train_length_head

    lh_losses = []
    if r.length_head_steps > 0:
        t = time.time()
        loader = torch.utils.data.DataLoader(samples, batch_size=r.batch_size, shuffle=True, collate_fn=collator)
        lh_losses = train_length_head(model.drafter, target, loader, r.length_head_steps, r.length_head_lr,
                                      r.max_anchors, autocast_dtype=autocast_dtype, progress=r.progress,
                                      block_attention=model.block_attention, log_every=0 if r.progress else 100)  # fmt: skip
        timings["length_head_s"] = round(time.time() - t, 1)
    eval_res = {}
    if eval_samples:
        t = time.time()
        eval_res = acceptance_proxy(model, eval_samples, collator, batch_size=r.batch_size, autocast_dtype=autocast_dtype)
        timings["eval_s"] = round(time.time() - t, 1)
        for d, res in eval_res.items():
            print(f"[train_drafter] held-out {d:<6} accept_len {res['accept_len']:.3f}  slot-1 acc {res['accuracy']:.3f}",
                  flush=True)  # fmt: skip
    return lh_losses, eval_res


def _processes() -> tuple[int, bool]:
    """``(processes, whether this one is the main one)`` of a launch (``accelerate launch`` / ``torchrun`` set
    ``WORLD_SIZE`` and ``RANK``)."""
    return int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0)) == 0


def check_recipe(r: DrafterRecipe) -> None:
    """Refuse what cannot run, before any model loads: flex attention off CUDA, a regeneration cache made with other
    settings, a multi-process launch without the samples every process must read from one file."""
    device = _device(r.device)
    if r.block_attention == "flex" and not flex_available(device):
        raise RecipeError(f"--block-attention flex trains on CUDA only (here: {device}): use dense")
    if r.grad_accum < 1:
        raise RecipeError(f"--grad-accum must be >= 1, got {r.grad_accum}")
    check_regen_cache(r)
    if r.train_domains and not set(r.train_domains) <= set(r.domains):
        raise RecipeError(f"--train-domains {','.join(r.train_domains)} is not a subset of --domains {','.join(r.domains)}")
    processes, _ = _processes()
    if processes > 1 and (r.regen_only or not (r.regen_cache and Path(r.regen_cache).is_file())):
        raise RecipeError(f"{processes} processes train from one regeneration: make it first in one process (the same "
                          "flags with --regen-cache FILE --regen-only), then launch with --regen-cache FILE")


def run(r: DrafterRecipe) -> int:
    """Regenerate, train and save as ``r`` says (module doc); raises :class:`RecipeError` on
    user-fixable problems."""
    from transformers import AutoTokenizer, set_seed

    from .collator import DrafterDataCollator

    check_recipe(r)
    device = _device(r.device)
    processes, main_process = _processes()
    set_seed(r.seed)
    out = Path(r.out)
    if main_process:
        out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    tok = AutoTokenizer.from_pretrained(r.tokenizer or r.target)
    target = _load_target(r.target, device)
    set_cpu_threads(None, device, target)  # regenerating with a small target on the CPU: one thread
    print(f"[train_drafter] target {r.target}: {sum(p.numel() for p in target.parameters()) / 1e6:.1f}M params "
          f"on {device} ({time.time() - _T_START:.1f}s)", flush=True)
    drafter = _initial_drafter(r, target, tok)  # a bad --init-from fails here, before the regeneration
    note = _builtin_note(r, cached=bool(r.regen_cache) and Path(r.regen_cache).is_file())
    if note and main_process:
        print(note, file=sys.stderr, flush=True)
    samples = _training_samples(r, target, tok, main_process, timings)
    if r.train_domains:  # the regeneration (or its cache) covers --domains; this drafter learns from some of them
        samples = [s for s in samples if s.get("domain") in set(r.train_domains)]
    resp_tokens = sum(sum(s["loss_mask"]) for s in samples)
    regen_stats = {"samples": len(samples), "response_tokens": resp_tokens,
                   "per_domain": {d: sum(1 for s in samples if s.get("domain") == d) for d in r.train_domains or r.domains}}  # fmt: skip
    print(f"[train_drafter] {len(samples)} samples, {resp_tokens} response tokens ({timings['regenerate_s']}s)", flush=True)
    if not samples:
        raise RecipeError("no training samples after regeneration")
    if r.regen_only:
        return 0
    model, n_params = _training_model(r, target, drafter)
    collator = DrafterDataCollator(tok, max_length=r.max_length)
    trainer = _trainer(r, model, samples, collator, out, device, main_process)
    t = time.time()
    result = trainer.train()
    timings["train_s"] = round(time.time() - t, 1)
    step_samples = r.batch_size * r.grad_accum * processes
    timings["train_samples_per_s"] = round(trainer.state.global_step * step_samples / max(timings["train_s"], 1e-9), 2)
    if device.type == "cuda":  # what a run needs beside others on one card
        timings["peak_memory_gb"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    print(f"[train_drafter] trained {trainer.state.global_step} steps of {step_samples} samples in {timings['train_s']}s "
          f"(final train loss {result.training_loss:.4f}"
          + (f", peak {timings['peak_memory_gb']} GB" if "peak_memory_gb" in timings else "") + ")", flush=True)
    if not main_process:  # the main process evaluates and writes everything
        return 0
    eval_samples = _eval_samples(r, target, tok, timings) if r.eval_per_domain > 0 else []
    autocast_dtype = torch.bfloat16 if device.type == "cuda" else None
    lh_losses, eval_res = _after_training(r, model, target, samples, eval_samples, collator, autocast_dtype, timings)
    if r.length_head_weight > 0 or r.length_head_steps > 0:
        model.base_drafter.config.length_head_trained = True
    model.save_pretrained(out, dtype=torch.bfloat16, max_shard_size=r.max_shard_size)
    timings["total_s"] = round(time.time() - _T_START, 1)
    last = [x for x in trainer.state.log_history if "loss" in x]
    summary = {
        "args": {**asdict(r), "device": _device_name(r.device)},
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "processes": processes,
        "samples_per_step": step_samples,
        "drafter_params": n_params,
        "target_layer_ids": list(model.base_drafter.config.target_layer_ids),
        "steps": trainer.state.global_step,
        "final_log": last[-1] if last else None,
        "regeneration": regen_stats,
        "length_head_losses": lh_losses[-5:],
        "eval_accept_proxy": eval_res,
        "timings": timings,
    }
    write_text_atomic(out / "train_summary.json", json.dumps(summary, indent=2, default=str))
    print(f"[train_drafter] saved drafter to {out} (total {timings['total_s']}s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
