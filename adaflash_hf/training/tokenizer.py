"""Byte-level BPE tokenizer for the reference pair (trained here; no hub access).

Special tokens (fixed ids, in this order): ``<|endoftext|>`` (0, eos / document separator),
``<|pad|>`` (1), ``<|im_start|>`` (2), ``<|im_end|>`` (3, end of an assistant turn) and ``<|mask|>``
(4, the DFlash mask token). Chat format is ChatML::

    <|im_start|>user\\n{content}<|im_end|>\\n<|im_start|>assistant\\n{content}<|im_end|>\\n

Generation stops at ``<|im_end|>`` or ``<|endoftext|>`` (see ``STOP_TOKENS``). Assistant contents are
wrapped in ``{% generation %}`` tags, so ``apply_chat_template(..., return_assistant_tokens_mask=True)``
marks the response tokens (the anchors of DFlash training live there).
"""

from __future__ import annotations

from typing import Iterable, Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"
PAD = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK = "<|mask|>"
SPECIAL_TOKENS = (EOS, PAD, IM_START, IM_END, MASK)
STOP_TOKENS = (IM_END, EOS)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

MODEL_MAX_LENGTH = 2048


def _batches(texts: Iterable[str], size: int = 1000) -> Iterator[list[str]]:
    buf: list[str] = []
    for t in texts:
        if t:
            buf.append(t)
        if len(buf) >= size:
            yield buf
            buf = []
    if buf:
        yield buf


def build_raw_tokenizer() -> Tokenizer:
    """Untrained byte-level BPE: digits split one by one (helps arithmetic), GPT-2 style regex split."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tk.decoder = decoders.ByteLevel()
    return tk


def wrap_tokenizer(tk: Tokenizer) -> PreTrainedTokenizerFast:
    """Wrap a trained ``tokenizers.Tokenizer`` as a transformers fast tokenizer with the chat template."""
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        eos_token=EOS,
        pad_token=PAD,
        mask_token=MASK,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
    )
    # im_start / im_end are registered as added special tokens already (trainer special_tokens);
    # declaring them as additional special tokens makes skip_special_tokens drop them.
    tok.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
    tok.chat_template = CHAT_TEMPLATE
    for t in SPECIAL_TOKENS:
        tid = tok.convert_tokens_to_ids(t)
        if tid is None or tid == tok.unk_token_id:
            raise RuntimeError(f"special token {t} missing from the vocabulary")
    return tok


def train_tokenizer(
    texts_iter: Iterable[str],
    vocab_size: int = 8192,
    min_frequency: int = 2,
    show_progress: bool = False,
    length: int | None = None,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of ``vocab_size`` tokens (special tokens included) on ``texts_iter``.

    Returns a ``PreTrainedTokenizerFast`` with eos ``<|endoftext|>``, pad ``<|pad|>``, mask
    ``<|mask|>``, the ChatML template, and ``<|im_start|>`` / ``<|im_end|>`` as special tokens; the
    special tokens take ids 0-4. ``save_pretrained`` / ``AutoTokenizer.from_pretrained`` round-trip.
    """
    tk = build_raw_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tk.train_from_iterator(_batches(texts_iter), trainer=trainer, length=length)
    return wrap_tokenizer(tk)


def stop_token_ids(tok) -> list[int]:
    """Ids that end generation: ``<|im_end|>`` then ``<|endoftext|>``."""
    return [tok.convert_tokens_to_ids(t) for t in STOP_TOKENS]


def render_sample(tok, sample: dict) -> str:
    """Training text of one sample: chat template for ``messages`` samples, raw text for prose.

    (The document separator ``<|endoftext|>`` is appended by the caller at the token level.)
    """
    if "messages" in sample:
        return tok.apply_chat_template(sample["messages"], tokenize=False)
    return sample["text"]


__all__ = [
    "EOS",
    "PAD",
    "IM_START",
    "IM_END",
    "MASK",
    "SPECIAL_TOKENS",
    "STOP_TOKENS",
    "CHAT_TEMPLATE",
    "train_tokenizer",
    "wrap_tokenizer",
    "stop_token_ids",
    "render_sample",
]
