"""A preallocated, slotted KV cache: one fixed-size row of K/V per request slot.

Every slot holds up to ``max_len`` positions for every layer. A request owns one slot from
admission to its end; its cache *length* says how many positions are valid. Writing K/V never
changes the length: the engine writes a verify block at ``length .. length + q - 1``, then
:meth:`advance` counts only the accepted tokens. Rejected tokens are simply not counted and are
overwritten by the next write (rollback is free).

``spare_slots`` adds storage rows past ``num_slots`` that are never handed out: the CUDA-graph
decode path (:mod:`.graphs`) sends its padding tokens there, so padding never touches a request.
"""

from __future__ import annotations

import torch

__all__ = ["SlotKVCache"]


class SlotKVCache:
    """K/V storage ``[num_layers, num_slots + spare_slots, kv_heads, max_len, head_dim]`` with per-slot lengths.

    Example:
        >>> cache = SlotKVCache(2, 4, 16, kv_heads=1, head_dim=8)
        >>> s = cache.alloc(); cache.num_free
        3
        >>> cache.advance(s, 5); cache.length(s)
        5
        >>> cache.free(s); cache.num_free, cache.length(s)
        (4, 0)
    """

    def __init__(self, num_layers: int, num_slots: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None, spare_slots: int = 0):
        if min(num_layers, num_slots, max_len, kv_heads, head_dim) < 1 or spare_slots < 0:
            raise ValueError("SlotKVCache dimensions must all be >= 1 (spare_slots >= 0)")
        self.num_layers, self.num_slots, self.max_len = num_layers, num_slots, max_len
        self.kv_heads, self.head_dim, self.spare_slots = kv_heads, head_dim, spare_slots
        shape = (num_layers, num_slots + spare_slots, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = [0] * num_slots  # host-side: the scheduler reads them every round
        self._free = list(range(num_slots - 1, -1, -1))  # a stack; alloc pops the lowest slot
        self._used: set[int] = set()

    # ------------------------------------------------------------------ slots
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def used_slots(self) -> list[int]:
        return sorted(self._used)

    def alloc(self, slot: int | None = None) -> int:
        """Take a free slot (the lowest, or ``slot`` if given), length 0; ``RuntimeError`` when none is left."""
        if not self._free:
            raise RuntimeError(f"no free KV slot (all {self.num_slots} in use)")
        if slot is None:
            slot = self._free.pop()
        elif slot in self._free:
            self._free.remove(slot)
        else:
            raise RuntimeError(f"KV slot {slot} is not free")
        self._used.add(slot)
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        """Give a slot back; its length is reset (the stale K/V is never read again)."""
        if slot not in self._used:
            raise ValueError(f"slot {slot} is not allocated")
        self._used.remove(slot)
        self.lengths[slot] = 0
        self._free.append(slot)
        self._free.sort(reverse=True)

    # ------------------------------------------------------------------ lengths
    def length(self, slot: int) -> int:
        return self.lengths[slot]

    def advance(self, slot: int, n: int) -> None:
        """Count ``n`` more written positions of ``slot`` as valid (accept)."""
        new = self.lengths[slot] + n
        if n < 0 or new > self.max_len:
            raise ValueError(f"slot {slot}: cannot advance length {self.lengths[slot]} by {n} (max_len {self.max_len})")
        self.lengths[slot] = new

    def rollback(self, slot: int, length: int) -> None:
        """Shrink ``slot``'s valid length to ``length`` (drop the tail)."""
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"slot {slot}: cannot roll back length {self.lengths[slot]} to {length}")
        self.lengths[slot] = length

    # ------------------------------------------------------------------ data
    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Scatter per-token K/V (``[T, kv_heads, head_dim]``) to ``(slots[t], positions[t])``.

        Lengths are not touched: call :meth:`advance` for what is accepted.
        """
        if positions.numel() and int(positions.max()) >= self.max_len:
            raise ValueError(f"write past max_len {self.max_len}")
        self.k[layer, slots, :, positions] = k.to(self.k.dtype)
        self.v[layer, slots, :, positions] = v.to(self.v.dtype)

    def read(self, layer: int, slot: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of ``slot``'s first ``length`` positions, ``[kv_heads, length, head_dim]`` each (views)."""
        return self.k[layer, slot, :, :length], self.v[layer, slot, :, :length]

    def memory_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()
