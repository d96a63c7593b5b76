"""Offline DFlash / AdaFlash drafter training that plugs into ``transformers.Trainer``.

The library pieces live in their own modules and are re-exported here:

* :class:`~adaflash_hf.training.model.DrafterTrainingModel`: frozen target + trainable drafter whose
  ``forward`` returns the loss (:mod:`~adaflash_hf.training.objective`: cross-entropy at random anchors,
  or OPD / forward-KL distillation; the length head trained on detached states);
* :class:`~adaflash_hf.training.collator.DrafterDataCollator` and :func:`encode_sample`: chat, text and
  pre-tokenised samples, right padded;
* :func:`build_feature_cache` / :class:`FeatureCacheDataset` (:mod:`~adaflash_hf.training.features`):
  the target's features computed once;
* :func:`save_drafter` / :func:`drafter_state_dict` (:mod:`~adaflash_hf.training.checkpoint`): native
  checkpoints, LoRA merged, written atomically.

This module adds :class:`DrafterTrainer` (a ``Trainer`` whose checkpoints hold only the drafter, which
logs the extra metrics), the log / wall-clock callbacks and schedule, and :func:`train_length_head`.

Example (single process)::

    from transformers import TrainingArguments
    from adaflash_hf import AdaFlashDrafter
    from adaflash_hf.training.trainer import DrafterTrainingModel, DrafterTrainer, DrafterDataCollator

    drafter = AdaFlashDrafter.from_target(target, num_layers=2, block_size=16, tokenizer=tok)
    model = DrafterTrainingModel(target, drafter)
    args = TrainingArguments("runs/drafter", per_device_train_batch_size=8, learning_rate=6e-4,
                             lr_scheduler_type="cosine", warmup_ratio=0.04, max_grad_norm=1.0,
                             num_train_epochs=6, bf16=True, report_to=[])
    trainer = DrafterTrainer(model=model, args=args, train_dataset=samples,
                             data_collator=DrafterDataCollator(tok, max_length=3072))
    trainer.train()
    model.save_pretrained("my-drafter", dtype=torch.bfloat16)   # native drafter checkpoint

**PEFT / LoRA.** Either pass ``peft_config=LoraConfig(target_modules=["q_proj", "k_proj",
"v_proj", "o_proj"], ...)`` to :class:`DrafterTrainingModel`, or wrap the drafter yourself with
``get_peft_model(drafter, config)`` before building the wrapper. Do **not** call
``get_peft_model`` on the wrapper (the frozen target is outside it, but adapters belong on the
drafter only). LoRA freezes everything else, including ``fc``, ``hidden_norm`` and the length head:
add them to ``modules_to_save`` to train them too (the length-head loss is skipped while the head
has no trainable parameter). Saved checkpoints merge the adapters into a plain drafter.

**Several GPUs** (``accelerate``; two CPU processes of the gloo backend take the steps of one process with
two-fold gradient accumulation, ``tests/test_train_distributed.py``)::

    accelerate launch --num_processes 8 -m adaflash_hf.training.train_drafter --target T --out O ...

or any script that builds a :class:`DrafterTrainer`: the Trainer wraps the drafter in DDP, each
process holds its own frozen target copy (not part of DDP, so no gradient all-reduce for it), the
per-device batch is ``per_device_train_batch_size``, ``group_by_length`` orders the samples by the global batch
from the run's seed (every process the same order; accelerate deals the batches out in turn), and only the main
process writes checkpoints.
Use plain DDP (the default of ``accelerate launch`` without an FSDP/DeepSpeed config): the
drafter is small, and :meth:`DrafterTrainingModel.save_pretrained` reads the drafter's full
(unsharded) state dict, which FSDP / ZeRO-3 would have to gather first (not supported here).
For targets that do not fit one GPU, precompute features once (:func:`build_feature_cache`, which
can run with a ``device_map="auto"`` target) and train from :class:`FeatureCacheDataset`; then
each process only needs the target's embedding and LM head (``move_target=False`` leaves a
``device_map``-dispatched target where it is).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Iterable

import torch
from torch import nn
from transformers import Trainer, TrainerCallback
from transformers.trainer_pt_utils import LengthGroupedSampler

from .checkpoint import drafter_state_dict, is_peft, save_drafter, unwrap_drafter
from .collator import DrafterDataCollator, encode_sample
from .features import FeatureCacheDataset, build_feature_cache, compute_target_features
from .model import DrafterTrainingModel

__all__ = [
    "DrafterTrainingModel",
    "DrafterTrainer",
    "DrafterDataCollator",
    "encode_sample",
    "build_feature_cache",
    "compute_target_features",
    "FeatureCacheDataset",
    "train_length_head",
    "unwrap_drafter",
    "drafter_state_dict",
    "save_drafter",
    "JsonlLogCallback",
    "WallClockCallback",
    "wall_clock_cosine_schedule",
]


class DrafterTrainer(Trainer):
    """``transformers.Trainer`` for :class:`DrafterTrainingModel`.

    * ``compute_loss`` returns the model's ``loss`` and logs ``ce_loss``, ``length_loss``,
      ``accuracy`` (slot-1 top-1) and ``accept_len`` (mean ``accepted + 1`` per block, a training
      proxy for tau) averaged over each logging window;
    * checkpoints and ``save_model`` write **the drafter only**, native layout (LoRA merged), plus
      the tokenizer if given; resuming reloads the drafter weights;
    * ``remove_unused_columns`` is forced off (the collator needs the raw sample fields).
    """

    _metric_keys = ("ce_loss", "length_loss", "accuracy", "accept_len")

    def __init__(self, model: DrafterTrainingModel | None = None, args=None, *pargs, **kwargs):
        if args is not None and getattr(args, "remove_unused_columns", False):
            args.remove_unused_columns = False
        super().__init__(model, args, *pargs, **kwargs)
        self._metric_sums: dict[str, float] = {}
        self._metric_count = 0

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        if model.training:  # summed as tensors: no host sync until the next log
            for k in self._metric_keys:
                if k in outputs:
                    v = outputs[k].detach().float()
                    self._metric_sums[k] = self._metric_sums[k] + v if k in self._metric_sums else v
            self._metric_count += 1
        loss = outputs["loss"]
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self._metric_count:
            for k, v in self._metric_sums.items():
                logs[k] = round(float(v) / self._metric_count, 6)
            self._metric_sums, self._metric_count = {}, 0
        super().log(logs, start_time)

    def _get_train_sampler(self, train_dataset=None):
        """transformers' sampler, except that ``group_by_length`` groups by the *global* batch (every process's
        batches of an optimizer step) from a generator of the run's seed: every process draws the same order, and
        accelerate deals its batches out in turn, so N processes and one process with N-fold gradient accumulation
        take their steps on the same samples (transformers groups by each process's batch from torch's global RNG)."""
        sampler = super()._get_train_sampler(train_dataset)
        if not isinstance(sampler, LengthGroupedSampler):
            return sampler
        args = self.args
        seed = args.data_seed if args.data_seed is not None else args.seed
        step_batch = args.train_batch_size * args.gradient_accumulation_steps * args.world_size
        return LengthGroupedSampler(step_batch, lengths=sampler.lengths, generator=torch.Generator().manual_seed(seed))

    def _training_model(self) -> DrafterTrainingModel:
        m = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        if not isinstance(m, DrafterTrainingModel):
            raise TypeError(f"DrafterTrainer needs a DrafterTrainingModel, got {type(m).__name__}")
        return m

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        self._training_model().save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        from ..modeling import AdaFlashDrafter

        m = self._training_model()
        loaded = AdaFlashDrafter.from_pretrained(resume_from_checkpoint)
        sd = loaded.state_dict()
        base = m.base_drafter
        if is_peft(m.drafter):
            raise NotImplementedError("resuming a PEFT drafter run from a merged checkpoint is not supported")
        base.load_state_dict({k: v.to(base.fc.weight.dtype) for k, v in sd.items()})


# ----------------------------------------------------------------------------- callbacks / schedules


class JsonlLogCallback(TrainerCallback):
    """Append every Trainer log record (step, loss, lr, metrics, elapsed seconds) to a jsonl file."""

    def __init__(self, path: str | os.PathLike, verbose: bool = False, budget_s: float | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.verbose = verbose
        self.budget_s = budget_s
        self.t0 = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.t0 = time.time()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or not state.is_world_process_zero:
            return
        rec = {"step": state.global_step}
        for k, v in logs.items():
            if k == "learning_rate":
                k = "lr"
            if isinstance(v, (int, float)):
                rec[k] = v
        rec["elapsed_s"] = round(time.time() - (self.t0 or time.time()), 2)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
        if self.verbose and "loss" in rec:
            parts = [f"step {rec['step']}", f"loss {rec['loss']:.4f}"]
            for k, fmt in (("ce_loss", ".4f"), ("length_loss", ".4f"), ("accuracy", ".3f"), ("accept_len", ".3f"), ("lr", ".2e")):
                if k in rec:
                    parts.append(f"{k} {rec[k]:{fmt}}")
            budget = f"/{self.budget_s:.0f}" if self.budget_s else ""
            parts.append(f"{rec['elapsed_s']:.0f}{budget}s")
            print("[train] " + " | ".join(parts), flush=True)


class WallClockCallback(TrainerCallback):
    """Stop training once ``seconds`` of training wall clock have passed; exposes ``fraction()``
    (elapsed share of the budget, read at the end of each step) for :func:`wall_clock_cosine_schedule`.

    Several processes (``torch.distributed``) use the main process's clock: each step's share is broadcast from
    rank 0, so that every process takes the same learning rate and stops after the same step (a process that
    stopped alone would leave the others waiting in their next gradient all-reduce)."""

    def __init__(self, seconds: float):
        self.seconds = float(seconds)
        self.t0: float | None = None
        self._fraction = 0.0

    def fraction(self) -> float:
        return self._fraction

    def on_train_begin(self, args, state, control, **kwargs):
        self.t0 = time.time()
        self._fraction = 0.0

    def on_step_end(self, args, state, control, **kwargs):
        self._fraction = _from_rank_zero(min(1.0, (time.time() - self.t0) / max(self.seconds, 1e-9)))
        if self._fraction >= 1.0:
            control.should_training_stop = True
            control.should_save = False
        return control


def _from_rank_zero(value: float) -> float:
    """``value`` as the main process has it, when several processes train (else ``value``)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.broadcast(t, src=0)
    return float(t.item())


def wall_clock_cosine_schedule(optimizer, clock: WallClockCallback, warmup_ratio: float = 0.04, min_ratio: float = 0.0):
    """A ``LambdaLR`` whose warmup + cosine decay run over *wall-clock time* (``clock.fraction()``)
    instead of steps: the right schedule when the budget is minutes, not a step count."""

    def factor(_step: int) -> float:
        f = clock.fraction()
        if f < warmup_ratio:
            return max(f / warmup_ratio, 1e-3)
        p = (f - warmup_ratio) / max(1e-9, 1.0 - warmup_ratio)
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * min(p, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ----------------------------------------------------------------------------- length head


def train_length_head(
    drafter: nn.Module,
    target: nn.Module,
    dataloader: Iterable[dict],
    steps: int,
    lr: float = 2e-4,
    max_anchors: int = 512,
    autocast_dtype: torch.dtype | None = None,
    progress: bool = False,
    block_attention: str = "dense",
    log_every: int = 0,
) -> list[float]:
    """Offline initialisation of the length head on a **frozen** drafter (the released AdaFlash recipe).

    Only ``drafter.length_head`` is optimised (AdamW, ``lr``) for ``steps`` batches of
    ``dataloader`` (cycled), with the MSE against ``(accepted + 1) / B`` of the module docstring.
    ``block_attention`` is :class:`DrafterTrainingModel`'s; ``log_every > 0`` prints the mean loss of
    every ``log_every`` steps (for logs without a progress bar).
    Sets ``config.length_head_trained = True`` and returns the per-step losses.
    """
    from tqdm.auto import tqdm

    base = unwrap_drafter(drafter)
    if base.length_head is None:
        raise ValueError("this drafter has no length head (config.use_length_head is False)")
    flags = {n: p.requires_grad for n, p in base.named_parameters()}
    base.requires_grad_(False)
    base.length_head.requires_grad_(True)
    model = DrafterTrainingModel(target, drafter, max_anchors=max_anchors, length_head_weight=1.0,
                                 block_attention=block_attention)
    device = base.fc.weight.device
    t0 = time.time()
    opt = torch.optim.AdamW(base.length_head.parameters(), lr=lr)
    was_training = base.training
    model.train()
    losses: list[float] = []
    it = iter(dataloader)
    try:
        for _ in tqdm(range(steps), desc="length head", disable=not progress):
            try:
                batch = next(it)
            except StopIteration:
                it = iter(dataloader)
                batch = next(it)
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
            ctx = (
                torch.autocast(device.type, dtype=autocast_dtype)
                if autocast_dtype is not None
                else torch.autocast(device.type, enabled=False)
            )
            with ctx:
                out = model(**batch)
            loss = out["loss"]  # = ce (no grad: the drafter is frozen) + length-head MSE
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(out["length_loss"]))
            if log_every and len(losses) % log_every == 0:
                print(f"[length head] step {len(losses)}/{steps} | loss {sum(losses[-log_every:]) / log_every:.5f} | "
                      f"{time.time() - t0:.0f}s", flush=True)
    finally:
        for n, p in base.named_parameters():
            p.requires_grad_(flags.get(n, p.requires_grad))
        base.train(was_training)
    base.config.length_head_trained = True
    return losses
