"""Slot pool bookkeeping: which expert sits in which slot of a layer, LRU eviction, hit counts.

The pool only decides; the MLX slot buffers live in the streaming MoE block. Keeping the policy
free of MLX makes it easy to test and to reuse for prefetch (a stager asks the same questions).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class PoolStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class LayerSlots:
    """A fixed number of slots for one layer; least recently used experts leave first."""

    def __init__(self, n_slots: int):
        if n_slots < 1:
            raise ValueError("a layer needs at least one slot")
        self.n_slots = n_slots
        self._slot_of: OrderedDict[int, int] = (
            OrderedDict()
        )  # expert -> slot, LRU first
        self._free = list(range(n_slots - 1, -1, -1))
        self.stats = PoolStats()

    def slot_of(self, expert: int) -> int | None:
        return self._slot_of.get(expert)

    @property
    def resident_experts(self) -> list[int]:
        return list(self._slot_of)

    def assign(
        self, experts: list[int]
    ) -> tuple[dict[int, int], list[tuple[int, int]]]:
        """Make every expert in `experts` (distinct, at most n_slots) resident.

        Returns (expert -> slot for all of them, [(expert, slot) that must be loaded]). Experts
        already resident keep their slot (sticky), so only changed slots are written.
        """
        if len(experts) > self.n_slots:
            raise ValueError(
                f"{len(experts)} experts requested but the layer has "
                f"{self.n_slots} slots"
            )
        wanted = set(experts)
        mapping, loads = {}, []
        for e in experts:
            slot = self._slot_of.get(e)
            if slot is not None:
                self._slot_of.move_to_end(e)
                mapping[e] = slot
                self.stats.hits += 1
        for e in experts:
            if e in mapping:
                continue
            self.stats.misses += 1
            if self._free:
                slot = self._free.pop()
            else:
                victim = next(v for v in self._slot_of if v not in wanted)
                slot = self._slot_of.pop(victim)
                self.stats.evictions += 1
            self._slot_of[e] = slot
            mapping[e] = slot
            loads.append((e, slot))
        return mapping, loads

    def move(self, slot_of: dict[int, int]) -> None:
        """Re-seat resident experts among their own slots (a permutation; LRU order kept)."""
        if sorted(self._slot_of[e] for e in slot_of) != sorted(slot_of.values()):
            raise ValueError("move must permute the slots the experts already hold")
        for e, slot in slot_of.items():
            self._slot_of[e] = slot

    def resize(self, n_slots: int) -> list[int]:
        """Hold `n_slots` slots (batched decode holds a layer's union while it runs).

        Growing adds free slots at the end; shrinking forgets the experts in the slots that go.
        Other residents keep their slots, so the slot buffers only gain or lose rows at the
        end. Returns the experts forgotten.
        """
        if n_slots < 1:
            raise ValueError("a layer needs at least one slot")
        gone = [e for e, slot in self._slot_of.items() if slot >= n_slots]
        for e in gone:
            del self._slot_of[e]
        self._free = [s for s in self._free if s < n_slots]
        if n_slots > self.n_slots:
            self._free = list(range(n_slots - 1, self.n_slots - 1, -1)) + self._free
        self.n_slots = n_slots
        return gone

    def forget(self, expert: int) -> None:
        """Drop an expert whose load failed, so its slot is not trusted."""
        slot = self._slot_of.pop(expert, None)
        if slot is not None:
            self._free.append(slot)


def slots_for_budget(budget_mib: float, slot_bytes: int) -> int:
    """Slots per layer that fit `budget_mib` of expert buffers across all MoE layers, where a
    slot in every layer costs `slot_bytes` (layers' bundles may differ in size)."""
    return int(budget_mib * 2**20 // slot_bytes)
