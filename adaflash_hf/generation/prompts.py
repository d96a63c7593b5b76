"""Prompts as batched `generate` takes them: encoded with the chat template, then left padded."""

from __future__ import annotations

import torch


def encode_prompt(tokenizer, prompt: list[dict] | str) -> list[int]:
    """Token ids of a chat prompt (a message list, through the tokenizer's chat template with the
    generation prompt; joined by newlines when there is no template) or of a continuation prompt
    (a raw string, encoded as is). No special tokens beyond what the template writes.

    Example:
        >>> encode_prompt(tok, [{"role": "user", "content": "Hi"}])  # doctest: +SKIP
    """
    if isinstance(prompt, str):
        return tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    else:
        text = "\n".join(m["content"] for m in prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def left_pad(rows: list[list[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of id lists left padded to the longest (an empty row is all padding).

    Example:
        >>> left_pad([[5, 6], [7]], pad_id=0)
        (tensor([[5, 6],
                [0, 7]]), tensor([[1, 1],
                [0, 1]]))
    """
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r) :] = 1
    return ids.to(device), mask.to(device)
