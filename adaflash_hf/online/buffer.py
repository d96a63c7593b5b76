"""The online adapter's replay buffer: served traffic waiting to be trained on, bounded twice.

Two kinds of sample. With ``sample_unit="request"`` (the default, as in the paper and the released
code) a sample is one finished request, :class:`RequestSample`: its token ids only, ``8 * T``
bytes (8 KB for T=1024); the worker recomputes the target's features and distributions for the
whole sequence and trains on many blocks of it. With ``sample_unit="round"`` a sample is one
verified round, :class:`Sample`, and this is what it stores and costs (``T`` context tokens,
``k`` = verify length, ``V`` the vocabulary, ``K`` target layers read by the drafter, ``H``
hidden size):

==========================  ===================================  ====================================
part                        size                                 Qwen3-8B, T=1024, k=16 (V=151936,
                                                                 K=5, H=4096)
==========================  ===================================  ====================================
token ids (always)          ``8 * (T + k)`` bytes                8 KB
target logits (default)     ``k * V * 2`` bytes (bf16, CPU)      4.9 MB
target features (optional)  ``T * K * H * 2`` bytes (bf16)       42 MB
==========================  ===================================  ====================================

* **Token ids** are always kept: the context before the bonus token, the bonus token and the
  verified drafts.
* **Target logits** are the supervision of OPD and come free with the verify forward
  (``store_target_logits=True``, kept in ``logits_dtype``, bf16 by default). With
  ``store_target_logits=False`` only ids are kept and the worker recomputes the logits in the
  same frozen-target forward that recomputes the features, so a sample costs a few KB.
* **Target features** (``K*H`` per context token) are what the drafter is conditioned on. They
  are large, so by default (``store_features=False``) they are *recomputed in the worker* with
  the frozen target every time a sample is trained on (``epochs`` times per update), which is
  what the released AdaFlash code does. With ``store_features=True`` the worker computes them
  once per sample and keeps them with the sample (for the next epochs); the cost above is
  reserved against ``max_bytes`` when the sample is added.

The buffer is bounded by ``max_samples`` *and* ``max_bytes``: adding a sample evicts the oldest
ones until both bounds hold (a sample that alone exceeds ``max_bytes`` is refused); evictions are
counted in ``dropped``. So when the worker trains slower than traffic arrives, the *oldest* samples go first
and the newest traffic is what the next update trains on; the online adapter logs these drops (at most one line a
minute, with their count). After an update the adapter also drops the samples it had left over when it took its
batch (``OnlineConfig.clear_after_update``: superseded by the update, also counted). All methods are thread-safe and O(1) amortised, so ``add`` can be called
from the generation loop without blocking it.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import torch

__all__ = ["ReplayBuffer", "RequestSample", "Sample", "estimate_sample_bytes"]

_ID_BYTES = torch.empty((), dtype=torch.long).element_size()


def estimate_sample_bytes(
    context_len: int,
    verify_len: int,
    vocab_size: int,
    feature_dim: int = 0,
    store_target_logits: bool = True,
    logits_dtype: torch.dtype = torch.bfloat16,
    store_features: bool = False,
    features_dtype: torch.dtype = torch.bfloat16,
) -> int:
    """Bytes one sample holds (see the module docstring's table).

    Example:
        >>> estimate_sample_bytes(1024, 16, 151936)  # ids + bf16 logits
        4870272
    """
    n = _ID_BYTES * (context_len + verify_len)
    if store_target_logits:
        n += verify_len * vocab_size * torch.empty((), dtype=logits_dtype).element_size()
    if store_features:
        n += context_len * feature_dim * torch.empty((), dtype=features_dtype).element_size()
    return int(n)


@dataclass
class Sample:
    """One verified round as the worker trains on it.

    ``target_logits[j]`` (``[verify_len, V]``) is the target's distribution predicting draft slot
    ``j + 1``; ``None`` when the worker recomputes it. ``features`` (``[1, T, K*H]``) are the target
    features of ``context_ids``, filled by the worker when ``store_features`` (or given up front).
    ``rollout_logits`` (``[B-1, V]``) are the target's distributions along its own greedy
    continuation of the bonus token, filled by the worker in ``label_mode="rollout"``.
    """

    context_ids: torch.Tensor
    bonus_token: int
    draft_tokens: torch.Tensor
    target_logits: torch.Tensor | None
    verify_len: int
    num_accepted: int
    domain: str | None = None
    features: torch.Tensor | None = None
    rollout_logits: torch.Tensor | None = None
    nbytes: int = 0

    @classmethod
    def from_round(
        cls,
        verified,
        store_target_logits: bool = True,
        logits_dtype: torch.dtype | None = torch.bfloat16,
        device: torch.device | str = "cpu",
        domain: str | None = None,
        reserve_feature_dim: int = 0,
        features: torch.Tensor | None = None,
    ) -> "Sample":
        """A sample from a `VerifiedRound` (copied to ``device``; logits cast to ``logits_dtype``)."""
        logits = None
        if store_target_logits:
            logits = verified.target_logits[: verified.verify_len].detach()
            if logits_dtype is not None:
                logits = logits.to(logits_dtype)
            logits = logits.to(device)
        ctx = verified.context_ids.detach().to(device=device, dtype=torch.long).reshape(-1)
        drafts = verified.draft_tokens[: max(verified.verify_len - 1, 0)].detach().to(device=device, dtype=torch.long).reshape(-1)
        sample = cls(
            context_ids=ctx,
            bonus_token=int(verified.bonus_token),
            draft_tokens=drafts,
            target_logits=logits,
            verify_len=int(verified.verify_len),
            num_accepted=int(verified.num_accepted),
            domain=domain,
            features=features,
        )
        n = _ID_BYTES * (ctx.numel() + drafts.numel() + 1)
        if logits is not None:
            n += logits.numel() * logits.element_size()
        if features is not None:
            n += features.numel() * features.element_size()
        elif reserve_feature_dim:
            n += ctx.numel() * reserve_feature_dim * 2  # bf16-sized reservation for worker-side features
        sample.nbytes = int(n)
        return sample


@dataclass
class RequestSample:
    """One finished request as the worker trains on it (``sample_unit="request"``, the paper's unit).

    Only token ids are kept (``8 * T`` bytes): the worker recomputes the target's features and
    distributions for the whole sequence in one frozen-target forward and trains on up to
    ``max_anchors`` blocks anchored in the response, as offline training does.

    ``served`` (``[r, 3]`` long: anchor, accepted, verify length) are the request's served rounds: the
    bonus token's position in ``input_ids``, the drafts the target really accepted and the slots it
    verified. The worker then anchors the blocks there and trains the length head on those real
    counts (censored where the verify length cut the block), in every sampling mode.
    """

    input_ids: torch.Tensor  # prompt + response, [T]
    prompt_len: int
    domain: str | None = None
    nbytes: int = 0
    served: torch.Tensor | None = None

    @classmethod
    def from_request(cls, finished, domain: str | None = None, served: list[tuple[int, int, int]] | None = None) -> "RequestSample":
        """A sample from a `FinishedRequest` (ids copied to the CPU) and its served rounds, if recorded."""
        prompt = finished.prompt_ids.detach().to("cpu", torch.long).reshape(-1)
        ids = torch.cat([prompt, finished.output_ids.detach().to("cpu", torch.long).reshape(-1)])
        rounds = torch.tensor(served, dtype=torch.long).reshape(-1, 3) if served else None
        nbytes = _ID_BYTES * (ids.numel() + (rounds.numel() if rounds is not None else 0))
        return cls(input_ids=ids, prompt_len=prompt.numel(), domain=domain, nbytes=nbytes, served=rounds)

    @property
    def response_len(self) -> int:
        return self.input_ids.numel() - self.prompt_len


class ReplayBuffer:
    """FIFO of samples bounded by count and bytes (module docstring). Thread-safe.

    Example:
        >>> buf = ReplayBuffer(max_samples=2, max_bytes=10**6)
        >>> for n in (10, 20, 30):
        ...     _ = buf.add(Sample(torch.zeros(1, dtype=torch.long), 0, torch.zeros(0), None, 1, 0, nbytes=n))
        >>> len(buf), buf.nbytes, buf.dropped
        (2, 50, 1)
    """

    def __init__(self, max_samples: int = 512, max_bytes: int = 1 << 30):
        if max_samples < 1:
            raise ValueError(f"max_samples must be >= 1, got {max_samples}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.max_samples = int(max_samples)
        self.max_bytes = int(max_bytes)
        self._items: deque[Sample] = deque()
        self._bytes = 0
        self._lock = threading.Lock()
        self.added = 0
        self.dropped = 0
        self._head = 0  # sequence number of the oldest item (items leave from the left only)

    def add(self, sample: Sample) -> int:
        """Append ``sample`` (evicting the oldest as needed); returns how many samples were dropped."""
        with self._lock:
            if sample.nbytes > self.max_bytes:
                self.dropped += 1
                return 1
            self._items.append(sample)
            self._bytes += sample.nbytes
            self.added += 1
            dropped = 0
            while len(self._items) > self.max_samples or self._bytes > self.max_bytes:
                old = self._items.popleft()
                self._bytes -= old.nbytes
                self._head += 1
                dropped += 1
            self.dropped += dropped
            return dropped

    def take(self, n: int) -> list[Sample]:
        """Remove and return up to ``n`` samples, oldest first."""
        with self._lock:
            out = []
            while self._items and len(out) < n:
                s = self._items.popleft()
                self._bytes -= s.nbytes
                self._head += 1
                out.append(s)
            return out

    def newest(self, n: int) -> list[Sample]:
        """Up to ``n`` of the newest samples, oldest first, left in the buffer."""
        with self._lock:
            return list(self._items)[-n:] if n > 0 else []

    def mark(self) -> int:
        """A position after every sample buffered so far (for :meth:`drop_before`)."""
        with self._lock:
            return self._head + len(self._items)

    def drop_before(self, mark: int) -> int:
        """Drop the samples buffered before :meth:`mark` returned ``mark`` (samples added later stay);
        counted in ``dropped``. Returns how many were dropped."""
        with self._lock:
            n = 0
            while self._items and self._head < mark:
                self._bytes -= self._items.popleft().nbytes
                self._head += 1
                n += 1
            self.dropped += n
            return n

    def clear(self) -> int:
        """Drop everything; returns how many samples were dropped."""
        with self._lock:
            n = len(self._items)
            self._items.clear()
            self._head += n
            self._bytes = 0
            return n

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return self._bytes
