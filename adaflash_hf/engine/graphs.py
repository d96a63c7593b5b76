"""The decode-time target forward at fixed shapes, captured as one CUDA graph per bucket.

A verify round (or an ``off``-mode decode step) sends ``T = sum_i q_i`` tokens of ``R`` running
requests. Its graph key is ``(T_b, q_b, R_b)``: ``T_b`` the smallest token bucket ``>= T`` (linear
layers run on ``T_b`` packed rows), ``q_b`` the smallest per-request bucket ``>= max_i q_i`` and
``R_b`` the power-of-two bucket of the highest slot in use + 1 (attention runs on
``[R_b + 1, heads, q_b, d]`` over the first ``R_b + 1`` cache rows, see :mod:`.kernels.attention`: idle
slots past ``R_b`` cost nothing). Padding stays packed (``T_b - T`` extra rows, not ``R * q_b``), so
``packed`` verification keeps its ``sum_i k_hat_i`` cost.

Everything the forward reads lives in static buffers (token ids, positions, cache slots, rows
within a request's query block, each slot's ``start``); :meth:`DecodeGraphs.prepare` fills them
with non-blocking host-to-device copies (pinned memory: no stream sync), the graph replays, and logits / hidden states land in static
output buffers. Inside the forward there is no host synchronisation: K/V are stored with
``index_put_`` on the cache tensors and attention reads each slot's start from the device.

Padding tokens are lossless by construction: they write K/V into the cache's spare slot row
(never handed to a request), their queries sit in row ``R_b`` (masked out entirely, no request of
the forward uses it; the spare row when ``R_b`` is the slot count), and each
token's logits depend only on its own row of every matmul and on its own slot's keys. Their
outputs are never returned.

All graphs share one memory pool (they replay one at a time) and the same input / output
buffers, so a new bucket costs a capture (~two eager forwards), not more memory. Buckets are
captured lazily on first use (:attr:`DecodeGraphs.capture_seconds` says how long that took) or
ahead of time with :meth:`DecodeGraphs.precapture`. Without CUDA (``use_graphs=False``) the same
static, padded forward runs eagerly with SDPA: the CPU tests check it against the eager path.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter

import numpy as np
import torch

from .kernels.attention import BACKENDS, INACTIVE, SlotAttention, default_backend
from ..speculation.capture import CAPTURE_MODE, capturing
from .kernels.elementwise import SlotStore
from .kernels.fused import FusedTarget
from .kv_cache import SlotKVCache
from .target import PackedLayout, decoder_forward, repeat

__all__ = ["DecodeGraphs", "GraphRunner", "copy_to_device", "pick_bucket", "q_buckets", "to_device", "token_buckets"]


def token_buckets(max_tokens: int) -> list[int]:
    """1, 2, 4, 8, then four steps per doubling (10, 12, 14, 16, 20, 24, 28, 32, ...), capped by
    ``max_tokens`` (always the last bucket): at most 25% padding above 8 tokens, ~4 graphs per octave."""
    out, n = [], 1
    while n < 8 and n < max_tokens:
        out.append(n)
        n *= 2
    step = 2
    while n < max_tokens:
        out.append(n)
        if n >= 8 * step:
            step *= 2
        n += step
    return out + [max_tokens]


def q_buckets(max_q: int) -> list[int]:
    """Powers of two below ``max_q``, then ``max_q`` (the drafter block size)."""
    out, n = [], 1
    while n < max_q:
        out.append(n)
        n *= 2
    return out + [max_q]


def copy_to_device(dst: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(host)`` without a stream synchronisation on CUDA: a plain copy from pageable host
    memory waits for all queued device work (``memcpy_and_sync``); a pinned, non-blocking one is just
    queued (the pinned block is kept until the copy has run)."""
    if dst.is_cuda:
        return dst.copy_(host.pin_memory(), non_blocking=True)
    return dst.copy_(host)


def to_device(host: torch.Tensor, device) -> torch.Tensor:
    """``host.to(device)``, queued without a stream synchronisation on CUDA (see :func:`copy_to_device`)."""
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def arrays_to_device(arrays: dict[str, np.ndarray], dtype, device) -> dict[str, torch.Tensor]:
    """Named host arrays on ``device`` as ``dtype``, in one host-to-device copy (:func:`to_device`; none when
    ``arrays`` is empty).

    Example:
        >>> {k: v.tolist() for k, v in arrays_to_device({"a": np.arange(2), "b": np.arange(1)}, np.int64, "cpu").items()}
        {'a': [0, 1], 'b': [0]}
    """
    if not arrays:
        return {}
    host = torch.from_numpy(np.concatenate([a.astype(dtype, copy=False) for a in arrays.values()]))
    return dict(zip(arrays, to_device(host, device).split([len(a) for a in arrays.values()])))


def pick_bucket(buckets: list[int], n: int) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")



def _flag_non_finite(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``tokens`` with ``-1`` in every row whose logits are not all finite: greedy decoding reads the flag
    in the same device read as the tokens, so a NaN row fails its request instead of emitting argmax 0."""
    return torch.where(torch.isfinite(logits).all(dim=-1), tokens, torch.full_like(tokens, -1))

class GraphRunner:
    """What every static-shape runner shares: lazily captured CUDA graphs per bucket (one memory pool),
    replay counts, the attention backend fallback (triton -> flex -> SDPA). Subclasses own the static inputs / outputs and define
    ``_forward(*bucket)`` (device ops only) and ``_reset_inputs()`` (inputs touching spare rows only)."""

    attention: SlotAttention

    def _init_graphs(self, cache: SlotKVCache, use_graphs: bool | None) -> bool:
        """Check ``cache`` (a spare padding row; CUDA when graphs are asked for) and set up the graph
        store; ``use_graphs=None`` means "on CUDA". Returns whether graphs are used."""
        name = type(self).__name__
        if cache.spare_slots < 1:
            raise ValueError(f"{name} needs a cache with a spare slot row for padding (spare_slots=1)")
        on_cuda = cache.k.device.type == "cuda"
        use_graphs = on_cuda if use_graphs is None else use_graphs
        if use_graphs and not on_cuda:
            raise ValueError(f"CUDA graphs need {name}'s cache (and model) on a CUDA device")
        self.use_graphs = use_graphs
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.capture_seconds = 0.0
        self.replays: Counter = Counter()
        self.attention_note = ""
        return use_graphs

    def _forward(self, *bucket) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _reset_inputs(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _input_state(self) -> tuple:
        """What a forward may change of its own inputs (``_restore_inputs`` puts it back; default: nothing)."""
        return ()

    def _restore_inputs(self, state: tuple) -> None:
        pass

    def _capture(self, bucket: tuple) -> torch.cuda.CUDAGraph:
        t0 = time.perf_counter()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        # Warm-up (compiles attention for a new q bucket). It runs on the current inputs: the K/V it writes
        # are the ones the replay writes again, so capturing in the middle of a round is harmless.
        state = self._input_state()  # a forward that advances its own inputs (a greedy step) is undone after each run
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(*bucket)
                self._restore_inputs(state)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with capturing():  # neither other threads' CUDA work nor a garbage collection may invalidate it (speculation/capture.py)
            try:
                with torch.cuda.graph(graph, pool=self.pool, capture_error_mode=CAPTURE_MODE):
                    self._forward(*bucket)
            except BaseException:
                # A capture that fails can leave its pool marked as recording, and every later capture into it then
                # fails with "beginAllocateToPool: already recording":
                # later captures, the fallback's included, take a fresh pool.
                self.pool = torch.cuda.graph_pool_handle()
                raise
            self._restore_inputs(state)
            torch.cuda.synchronize()
        self.graphs[bucket] = graph
        self.capture_seconds += time.perf_counter() - t0
        return graph

    def _capture_or_fall_back(self, bucket: tuple) -> torch.cuda.CUDAGraph:
        try:
            return self._capture(bucket)
        except Exception as exc:  # noqa: BLE001 - any kernel or compile failure: keep serving with the next backend
            failed = self.attention.backend
            if failed == BACKENDS[-1]:
                raise
            torch.cuda.synchronize()
            self.attention.backend = BACKENDS[BACKENDS.index(failed) + 1]
            self.attention_note = (self.attention_note + "; " if self.attention_note else "") + (
                f"{failed} attention failed ({type(exc).__name__}: {str(exc)[:300]}); using {self.attention.backend}")
            warnings.warn(self.attention_note, RuntimeWarning, stacklevel=3)
            self.graphs.clear()  # recapture earlier buckets too: one backend per runner keeps timings comparable
            return self._capture_or_fall_back(bucket)

    def replay(self, bucket: tuple) -> None:
        """Run the forward for the prepared inputs (capturing the bucket's graph on first use)."""
        self.replays[bucket] += 1
        if not self.use_graphs:
            with torch.no_grad():
                self._forward(*bucket)
            return
        graph = self.graphs.get(bucket)
        if graph is None:
            graph = self._capture_or_fall_back(bucket)
        graph.replay()

    def precapture(self, buckets) -> None:
        """Capture ``buckets`` now, on inputs that only touch the spare row. Before serving (or while no
        request is running): the warm-up overwrites the static outputs, and the engine reads the last
        forward's features from them at the start of the next round."""
        if not self.use_graphs:
            return
        for bucket in buckets:
            if tuple(bucket) not in self.graphs:
                self._reset_inputs()
                self._capture_or_fall_back(tuple(bucket))


class DecodeGraphs(GraphRunner):
    """Static-shape decode forwards of ``model`` over ``cache``, one CUDA graph per bucket.

    Args:
        model: the target (Qwen3 / Llama ``*ForCausalLM``).
        cache: its :class:`SlotKVCache`, with at least one spare slot row (padding goes there).
        hidden_layers: decoder layers whose outputs the drafter needs (or ``None``).
        max_tokens: most tokens one decode forward carries (the largest token bucket).
        max_q: most tokens one request sends (the drafter block size; 1 for plain decoding).
        use_graphs: capture and replay CUDA graphs (default: on CUDA). Off, the same static forward
            runs eagerly.
        max_steps: most greedy decode steps one :meth:`run_greedy` call may run (1: none).
        kept_tokens: with hidden layers, the feature rows :meth:`run_greedy` keeps in :attr:`step_hidden` across
            calls (its ``offset``): a step of ``n`` requests takes a bucket of ``n`` rows, so few requests keep
            many steps (:meth:`kept_steps`; default: ``max_steps`` steps of every slot).
        fused: run the layers through this :class:`~.kernels.fused.FusedTarget` of ``model`` (default: the
            HF modules).
        attention: one of :data:`~.kernels.attention.BACKENDS` (default: :func:`~.kernels.attention.default_backend`). If
            a backend fails to compile or run, the runner warns and falls back to the next one
            (see :attr:`attention_note`).
    """

    def __init__(self, model, cache: SlotKVCache, hidden_layers: list[int] | None, max_tokens: int, max_q: int,
                 use_graphs: bool | None = None, attention: str | None = None, fused: FusedTarget | None = None,
                 max_steps: int = 1, kept_tokens: int | None = None):
        device = cache.k.device
        use_graphs = self._init_graphs(cache, use_graphs)
        self.model, self.cache, self.hidden_layers = model, cache, list(hidden_layers) if hidden_layers else None
        self.fused = fused
        self.token_buckets, self.q_buckets = token_buckets(max_tokens), q_buckets(max_q)
        self.row_buckets = q_buckets(cache.num_slots)  # attention runs over slot rows 0 .. R_b (R_b: the padding row)
        self.scratch = cache.num_slots  # the first spare row
        self.slot_rows = cache.k.shape[1]
        self.attention = SlotAttention(self.slot_rows, cache.max_len, device, attention or default_backend(device))
        T = self.token_buckets[-1]
        # rows: token ids, positions, cache slots (K/V), row within the request's query block, query slot row, the
        # request (its index in the layout; padding: the last verdict bin)
        self.inputs = torch.zeros(6, T, dtype=torch.long, device=device)
        self.inputs[2] = self.scratch
        # Greedy acceptance inside the replay (`run(..., accept=)`): each request's verified draft length in, and out
        # one buffer read whole: accepted counts, next tokens, fault flags, draft lengths (one bin per request and
        # a last one for padding), then the forward's input tokens (the drafts among them).
        self.requests = cache.num_slots + 1
        self.verify_len = torch.zeros(self.requests, dtype=torch.long, device=device)
        self.verdict = torch.zeros(4 * self.requests + T, dtype=torch.long, device=device)
        param = next(model.parameters())
        vocab = model.get_output_embeddings().weight.shape[0]
        self.logits = torch.zeros(T, vocab, dtype=param.dtype, device=device)
        hsize = model.config.get_text_config(decoder=True).hidden_size
        self.hidden = torch.zeros(T, len(self.hidden_layers) * hsize, dtype=param.dtype, device=device) if self.hidden_layers else None
        self.max_steps = max_steps
        self._q_out: dict[tuple[int, int], torch.Tensor] = {}
        self._layer_ids = torch.arange(cache.num_layers, device=device)
        # run_greedy's output, flat: a call of bucket Tb writes its [max_steps, Tb] view (:meth:`_step_token_rows`), so
        # its one device read is of contiguous memory
        self.step_tokens = torch.zeros(max_steps * T, dtype=torch.long, device=device)
        # The next greedy step's rows, advanced together (one kernel a step): ``step_index`` of step_tokens,
        # ``kept_index`` of the kept features (below)
        self.step_rows = torch.zeros(2, dtype=torch.long, device=device)
        self.step_index, self.kept_index = self.step_rows[:1], self.step_rows[1:]
        # With hidden layers, each step's features (the drafting engine's plain stretches store them as the drafter's
        # context), one flat buffer: a step of bucket Tb writes Tb rows at row ``kept_index`` of its [K // Tb, Tb]
        # view (:meth:`_kept_rows`), so one request keeps K steps where a full batch keeps K / slots.
        rows = pick_bucket(self.token_buckets, min(cache.num_slots, T))  # the most rows a step writes
        K = -(-max(kept_tokens or 0, rows * max_steps) // rows) * rows
        self.step_hidden = (torch.zeros(K, self.hidden.shape[1], dtype=param.dtype, device=device)
                            if self.hidden is not None and max_steps > 1 else None)
        self.padded_tokens = 0

    # ------------------------------------------------------------------ buckets and inputs
    def bucket(self, num_tokens: int, max_q: int) -> tuple[int, int]:
        return pick_bucket(self.token_buckets, num_tokens), pick_bucket(self.q_buckets, max_q)

    def prepare(self, tokens, layout: PackedLayout) -> tuple[int, int, int]:
        """Fill the static inputs for ``layout`` (decode segments only); returns the graph's key
        ``(T_b, q_b, R_b)``: ``R_b`` the power-of-two bucket of the highest slot in use + 1. Attention
        runs over slot rows ``0 .. R_b`` only (row ``R_b``, unused by the forward's requests and fully
        masked, takes the padding queries): idle slots past ``R_b`` cost nothing."""
        T = layout.num_tokens
        Tb, qb = self.bucket(T, max(layout.q_lens))
        Rb = pick_bucket(self.row_buckets, max(layout.slots) + 1)
        # The indices are built in numpy (a few microseconds each; torch's CPU ops cost more per call).
        pad = np.arange(Tb - T) % qb  # padding: scratch slot, distinct rows / positions where they fit
        host = np.empty((6, Tb), dtype=np.int64)
        host[0, :T] = tokens.cpu().numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens, dtype=np.int64)
        host[0, T:] = 0
        rows = layout.rows()
        host[1, :T] = layout.host_positions(rows)
        host[1, T:] = pad
        host[2, :T] = repeat(layout.slots, layout.q_lens)
        host[2, T:] = self.scratch
        host[3, :T] = rows
        host[3, T:] = pad
        host[4, :T] = host[2, :T]
        host[4, T:] = Rb
        host[5, :T] = repeat(np.arange(len(layout.q_lens)), layout.q_lens)
        host[5, T:] = self.requests - 1
        start = np.full(self.slot_rows, INACTIVE, dtype=np.int32)
        start[list(layout.slots)] = layout.prefix_lens
        if max(p + q for p, q in zip(layout.prefix_lens, layout.q_lens)) > self.cache.max_len:
            raise ValueError(f"write past max_len {self.cache.max_len}")
        copy_to_device(self.inputs[:, :Tb], torch.from_numpy(host))
        copy_to_device(self.attention.start, torch.from_numpy(start))
        self.padded_tokens += Tb - T
        return Tb, qb, Rb

    def _reset_inputs(self) -> None:
        """Inputs that write nothing but the scratch row (for captures ahead of use)."""
        self.inputs.zero_()
        self.inputs[2] = self.scratch
        self.inputs[5] = self.requests - 1
        self.attention.start.fill_(INACTIVE)

    # ------------------------------------------------------------------ the forward
    @torch.no_grad()  # also when replay / precapture are called directly: flex's backward needs more of the mask
    def _forward(self, Tb: int, qb: int, Rb: int | None = None, greedy: str | None = None) -> None:
        # greedy: None (the forward), "accept" (the forward, then greedy acceptance: run's accept) or "greedy" (a step)
        if greedy is None or greedy == "accept":
            logits, _ = self._forward_once(Tb, qb, Rb)
            if greedy == "accept":
                self._accept(logits, Tb)
            return
        # One greedy decode step that sets up the next (run_greedy replays it back to back): its argmax
        # is the next step's input token, one position later (the slot's ``start`` too), and goes to row
        # ``step_index`` of ``step_tokens``.
        tokens, positions = self.inputs[0, :Tb], self.inputs[1, :Tb]
        logits, hidden = self._forward_once(Tb, qb, Rb, keep=False)
        if self.step_hidden is not None:
            self._kept_rows(Tb).index_copy_(0, self.kept_index, hidden[None])
        nxt = logits.argmax(dim=-1)
        self._step_token_rows(Tb).index_copy_(0, self.step_index, _flag_non_finite(logits, nxt)[None])
        tokens.copy_(nxt)  # a valid id even for a flagged row: the next step must not index the embedding with -1
        positions.add_(1)
        self.attention.start.add_(1)  # INACTIVE rows stay far below every key position
        self.step_rows.add_(1)

    def _accept(self, logits: torch.Tensor, Tb: int) -> None:
        """Greedy acceptance of every request of the forward, on the packed rows (static shapes: it is captured with
        the forward): a request accepts its leading drafts equal to the argmax of the row before them, within its
        ``verify_len``; its next token is the argmax of the row after its last accepted draft; its fault flag says
        one of its rows is not finite. Results go to :attr:`verdict`."""
        tokens, rows, req = self.inputs[0, :Tb], self.inputs[3, :Tb], self.inputs[5, :Tb]
        top = logits.argmax(dim=-1)
        # a row stops the run of accepted drafts where the next input token (the request's next draft) is not the
        # row's argmax, or where no draft follows it within the verify length
        stop = ((top != tokens.roll(-1)) | (rows >= self.verify_len[req])).long()
        ends = stop.cumsum(0)
        first = torch.arange(Tb, device=rows.device) - rows  # each token's request's first row (padding: within Tb)
        run = (ends - (ends - stop)[first] == 0).long()  # no stop from the request's first row to this one
        bins = self.requests
        accepted = self.verify_len.new_zeros(bins).index_add_(0, req, run)
        nxt = self.verify_len.new_zeros(bins).index_add_(0, req, torch.where(rows == accepted[req], top, 0))
        bad = self.verify_len.new_zeros(bins).index_add_(0, req, (~torch.isfinite(logits).all(dim=-1)).long()).clamp(max=1)
        self.verdict[: 4 * bins + Tb].copy_(torch.cat([accepted, nxt, bad, self.verify_len, tokens]))

    def _input_state(self) -> tuple:
        return self.inputs.clone(), self.attention.start.clone(), self.step_rows.clone()

    def _restore_inputs(self, state: tuple) -> None:
        for buf, saved in zip((self.inputs, self.attention.start, self.step_rows), state):
            buf.copy_(saved)

    def _step_token_rows(self, Tb: int) -> torch.Tensor:
        """:attr:`step_tokens` as ``[max_steps, Tb]``: the next tokens of each greedy step of bucket ``Tb``."""
        return self.step_tokens[: self.max_steps * Tb].view(self.max_steps, Tb)

    # ------------------------------------------------------------------ kept features of greedy steps
    def _kept_rows(self, Tb: int) -> torch.Tensor:
        """:attr:`step_hidden` as ``[steps, Tb, F]``: the steps of bucket ``Tb`` it holds."""
        K = self.step_hidden.shape[0] // Tb
        return self.step_hidden[: K * Tb].view(K, Tb, -1)

    def kept_steps(self, num_requests: int) -> int:
        """How many greedy steps of ``num_requests`` requests :attr:`step_hidden` holds (``max_steps`` without it)."""
        if self.step_hidden is None:
            return self.max_steps
        return self.step_hidden.shape[0] // pick_bucket(self.token_buckets, num_requests)

    def kept_features(self, num_requests: int, steps: int) -> torch.Tensor:
        """The features the last ``steps`` kept steps of ``num_requests`` requests wrote: ``[steps, n, F]`` (a view)."""
        return self._kept_rows(pick_bucket(self.token_buckets, num_requests))[:steps, :num_requests]

    def keep_rows(self, num_requests: int, steps: int, rows: list[int]) -> None:
        """Narrow the kept features of ``steps`` steps of ``num_requests`` requests to ``rows`` (their indices, in the
        order of the next call's requests), laid out as :meth:`kept_features` of ``len(rows)`` requests: requests that
        ended leave the kept steps without a drafter store (one gather and one copy on the device)."""
        picked = self.kept_features(num_requests, steps).index_select(1, torch.tensor(rows, device=self.step_hidden.device))
        self.kept_features(len(rows), steps).copy_(picked)

    def _forward_once(self, Tb: int, qb: int, Rb: int | None, keep: bool = True):
        tokens, positions, slots, rows, qslots = self.inputs[:5, :Tb]
        A = (self.cache.num_slots if Rb is None else Rb) + 1  # slot rows attention runs over
        mask = self.attention.mask(qb, A)
        k_cache, v_cache = self.cache.k, self.cache.v

        # Queries in attention's layout: one buffer per (slot rows, q bucket), never cleared. Rows no token
        # writes hold earlier queries; attention rows are independent and those rows' outputs are dropped.
        q_out = self._q_out.get((A, qb))
        if q_out is None:
            cfg = self.model.config.get_text_config(decoder=True)
            q_out = self._q_out[(A, qb)] = k_cache.new_zeros(A, cfg.num_attention_heads, qb, k_cache.shape[-1])

        def attend(li, q, k, v, scaling):
            if k is not None:  # the HF modules' path: RoPE done, store here (the fused layers use slot_store)
                k_cache[li, slots, :, positions] = k.to(k_cache.dtype)
                v_cache[li, slots, :, positions] = v.to(v_cache.dtype)
                q_out[qslots, :, rows] = q.transpose(0, 1)
            out = self.attention(q_out, k_cache[li, :A], v_cache[li, :A], mask, scaling)
            return out if k is None else out[qslots, :, rows]  # the fused layers gather in o_proj

        attend.slot_store = lambda li: SlotStore(k_cache, v_cache, self._layer_ids[li : li + 1], slots, positions, q_out,
                                                 qslots, rows)

        logits, hidden = decoder_forward(self.model, tokens, positions, attend, self.hidden_layers, fused=self.fused)
        if keep:
            self.logits[:Tb].copy_(logits)
            if hidden is not None:
                self.hidden[:Tb].copy_(hidden)
        return logits, hidden

    @torch.no_grad()
    def run(self, tokens, layout: PackedLayout, copy: bool = True, fill=None, accept: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decode forward over ``layout``: ``(logits [T, V] float32, hidden [T, K*H] or None)``, fresh
        tensors (the static buffers are overwritten by the next replay). Cache lengths are not changed.
        ``copy=False``: views of the static buffers in the model dtype (no ``[T, V]`` float32 copy;
        valid until the next replay; the engine reads them before that). ``fill = (positions, token ids)``
        (device tensors): tokens that overwrite those of ``tokens`` on the device (the drafts, never read back).
        ``accept [n]`` (device, one per request of ``layout``: its draft length verified): greedy acceptance runs in the
        same replay, into :attr:`verdict` (:meth:`read_verdict` says what it holds); the logits are then only what
        the acceptance saw (nothing may change them before it)."""
        bucket = self.prepare(tokens, layout)
        if fill is not None:
            self.inputs[0].index_copy_(0, fill[0], fill[1])
        if accept is not None:
            self.verify_len[: accept.shape[0]].copy_(accept)
            bucket = bucket + ("accept",)
        self.replay(bucket)
        T = layout.num_tokens
        if not copy:
            return self.logits[:T], (self.hidden[:T] if self.hidden is not None else None)
        logits = self.logits[:T].to(torch.float32, copy=True)
        return logits, (self.hidden[:T].clone() if self.hidden is not None else None)

    def move_verify(self, tokens: torch.Tensor, positions: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor) -> None:
        """Point the inputs :meth:`prepare` laid out for ``len(starts)`` requests at new ``tokens`` and ``positions``
        (device, packed as laid out) and prefix lengths ``starts`` (device; slot rows ``slots``): the next verify of
        queued rounds (:mod:`.spec_rounds`), nothing read back."""
        T = tokens.shape[0]
        self.inputs[0, :T].copy_(tokens)
        self.inputs[1, :T].copy_(positions)
        self.attention.start.index_copy_(0, slots, starts.to(self.attention.start.dtype))

    def verdict_rows(self, num_tokens: int) -> torch.Tensor:
        """What :meth:`run`'s acceptance left to read, in one slice of :attr:`verdict` (``num_tokens``: the forward's):
        accepted counts, next tokens, fault flags, verified draft lengths (``requests`` each), then the input tokens."""
        return self.verdict[: 4 * self.requests + num_tokens]

    def read_verdict(self, host: list[int], q_lens: list[int]):
        """The host's view of :meth:`verdict_rows` read back (``host``), for the ``n = len(q_lens)`` requests:
        ``(accepted, next_tokens, bad, draft_len, drafts)``, lists of ``n`` (``drafts[i]``: the ``q_lens[i] - 1``
        tokens request ``i`` verified).

        Example:
            >>> acc, nxt, bad, dl, drafts = graphs.read_verdict(host, [3, 1])  # doctest: +SKIP
        """
        n, bins = len(q_lens), self.requests
        tokens, drafts, start = host[4 * bins :], [], 0
        for q in q_lens:
            drafts.append(tokens[start + 1 : start + q])
            start += q
        return host[:n], host[bins : bins + n], host[2 * bins : 2 * bins + n], host[3 * bins : 3 * bins + n], drafts

    @torch.no_grad()
    def run_greedy(self, tokens, layout: PackedLayout, steps: int, offset: int = 0) -> torch.Tensor:
        """``steps`` greedy plain-decoding steps of every request in ``layout`` (one token each), queued
        without a host synchronisation: ``[steps, T_b]`` next tokens on the device, request ``i``'s in column ``i``
        (``T_b``: the token bucket; the columns past ``T`` are padding; a contiguous view of a static buffer, valid until
        the next replay); ``-1`` where that step's logits were not finite. Step ``s`` feeds back step ``s - 1``'s argmax; each step writes its
        input token's K/V. With :attr:`step_hidden` (hidden layers and ``max_steps > 1``), step ``s``'s features are
        ``kept_features(T, offset + steps)[offset + s]``, the steps before ``offset`` left as earlier calls wrote them (a
        caller that keeps the features of several calls for the drafter gives each the next offset, up to
        :meth:`kept_steps`); without it,
        one step's are ``hidden[:T]``.
        Cache lengths are not changed (the caller advances them by what it keeps). Equal to ``steps``
        calls of :meth:`run` with the argmax fed back (``tests/test_engine_graphs.py``)."""
        room = self.kept_steps(layout.num_tokens)
        if not 1 <= steps <= self.max_steps or not 0 <= offset <= room - steps:
            raise ValueError(f"steps must be in [1, {self.max_steps}] and offset + steps at most {room}, "
                             f"got {steps} at {offset}")
        if max(layout.q_lens) != 1:
            raise ValueError("run_greedy decodes one token per request (plain decoding)")
        if max(p + steps for p in layout.prefix_lens) > self.cache.max_len:
            raise ValueError(f"write past max_len {self.cache.max_len}")
        bucket = self.prepare(tokens, layout)
        if self.step_hidden is None and steps == 1:  # the plain decode bucket (hidden states as run keeps them): no graph of its own
            self.replay(bucket)
            logits = self.logits[: layout.num_tokens]
            return _flag_non_finite(logits, logits.argmax(dim=-1))[None]
        # One graph per step, replayed back to back: a replay is launched while the previous one runs, so
        # only the first launch is exposed (one graph of all the steps took ~1 ms to launch per replay).
        self.step_rows.zero_()
        self.kept_index.fill_(offset)
        for _ in range(steps):
            self.replay(bucket + ("greedy",))
        return self._step_token_rows(bucket[0])[:steps]
