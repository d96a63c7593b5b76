"""External-traffic mode: adapt a drafter for a target that serves in SGLang or vLLM.

Those engines run the target (and our drafter, exported in the DFlash layout); what they can give
back is their traffic: ``(prompt, response)`` pairs, one JSON object per line. By default
(``sample_unit="request"``, as the released AdaFlash code does) each pair is one request sample of
a regular :class:`OnlineAdapter`: the worker recomputes the target's features and distributions
for the whole sequence and trains on blocks anchored in the response. With
``sample_unit="round"`` each response instead becomes verified-round samples: at random *anchors*
inside the response the drafter drafts a
block (bonus token = the response token at the anchor, context = everything before it), the
target's own distributions at those positions (recomputed with the HF target, which also yields
the context features) are the labels, and the accepted count is the longest prefix of drafts that
matches the response. The samples feed a regular :class:`OnlineAdapter` (OPD / OSD), which writes
every update as an atomic numbered version, by default in the **DFlash layout** the engines read
(``output_dir/LATEST`` names the newest; ``output_dir/latest`` links to it): point
``--speculative-draft-model-path`` (SGLang) or ``speculative_config={"model": ...}`` (vLLM) there
and reload. The traffic is the target's own output, so the samples are on-policy for the target;
unlike live verification, the target logits after a rejected draft are conditioned on the true
response rather than on the rejected drafts.

Accepted lines::

    {"prompt": "<rendered prompt text>", "response": "...", "domain": "math"}
    {"prompt": [{"role": "user", "content": "..."}], "response": "..."}      # chat template
    {"messages": [..., {"role": "assistant", "content": "..."}]}               # last turn = response
    {"prompt_ids": [1, 2, 3], "response_ids": [4, 5, 6]}                       # pre-tokenised

Example:
    >>> stats = adapt_from_jsonl(target, drafter, "traffic.jsonl", tokenizer=tok,
    ...                          output_dir="/models/drafter-online")  # doctest: +SKIP
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Iterator

import torch

from ..speculation.rounds import FinishedRequest, VerifiedRound
from ..modeling import AdaFlashDrafter
from ..speculation.hooks import hooks_for
from ..training.objective import greedy_accepted
from .adapter import OnlineAdapter
from .hub import redact

__all__ = ["adapt_from_jsonl", "iter_traffic", "rounds_from_response"]

logger = logging.getLogger("adaflash_hf.online")


def iter_traffic(path: str | os.PathLike) -> Iterator[dict]:
    """Records of a jsonl traffic file (blank lines skipped; bad lines logged and skipped)."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                logger.warning("%s:%d: not JSON (%s); skipped", path, lineno, e.msg)
                continue
            if isinstance(rec, dict):
                yield rec


def _encode(rec: dict, tokenizer, prompt_add_special_tokens: bool) -> tuple[list[int], list[int]] | None:
    if "prompt_ids" in rec and "response_ids" in rec:
        return [int(t) for t in rec["prompt_ids"]], [int(t) for t in rec["response_ids"]]
    if tokenizer is None:
        raise ValueError("text traffic needs a tokenizer (or pre-tokenised prompt_ids / response_ids)")
    if "messages" in rec and "prompt" not in rec:
        msgs = rec["messages"]
        if not msgs or msgs[-1].get("role") != "assistant":
            return None
        prompt, response = msgs[:-1], msgs[-1].get("content") or ""
    else:
        prompt, response = rec.get("prompt"), rec.get("response")
        if prompt is None or response is None:
            return None
    if isinstance(prompt, list):
        prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    else:
        prompt_ids = tokenizer(prompt, add_special_tokens=prompt_add_special_tokens)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    return list(prompt_ids), list(response_ids)


@torch.no_grad()
def rounds_from_response(
    target,
    drafter: AdaFlashDrafter,
    prompt_ids,
    response_ids,
    anchors: int = 8,
    rng: random.Random | None = None,
    max_length: int | None = None,
) -> list[tuple[VerifiedRound, torch.Tensor]]:
    """Verified-round samples from one (prompt, response): ``[(round, context_features), ...]``.

    One target forward over prompt + response gives the context features (``[1, a, K*H]`` views
    for anchor ``a``) and the target logits at the anchors' block positions; the drafter drafts one
    block per anchor with its current weights.
    """
    rng = rng or random.Random(0)
    B = drafter.config.block_size
    device = next(target.parameters()).device
    ids = torch.tensor(list(prompt_ids) + list(response_ids), dtype=torch.long, device=device)
    if max_length is not None:
        ids = ids[:max_length]
    P, L = len(prompt_ids), ids.numel()
    candidates = list(range(max(P, 1), L - 1))  # bonus = a response token, at least one to predict
    if not candidates:
        return []
    chosen = sorted(rng.sample(candidates, min(anchors, len(candidates))))
    spans = {a: min(B, L - a) for a in chosen}
    positions = sorted({p for a, vl in spans.items() for p in range(a, a + vl)})
    row_of = {p: i for i, p in enumerate(positions)}
    out = target(
        input_ids=ids[None],
        output_hidden_states=True,
        use_cache=False,
        logits_to_keep=torch.tensor(positions, device=device),
    )
    feats = drafter.select_context(out.hidden_states)  # [1, L, K*H]
    logits = out.logits[0]  # [len(positions), V]
    param = next(drafter.parameters())
    lock = hooks_for(drafter).weights_lock
    rounds = []
    for a in chosen:
        vl = spans[a]
        with lock:
            hidden = drafter.draft_block(ids[a : a + 1], feats[:, :a], torch.arange(a + B, device=param.device)[None])
            draft_logits = drafter.compute_logits(hidden[:, 1:]).float()[0]  # [B-1, V]
            ratio = float(drafter.predict_accept_ratio(hidden)[0]) if drafter.length_head is not None else None
        drafts = draft_logits.argmax(-1)[: vl - 1].to(device)
        truth = ids[a + 1 : a + vl]
        accepted = int(greedy_accepted(drafts == truth)) if vl > 1 else 0
        rows = torch.tensor([row_of[p] for p in range(a, a + vl)], device=logits.device)
        block = VerifiedRound.from_block(0, ids[:a].cpu(), ids[a], drafts.cpu(), draft_logits, logits[rows], vl - 1,
                                         accepted, ratio)
        rounds.append((block, feats[:, :a]))
    return rounds


def adapt_from_jsonl(
    target,
    drafter: AdaFlashDrafter,
    path: str | os.PathLike,
    tokenizer=None,
    output_dir: str | None = None,
    *,
    method: str = "opd",
    sample_unit: str = "request",
    anchors_per_response: int = 8,
    max_length: int | None = 4096,
    samples_per_update: int = 128,
    epochs: int = 2,
    batch_size: int = 2,
    lr: float = 3e-4,
    head_lr: float = 2e-4,
    keep_versions: int = 3,
    hub_repo: str | None = None,
    version_layout: str = "dflash",
    train_remainder: bool = True,
    max_records: int | None = None,
    reuse_features: bool = True,
    prompt_add_special_tokens: bool = False,
    seed: int = 0,
    **adapter_kwargs,
) -> dict:
    """Adapt ``drafter`` to the traffic in ``path`` and publish versions to ``output_dir``.

    Records are ingested in order; whenever ``samples_per_update`` samples are buffered an update
    runs (ingestion waits for it, so later records are drafted with the new weights: on-policy).
    ``train_remainder`` trains once more on a final partial buffer. ``anchors_per_response`` and
    ``reuse_features`` apply to ``sample_unit="round"`` only. Extra keyword arguments go to
    :class:`OnlineAdapter` (e.g. ``alpha``, ``clip``, ``max_consecutive_failures``). Returns the
    adapter's ``stats`` (updates, failures, tau before / after per update, versions).
    """
    adapter = OnlineAdapter(
        drafter, target, method=method, sample_unit=sample_unit, samples_per_update=samples_per_update, epochs=epochs,
        batch_size=batch_size, lr=lr, head_lr=head_lr, output_dir=output_dir, keep_versions=keep_versions,
        hub_repo=hub_repo, version_layout=version_layout, clear_after_update=False, seed=seed, **adapter_kwargs,
    )  # fmt: skip
    feed = _Feeder(adapter, target, drafter, anchors_per_response, max_length, reuse_features, random.Random(seed))
    records = skipped = 0
    try:
        for rec in iter_traffic(path):
            if max_records is not None and records >= max_records:
                break
            try:
                encoded = _encode(rec, tokenizer, prompt_add_special_tokens)
            except Exception as e:  # noqa: BLE001
                logger.warning("traffic record %d skipped: %s", records + skipped, redact(f"{type(e).__name__}: {e}"))
                encoded = None
            if encoded is None:
                skipped += 1
                continue
            records += 1
            adapter.set_domain(rec.get("domain"))
            feed(*encoded)
            if adapter.stopped:
                break
        if train_remainder and len(adapter.buffer) > 0 and not adapter.stopped:
            adapter.flush()
        else:
            adapter.wait_for_update()
    finally:
        adapter.close()
    stats = adapter.stats
    stats.update(records=records, records_skipped=skipped)
    return stats


class _Feeder:
    """Turns one (prompt, response) into the adapter's samples, waiting for each update it triggers
    (so later records are drafted with the new weights)."""

    def __init__(self, adapter: OnlineAdapter, target, drafter, anchors: int, max_length, reuse_features: bool, rng):
        self.adapter, self.target, self.drafter = adapter, target, drafter
        self.anchors, self.max_length, self.reuse_features, self.rng = anchors, max_length, reuse_features, rng

    def _added(self) -> None:
        if len(self.adapter.buffer) >= self.adapter.config.samples_per_update:
            self.adapter.wait_for_update()

    def __call__(self, prompt_ids, response_ids) -> None:
        adapter = self.adapter
        if adapter.config.sample_unit == "request":
            ids = torch.tensor(list(prompt_ids) + list(response_ids), dtype=torch.long)[: self.max_length]
            adapter.on_request(FinishedRequest(0, ids[: len(prompt_ids)], ids[len(prompt_ids) :]))
            self._added()
            return
        for verified, feats in rounds_from_response(
            self.target, self.drafter, prompt_ids, response_ids, anchors=self.anchors, rng=self.rng, max_length=self.max_length
        ):
            adapter.add_round(verified, features=feats if self.reuse_features else None)
            self._added()
            if adapter.stopped:
                break
