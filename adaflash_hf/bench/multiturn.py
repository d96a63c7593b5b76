"""Multi-turn sets (MT-bench) as Spec-Bench runs them: every turn benchmarked, each later turn's prompt the
conversation so far with the target's own greedy answers.

Turn 1 is an ordinary set (label ``mt_bench``). For turn ``t > 1`` the prompt of each conversation that has a
``t``-th user turn is ``[user 1, assistant answer 1, ..., user t]`` through the chat template, where every
assistant answer is the target's greedy answer to the turn before (as Spec-Bench generates it; it does not
depend on the method, so every method sees the same turn-``t`` prompts). Turn ``t`` is then benchmarked like
any set, under the label ``<label>:turn<t>`` (`turn_label`); the report pools a set's turns
(`.summary`). The greedy answers are plain's rows of the turn's first concurrency when the run is greedy
(plain is the reference there), else one untimed greedy plain pass (`greedy_answers`).

Example:
    >>> next_turn([{"role": "user", "content": "Hi"}], "Hello!", "And then?")[1:]
    [{'role': 'assistant', 'content': 'Hello!'}, {'role': 'user', 'content': 'And then?'}]
"""

from __future__ import annotations

import dataclasses

from ..generation.prompts import left_pad

__all__ = ["base_label", "greedy_answers", "next_turn", "turn_label", "turn_prompts"]

_TURN = ":turn"


def turn_label(label: str, turn: int) -> str:
    """The label of turn ``turn`` of a set: the set's own for turn 1, ``<label>:turn<t>`` after."""
    return label if turn == 1 else f"{label}{_TURN}{turn}"


def base_label(label: str) -> tuple[str, int]:
    """(set label, turn) of a cell's dataset label, the inverse of `turn_label`."""
    head, sep, tail = label.rpartition(_TURN)
    return (head, int(tail)) if sep and tail.isdigit() else (label, 1)


def next_turn(conversation: list[dict], answer: str, user: str) -> list[dict]:
    """The conversation with the assistant's ``answer`` and the next ``user`` turn appended."""
    return [*conversation, {"role": "assistant", "content": answer}, {"role": "user", "content": user}]


def turn_prompts(conversations: dict[int, list[dict]], later_turns: list[list[str]], answers: dict[int, str],
                 turn: int) -> dict[int, list[dict]]:  # fmt: skip
    """Turn ``turn``'s prompts (prompt index -> messages) of the conversations that have that user turn."""
    if any(isinstance(c, str) for c in conversations.values()):
        raise ValueError("a multi-turn set needs chat prompts (message lists), not continuation text")
    return {i: next_turn(conv, answers[i], later_turns[i][turn - 2])
            for i, conv in conversations.items() if len(later_turns[i]) >= turn - 1}  # fmt: skip


def greedy_answers(run, prompts: list[list[int]], reference) -> list[str]:
    """The target's greedy answers (decoded text, special tokens dropped) to encoded ``prompts``: from
    ``reference`` (plain's greedy rows of those prompts) when given, else an untimed greedy plain pass."""
    from .methods import METHODS
    from .timing import run_batch

    ctx, config = run.ctx, run.config
    if reference is None:
        greedy = dict(ctx.generate_kwargs, do_sample=False, temperature=None, top_p=None, top_k=None)
        gctx = dataclasses.replace(ctx, generate_kwargs=greedy)
        conc = max(config.concurrency)
        reference = []
        for i in range(0, len(prompts), conc):
            ids, mask = left_pad(prompts[i : i + conc], run.pad_id, ctx.device)
            reference += run_batch(METHODS["plain"], gctx, ids, mask, run.eos_ids, config.seed, run.on_cuda)[1]
    return [ctx.tokenizer.decode(row, skip_special_tokens=True).strip() for row in reference]
