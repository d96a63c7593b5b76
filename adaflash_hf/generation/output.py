"""What a speculative ``generate`` returns, built alike by the eager loop (:mod:`.decoding`) and the engine's fast
path (:mod:`.fast_path`): tokens committed where plain decoding would stop, the finished requests announced, and
``generate``'s output (sequences, scores, logits, hidden states as plain ``generate`` lays them out)."""

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..speculation.rounds import FinishedRequest

__all__ = ["Output", "emit_requests", "finish"]


@dataclass
class Output:
    """Commits tokens exactly where plain decoding would stop, and builds what generate returns."""

    stopping_criteria: object
    streamer: object
    want_scores: bool
    want_logits: bool
    want_hidden: bool
    finished: dict = field(default_factory=dict)
    scores: dict = field(default_factory=lambda: defaultdict(list))
    raw: dict = field(default_factory=lambda: defaultdict(list))
    hidden: dict = field(default_factory=lambda: defaultdict(list))
    committed: list = field(default_factory=list)  # tokens each row kept in the last commit

    @classmethod
    def for_config(cls, generation_config, stopping_criteria, streamer) -> "Output":
        dict_out = generation_config.return_dict_in_generate
        return cls(
            stopping_criteria,
            streamer,
            want_scores=dict_out and generation_config.output_scores,
            want_logits=dict_out and generation_config.output_logits,
            want_hidden=dict_out and generation_config.output_hidden_states,
        )

    def commit(self, batch, new_tokens, raw_logits, processed, hidden) -> torch.Tensor:
        """Append each row's new tokens one by one, checking the stopping criteria after each.

        `hidden[i][j]` is the per-layer hidden-state tuple of the step that made row `i`'s token
        `j` (None unless `want_hidden`).
        """
        done, self.committed = [], []
        for i, toks in enumerate(new_tokens):
            row, stop = int(batch.index[i]), False
            self.committed.append(len(toks))
            for j, tok in enumerate(toks):
                batch.seqs[i] = torch.cat([batch.seqs[i], tok[None]])
                if self.want_scores:
                    self.scores[row].append(processed[i][j])
                if self.want_logits:
                    self.raw[row].append(raw_logits[i][j])
                if self.want_hidden:
                    self.hidden[row].append(hidden[i][j])
                if self.streamer is not None:
                    self.streamer.put(tok[None].cpu())
                if bool(self.stopping_criteria(batch.seqs[i][None], None)[0]):
                    stop, self.committed[-1] = True, j + 1
                    break
            if stop:
                self.finished[row] = batch.seqs[i]
            done.append(stop)
        return torch.tensor(done, device=batch.valid.device)


def emit_requests(on_request, input_ids, prompt_mask, output: Output) -> None:
    """Every finished sequence, in row order: its prompt (padding removed) and its generated tokens."""
    for row, seq in sorted(output.finished.items()):
        prompt = input_ids[row] if prompt_mask is None else input_ids[row][prompt_mask[row].bool()]
        on_request(FinishedRequest(row=row, prompt_ids=prompt, output_ids=seq[input_ids.shape[1] :]))


def finish(input_ids, output: Output, generation_config, stats, return_stats):
    b, p = input_ids.shape
    seqs = [output.finished[i] for i in range(b)]
    width = max(s.shape[0] for s in seqs)
    pad = generation_config.pad_token_id if generation_config.pad_token_id is not None else 0
    sequences = torch.full((b, width), pad, dtype=input_ids.dtype, device=input_ids.device)
    for i, s in enumerate(seqs):
        sequences[i, : s.shape[0]] = s
    stats.new_tokens = sum(s.shape[0] - p for s in seqs)
    result = sequences
    if generation_config.return_dict_in_generate:

        def steps(per_row):
            """Per-step `[b, V]` tensors; rows that already stopped get -inf (plain generate pads them)."""
            if not per_row:
                return None
            filler = torch.full_like(next(iter(per_row.values()))[0], float("-inf"))
            return tuple(torch.stack([per_row[r][t] if t < len(per_row[r]) else filler for r in range(b)]) for t in range(width - p))

        hidden = hidden_steps(output.hidden, b, width - p) if output.want_hidden else None
        result = GenerateDecoderOnlyOutput(sequences=sequences, scores=steps(output.scores), logits=steps(output.raw), hidden_states=hidden)
    return (result, stats) if return_stats else result


def hidden_steps(per_row: dict, b: int, n_steps: int) -> tuple:
    """`hidden_states` as plain generate returns them: per step, per layer `[b, step_len, H]`.

    Step 0 holds the prompt positions (every row has it), later steps one position; rows that
    already stopped get zeros.
    """
    out = []
    for t in range(n_steps):
        live = next(per_row[r][t] for r in range(b) if t < len(per_row[r]))
        rows = [per_row[r][t] if t < len(per_row[r]) else tuple(torch.zeros_like(h) for h in live) for r in range(b)]
        out.append(tuple(torch.stack(layer) for layer in zip(*rows)))
    return tuple(out)
