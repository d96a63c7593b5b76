"""Training batches from chat, text and pre-tokenised samples (right padded).

:func:`encode_sample` turns one sample into ``{"input_ids", "loss_mask"}`` (the loss mask marks the
response tokens: assistant turns of a chat through the template's ``{% generation %}`` tags or prefix
rendering, every token of plain text); :class:`DrafterDataCollator` pads a list of them, with cached
target features when every sample carries them.

Example:
    >>> batch = DrafterDataCollator(tok, max_length=1024)([{"text": "Hello"}, {"messages": msgs}])  # doctest: +SKIP
"""

from __future__ import annotations

import torch

__all__ = ["DrafterDataCollator", "encode_sample"]


def _assistant_mask_by_prefix(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids + assistant mask for templates without ``{% generation %}`` tags (prefix rendering)."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    mask = [0] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(tokenizer.apply_chat_template(messages[:i], tokenize=True, return_dict=True, add_generation_prompt=True)["input_ids"])
        end = len(tokenizer.apply_chat_template(messages[: i + 1], tokenize=True, return_dict=True)["input_ids"])
        for j in range(start, min(end, len(ids))):
            mask[j] = 1
    return ids, mask


def encode_sample(tokenizer, sample: dict, max_length: int | None = None) -> dict[str, list[int]]:
    """One sample -> ``{"input_ids", "loss_mask"}`` (lists), truncated to ``max_length``.

    Accepts ``{"input_ids"[, "loss_mask"]}`` (pre-tokenised; default mask: all ones),
    ``{"messages": [...]}`` (chat template; mask = assistant tokens), ``{"prompt", "response"}``
    strings (mask = response) and ``{"text"}`` (mask = all tokens).
    """
    if "input_ids" in sample:
        ids = [int(x) for x in (sample["input_ids"].tolist() if torch.is_tensor(sample["input_ids"]) else sample["input_ids"])]
        lm = sample.get("loss_mask")
        mask = [1] * len(ids) if lm is None else [int(bool(x)) for x in (lm.tolist() if torch.is_tensor(lm) else lm)]
    elif "messages" in sample:
        if tokenizer is None:
            raise ValueError("chat samples need a tokenizer")
        try:
            enc = tokenizer.apply_chat_template(
                sample["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            ids, mask = list(enc["input_ids"]), list(enc["assistant_masks"])
            if not any(mask):  # template without {% generation %}
                raise ValueError
        except ValueError:
            ids, mask = _assistant_mask_by_prefix(tokenizer, sample["messages"])
    elif "prompt" in sample and "response" in sample:
        p = tokenizer(sample["prompt"], add_special_tokens=False)["input_ids"]
        r = tokenizer(sample["response"], add_special_tokens=False)["input_ids"]
        ids, mask = p + r, [0] * len(p) + [1] * len(r)
    elif "text" in sample:
        ids = tokenizer(sample["text"], add_special_tokens=False)["input_ids"]
        mask = [1] * len(ids)
    else:
        raise ValueError(f"cannot encode a sample with keys {sorted(sample)}")
    if len(mask) != len(ids):
        raise ValueError(f"loss_mask length {len(mask)} != input_ids length {len(ids)}")
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return {"input_ids": ids, "loss_mask": mask}


class DrafterDataCollator:
    """Pad a list of samples (see :func:`encode_sample`) into ``input_ids``, ``attention_mask``,
    ``loss_mask`` (bool) and, for cached samples, ``target_features`` (zero-padded). Right padding."""

    def __init__(self, tokenizer=None, max_length: int | None = 2048, pad_token_id: int | None = None,
                 pad_to_multiple_of: int | None = None):
        self.tokenizer = tokenizer
        self.max_length = max_length
        if pad_token_id is None and tokenizer is not None:
            pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_token_id = 0 if pad_token_id is None else int(pad_token_id)
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        enc = [encode_sample(self.tokenizer, s, self.max_length) for s in samples]
        T = max(1, max(len(e["input_ids"]) for e in enc))
        if self.pad_to_multiple_of:
            T = -(-T // self.pad_to_multiple_of) * self.pad_to_multiple_of
        b = len(enc)
        ids = torch.full((b, T), self.pad_token_id, dtype=torch.long)
        am = torch.zeros(b, T, dtype=torch.bool)
        lm = torch.zeros(b, T, dtype=torch.bool)
        for i, e in enumerate(enc):
            n = len(e["input_ids"])
            ids[i, :n] = torch.tensor(e["input_ids"], dtype=torch.long)
            am[i, :n] = True
            lm[i, :n] = torch.tensor(e["loss_mask"], dtype=torch.bool)
        batch = {"input_ids": ids, "attention_mask": am, "loss_mask": lm}
        if all("target_features" in s for s in samples):
            feats = [s["target_features"] for s in samples]
            f = feats[0].new_zeros(b, T, feats[0].shape[-1])
            for i, x in enumerate(feats):
                n = min(x.shape[0], len(enc[i]["input_ids"]))
                f[i, :n] = x[:n]
            batch["target_features"] = f
        return batch
