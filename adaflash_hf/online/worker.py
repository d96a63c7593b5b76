"""The online adapter's shadow trainer: a copy of the serving drafter trained on buffered samples.

The shadow trains through the offline training code, so online and offline learning share one
objective (:class:`~adaflash_hf.training.objective.DrafterObjective`):

* a **request** sample (a finished request) is trained on exactly like offline data, by
  :class:`~adaflash_hf.training.model.DrafterTrainingModel` with a distilling objective: up to
  ``max_anchors`` blocks anchored in the response, the target's features and distributions
  recomputed for the whole sequence; when the adapter recorded the request's served rounds, the blocks
  are anchored there and the length head learns the drafts the target really accepted in each
  (censored where the verify length cut the block), in every sampling mode;
* a **round** sample (one verified round) is a single block: the drafter drafts it from the
  context's target features, and the same objective scores slots ``1..n`` against the verify
  forward's target distributions (``n = min(accepted + 1, verify_len - 1)``; ``label_mode="rollout"``:
  every slot against the target's own greedy continuation); the length head's MSE uses the round's
  real accepted count.

The serving drafter is never touched here: the adapter copies the shadow's weights in under its
round lock (:mod:`adaflash_hf.online.adapter`).

Example:
    >>> worker = ShadowTrainer(drafter, target, OnlineConfig(sample_unit="round"))  # doctest: +SKIP
    >>> result = worker.train(samples, update_index=1)  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import math
import random
from itertools import chain

import torch
import torch.nn.functional as F
from torch import nn

from ..modeling import AdaFlashDrafter
from ..training.losses import default_gamma, position_weights
from ..training.objective import DrafterObjective
from .buffer import RequestSample, Sample
from .config import OnlineConfig
from .pacing import Pacer
from .placement import frozen_copy
from .resume import first_nonfinite

__all__ = ["NonFiniteLossError", "ShadowTrainer", "UpdateAbandoned", "copy_drafter"]


class NonFiniteLossError(RuntimeError):
    """The worker produced a NaN / inf loss or weight; the update is discarded."""


class UpdateAbandoned(RuntimeError):
    """The adapter is shutting down: the update in progress stops at its next step and is discarded."""


def copy_drafter(drafter: AdaFlashDrafter, target: nn.Module, device: torch.device | None = None) -> AdaFlashDrafter:
    """A deep copy of `drafter` bound to `target`, sharing (never copying) the target's embedding
    and LM head; ``device``: its parameters and buffers copied straight there (nothing more on the drafter's own).

    Example:
        >>> shadow = copy_drafter(drafter, target)  # train it without touching the serving drafter  # doctest: +SKIP
    """
    memo: dict = {id(getattr(drafter, "_target_refs", {})): {}}
    if device is not None:  # deepcopy takes these for the originals
        for t in chain(drafter.parameters(), drafter.buffers()):
            moved = t.detach().to(device, copy=True)
            memo[id(t)] = nn.Parameter(moved, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else moved
    return copy.deepcopy(drafter, memo).bind_target(target)


def _grad_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` usable in autograd (inference-mode tensors from generation are cloned)."""
    return t.clone() if t.is_inference() else t


class ShadowTrainer:
    """Trains a shadow copy of ``drafter`` on samples (module doc); owns the shadow, its optimizer
    and, on CUDA, the side stream it trains on, all on ``config.trainer_device`` (default: the drafter's device).
    ``target`` is the trainer's own: the serving one, or with a ``trainer_device`` the target is not on, a frozen
    copy of it there."""

    def __init__(self, drafter: AdaFlashDrafter, target: nn.Module, config: OnlineConfig):
        param = next(drafter.parameters())
        self.device = torch.device(config.trainer_device) if config.trainer_device is not None else param.device
        if config.trainer_device is not None and next(target.parameters()).device != self.device:
            target = frozen_copy(target, self.device)  # no forward of an update on the serving device
        self.drafter, self.target, self.config = drafter, target, config
        self.train_dtype = config.train_dtype
        if self.train_dtype is None:
            self.train_dtype = torch.float32 if param.dtype in (torch.float16, torch.bfloat16) else param.dtype
        self.block_size = int(drafter.config.block_size)
        gamma = default_gamma(self.block_size) if config.position_gamma == "auto" else config.position_gamma
        self.pos_weights = position_weights(self.block_size - 1, float(gamma)) if gamma is not None else None
        self.objective = DrafterObjective(
            config.objective, self.block_size, float(gamma) if gamma is not None else math.inf, config.alpha,
            config.clip, config.temperature, config.clip_mode, config.head_weight if config.method == "opd" else 0.0,
        )  # fmt: skip
        self.shadow: AdaFlashDrafter | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler = None
        self.stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None

    # ------------------------------------------------------------------ shadow / optimizer
    def make_shadow(self) -> AdaFlashDrafter:
        shadow = copy_drafter(self.drafter, self.target, self.device)
        impl = str(getattr(shadow.config, "_attn_implementation", "") or "")
        if self.config.sample_unit == "request" and (impl.startswith("flash") or "paged" in impl):
            # Many blocks per request train in one pass under a block attention mask, which flash
            # kernels cannot take; only the shadow changes, the serving drafter keeps its kernel.
            shadow.set_attn_implementation("sdpa")
        shadow.to(device=self.device, dtype=self.train_dtype)
        shadow.train()
        for p in shadow.parameters():
            p.requires_grad_(True)
        return shadow

    def param_groups(self, shadow: AdaFlashDrafter):
        drafter_params = [p for n, p in shadow.named_parameters() if not n.startswith("length_head.")]
        head_params = []
        if self.config.method == "opd" and shadow.length_head is not None:
            head_params = list(shadow.length_head.parameters())
        return drafter_params, head_params

    def ensure_shadow(self):
        if self.shadow is None:
            self.shadow = self.make_shadow()
            dp, hp = self.param_groups(self.shadow)
            groups = [{"params": dp, "lr": self.config.lr}]
            if hp:
                groups.append({"params": hp, "lr": self.config.head_lr})
            self.optimizer = torch.optim.AdamW(groups, weight_decay=self.config.weight_decay)
            # A fresh AdamW's first steps move every weight by about lr whatever the gradient's size: on a
            # drafter that is already trained, ramp the rate up over the shadow's first steps.
            warmup = self.config.warmup_steps
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: min(1.0, (step + 1) / warmup)) \
                if warmup else None
        return self.shadow, self.optimizer

    def reset(self) -> None:
        """Drop the shadow and its optimizer (rebuilt from the serving weights next time)."""
        self.shadow, self.optimizer, self.scheduler = None, None, None

    def close(self) -> None:
        """Release what the trainer holds beyond its shadow (nothing here; a
        :class:`~adaflash_hf.online.trainer_process.ProcessTrainer` around it stops its child process)."""

    # ------------------------------------------------------------------ the target's side
    @torch.no_grad()
    def target_pass(self, s: Sample) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Target features of ``s.context_ids`` (``[1, T, K*H]``) and, when not stored, the target
        logits at the bonus + draft positions (``[verify_len, V]``), from the frozen target."""
        tparam = next(self.target.parameters())
        ctx = s.context_ids.to(tparam.device)
        T = ctx.numel()
        if s.target_logits is None:
            ids = torch.cat([ctx, torch.tensor([s.bonus_token], device=ctx.device), s.draft_tokens.to(ctx.device)])
            out = self.target(input_ids=ids[None], output_hidden_states=True, use_cache=False, logits_to_keep=s.verify_len)
            logits = out.logits[0, -s.verify_len :]
            feats = self.drafter.select_context(out.hidden_states)[:, :T] if T else None
            return feats, logits
        if T == 0:
            return None, None
        decoder = self.target.get_decoder() if hasattr(self.target, "get_decoder") else None
        model = decoder if decoder is not None else self.target
        out = model(input_ids=ctx[None], output_hidden_states=True, use_cache=False)
        return self.drafter.select_context(out.hidden_states), None

    @torch.no_grad()
    def rollout(self, s: Sample) -> torch.Tensor:
        """The frozen target's distributions along its own greedy continuation of the bonus token:
        ``[B-1, V]``, row ``j`` predicting draft slot ``j + 1`` (the labels of ``label_mode="rollout"``)."""
        from transformers import DynamicCache

        device = next(self.target.parameters()).device
        ids = torch.cat([s.context_ids.to(device), torch.tensor([s.bonus_token], device=device)])[None]
        cache, rows = DynamicCache(config=self.target.config), []
        for _ in range(self.block_size - 1):
            logits = self.target(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
            rows.append(logits[0].float())
            ids = logits.argmax(dim=-1, keepdim=True)
        return torch.stack(rows)

    @staticmethod
    def _logits(model: AdaFlashDrafter, hidden: torch.Tensor) -> torch.Tensor:
        lm = model._target_ref("lm_head")
        if isinstance(lm, nn.Linear):  # detached weights: no gradient can reach the target
            w = lm.weight.detach()
            b = lm.bias.detach() if lm.bias is not None else None
            return F.linear(hidden.to(device=w.device, dtype=w.dtype), w, b)
        return model.compute_logits(hidden)

    # ------------------------------------------------------------------ round samples
    def _round_inputs(self, s: Sample, cache_features: bool):
        """``(context features or None, target logits)`` of a round sample, recomputed when not stored."""
        feats, tlogits = s.features, s.target_logits
        if (feats is None and s.context_ids.numel() > 0) or tlogits is None:
            new_feats, new_logits = self.target_pass(s)
            if feats is None:
                feats = new_feats
                if cache_features and self.config.store_features and feats is not None:
                    s.features = feats.to(torch.bfloat16 if feats.is_floating_point() else feats.dtype)
            if tlogits is None:
                tlogits = new_logits
        return feats, tlogits

    def _draft_block(self, model: AdaFlashDrafter, s: Sample, feats) -> torch.Tensor:
        """The block's final hidden states ``[1, B, H]`` drafted by ``model`` from the context features."""
        dev = next(model.parameters()).device
        T = s.context_ids.numel()
        bonus = torch.tensor([s.bonus_token], device=model._target_ref("embed").weight.device)
        pos = torch.arange(T + self.block_size, device=dev)[None]
        return model.draft_block(bonus, feats if T > 0 else None, pos)

    def sample_loss(self, model: AdaFlashDrafter, s: Sample, cache_features: bool = True):
        """``(main_loss, head_loss)`` of one round sample for ``model`` (the shadow, or the serving
        drafter for :meth:`evaluate`). ``main``: the objective's distillation of draft slots ``1..n``
        against ``target_logits[0..n-1]``, ``n = min(num_accepted + 1, verify_len - 1)``
        (``label_mode="rollout"``: all ``B - 1`` slots against the target's greedy rollout); ``head``:
        MSE of the length head on detached features against ``(num_accepted + 1) / B`` (OPD only)."""
        B = self.block_size
        feats, tlogits = self._round_inputs(s, cache_features)
        hidden = self._draft_block(model, s, feats)
        if self.config.label_mode == "rollout":
            if s.rollout_logits is None:
                s.rollout_logits = self.rollout(s).to(torch.bfloat16)
            tlogits, n = s.rollout_logits.float(), B - 1
        else:
            # Only slots up to the first rejected draft carry usable labels: the verify forward
            # conditions later target distributions on a wrong draft prefix, while the block drafter
            # predicts every slot from the verified context alone.
            n = min(s.num_accepted + 1, s.verify_len - 1, B - 1)
        main = hidden.sum() * 0.0
        if n > 0 and self.config.method in ("opd", "osd"):
            draft_logits = self._logits(model, hidden[:, 1 : 1 + n])
            target_logits = _grad_ready(tlogits[:n].to(draft_logits.device))[None]
            w = self.pos_weights[:n].to(draft_logits.device) if self.pos_weights is not None else None
            main = self.objective.distill_loss(draft_logits, target_logits, w)
        head = main.new_zeros(())
        if self.config.method == "opd" and model.length_head is not None:
            pred = model.predict_accept_ratio(hidden)  # detached input: no gradient into the drafter
            dev = pred.device
            head = self.objective.head_loss(pred, torch.tensor([s.num_accepted], device=dev),
                                            verify_len=torch.tensor([s.verify_len], device=dev))  # fmt: skip
        return main, head

    # ------------------------------------------------------------------ request samples
    def request_model(self, model: AdaFlashDrafter):
        """The offline training wrapper around ``model`` with this worker's objective: OPD (or
        OSD's forward KL) against the target's distributions on blocks anchored in responses."""
        from ..training.model import DrafterTrainingModel

        return DrafterTrainingModel(self.target, model, max_anchors=self.config.max_anchors, objective=self.objective,
                                    move_target=False)  # fmt: skip

    def request_batch(self, batch: list[RequestSample], device) -> dict[str, torch.Tensor]:
        from ..training.collator import DrafterDataCollator

        pad = getattr(self.target.config, "pad_token_id", None)
        collate = DrafterDataCollator(max_length=None, pad_token_id=pad if isinstance(pad, int) else 0)
        rows = [{"input_ids": s.input_ids.tolist(), "loss_mask": [0] * s.prompt_len + [1] * s.response_len} for s in batch]
        out = collate(rows)
        if all(s.served is not None for s in batch):
            out.update(served_blocks(batch, self.config.max_anchors))
        return {k: v.to(device) for k, v in out.items()}

    # ------------------------------------------------------------------ training
    def _batch_losses(self, shadow, batch: list, wrapper) -> list[tuple]:
        """``[(loss, main, head, samples)]`` of one optimizer step's samples."""
        if wrapper is not None:  # the whole batch of requests in one forward
            out = wrapper(**self.request_batch(batch, self.device))
            return [(out["loss"], out["ce_loss"], out["length_loss"], len(batch))]
        losses = []
        for s in batch:
            main, head = self.sample_loss(shadow, s)
            loss = (main.float() + self.config.head_weight * head.float()) / len(batch)
            losses.append((loss, main.detach(), head.detach(), 1))
        return losses

    def _step(self, losses: list[tuple], groups: tuple[list, list]) -> float:
        """Sum the gradients of ``losses``, clip each parameter group, take one optimizer step; returns
        the drafter group's gradient norm before clipping."""
        params = groups[0] + groups[1]
        grads: list[torch.Tensor | None] = [None] * len(params)
        step_loss = 0.0
        for loss, *_ in losses:
            step_loss += float(loss.detach())
            if loss.requires_grad:
                gs = torch.autograd.grad(loss, params, allow_unused=True)
                grads = [g if a is None else (a if g is None else a + g) for a, g in zip(grads, gs)]
        if not math.isfinite(step_loss):
            raise NonFiniteLossError(f"non-finite loss {step_loss} in an online update")
        for p, g in zip(params, grads):
            p.grad = g
        clip = self.config.grad_clip if self.config.grad_clip is not None else math.inf
        norms = [float(torch.nn.utils.clip_grad_norm_(group, clip)) if group else 0.0 for group in groups]
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norms[0]

    def train(self, samples: list[Sample], update_index: int, should_stop=lambda: False) -> dict:
        """``config.epochs`` passes over ``samples`` (shuffled with a seed of ``update_index``);
        returns the first / last epoch's mean main loss and the last epoch's head loss. Raises
        :class:`UpdateAbandoned` before any step once ``should_stop()`` is true."""
        cfg = self.config
        shadow, _ = self.ensure_shadow()
        groups = self.param_groups(shadow)
        rng = random.Random(cfg.seed * 1_000_003 + update_index)
        n = len(samples)
        epoch_losses: list[float] = []
        grad_norms: list[float] = []
        head_last = None
        wrapper = self.request_model(shadow) if cfg.sample_unit == "request" else None
        pacer = Pacer(cfg.train_share)
        with torch.enable_grad():
            for _ in range(cfg.epochs):
                order = list(range(n))
                rng.shuffle(order)
                main_sum, head_sum, count = 0.0, 0.0, 0
                for start in range(0, n, cfg.batch_size):
                    if should_stop():
                        raise UpdateAbandoned("the adapter is closing")
                    batch = [samples[i] for i in order[start : start + cfg.batch_size]]
                    pacer.start()
                    losses = self._batch_losses(shadow, batch, wrapper)
                    for _, main, head, k in losses:
                        main_sum, head_sum, count = main_sum + float(main) * k, head_sum + float(head) * k, count + k
                    grad_norms.append(self._step(losses, groups))
                    pacer.done()
                epoch_losses.append(main_sum / max(count, 1))
                head_last = head_sum / max(count, 1)
        bad = first_nonfinite(shadow.named_parameters())
        if bad is not None:
            raise NonFiniteLossError(f"non-finite weights in {bad} after an online update")
        return {
            "loss_first": epoch_losses[0] if epoch_losses else None,
            "loss_last": epoch_losses[-1] if epoch_losses else None,
            "head_loss_last": head_last if (cfg.method == "opd" and shadow.length_head is not None) else None,
            "grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else None,
        }

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, model: AdaFlashDrafter, samples: list) -> dict:
        """Mean main / length-head loss of ``model`` on request samples or round samples, untrained (on a copy of it
        on the trainer's device, when it lives elsewhere)."""
        if next(model.parameters()).device != self.device:
            model = copy_drafter(model, self.target, self.device)
        if samples and all(isinstance(x, RequestSample) for x in samples):
            out = self.request_model(model)(**self.request_batch(samples, self.device))
            return {"loss": float(out["ce_loss"]), "head_loss": float(out["length_loss"])}
        main_sum, head_sum = 0.0, 0.0
        for s in samples:
            main, head = self.sample_loss(model, s, cache_features=False)
            main_sum += float(main)
            head_sum += float(head)
        n = max(len(samples), 1)
        return {"loss": main_sum / n, "head_loss": head_sum / n}

    @torch.no_grad()
    def accept_len(self, model: AdaFlashDrafter, samples: list[RequestSample], seed: int) -> float:
        """Mean greedy accepted length + 1 per block of ``model``'s drafts on request ``samples``
        (training's ``accept_len``: drafts against the target's argmax), in eval mode, ``batch_size``
        samples per forward. The blocks are the served rounds' anchors when the samples carry them, else
        anchors drawn from ``seed``: given the same samples and seed, every model is scored on the same
        blocks, so two models compare pairwise."""
        return mean_accept_len(self._accepted(model, samples, seed, self.config.batch_size))

    @torch.no_grad()
    def request_acceptance(self, model: AdaFlashDrafter, samples: list[RequestSample],
                           seed: int) -> list[tuple[float, int]]:
        """Per request sample, ``(accepted drafts summed over its blocks, its blocks)``: :meth:`accept_len`'s
        measure one request per forward, so that two models compare request by request (the guard's paired gain)."""
        return self._accepted(model, samples, seed, 1)

    def _accepted(self, model, samples, seed: int, batch_size: int) -> list[tuple[float, int]]:
        """``(accepted drafts, blocks)`` per forward of ``batch_size`` samples (the measure of :meth:`accept_len`)."""
        from ..training.blocks import sample_anchors

        wrapper = self.request_model(model)
        was_training = model.training
        model.eval()  # no dropout in a measurement
        out_rows = []
        try:
            for start in range(0, len(samples), batch_size):
                batch = self.request_batch(samples[start : start + batch_size], self.device)
                if "anchors" not in batch:
                    mask = batch["loss_mask"] & batch["attention_mask"]  # where the wrapper draws its anchors
                    gen = torch.Generator(device=mask.device).manual_seed(seed + start)
                    batch["anchors"], batch["anchor_valid"] = sample_anchors(mask, self.block_size, self.config.max_anchors,
                                                                             generator=gen)  # fmt: skip
                out = wrapper(**batch)
                n = int(out["num_blocks"])
                out_rows.append(((float(out["accept_len"]) - 1.0) * n, n))
        finally:
            model.train(was_training)
        return out_rows


def mean_accept_len(rows: list[tuple[float, int]]) -> float:
    """``accept_len`` over every block of ``(accepted drafts, blocks)`` rows (1.0 with no block)."""
    blocks = sum(n for _, n in rows)
    return sum(a for a, _ in rows) / blocks + 1.0 if blocks else 1.0


def served_blocks(batch: list[RequestSample], max_anchors: int) -> dict[str, torch.Tensor]:
    """Blocks anchored at each request's served rounds, with the length head's labels from real verification:
    ``anchors`` / ``anchor_valid`` / ``served_accepted`` / ``served_verify_len`` ``[b, n]`` (up to
    ``max_anchors`` rounds per request, evenly spread; a round needs a next token inside the request)."""
    kept = []
    for s in batch:
        r = s.served[s.served[:, 0] + 1 < s.input_ids.numel()]
        if r.shape[0] > max_anchors:
            r = r[torch.linspace(0, r.shape[0] - 1, max_anchors).round().long()]
        kept.append(r)
    n = max(1, max(r.shape[0] for r in kept))
    out = torch.zeros(3, len(batch), n, dtype=torch.long)
    valid = torch.zeros(len(batch), n, dtype=torch.bool)
    for i, r in enumerate(kept):
        out[:, i, : r.shape[0]] = r.T
        valid[i, : r.shape[0]] = True
    out[2][~valid] = 1  # padding: any verify length (masked out)
    return {"anchors": out[0], "anchor_valid": valid, "served_accepted": out[1], "served_verify_len": out[2]}

