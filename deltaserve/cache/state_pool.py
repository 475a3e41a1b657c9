"""StatePool: the fixed set of KDA state slots, one per running request; CPU bookkeeping only.

A slot holds a request's whole KDA state (the short-conv tails and the float32 recurrent state of every KDA
layer). Its size does not grow with the sequence, so a request takes one slot when admitted and returns it
when it finishes or is preempted. Slot ids are 0..num_slots-1; the runner zeroes a slot's state when a new
request (num_computed_tokens == 0) arrives in it."""

from __future__ import annotations

from collections import deque


class StatePool:
    """Free list of KDA state slots; allocate() hands out one id, free(slot) takes it back."""

    def __init__(self, num_slots: int):
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"StatePool num_slots = {num_slots!r}: must be a positive integer "
                             "(one slot per running request: max_num_seqs)")
        self.num_slots = num_slots
        self._free_slots: deque[int] = deque(range(num_slots))
        self._is_free = [True] * num_slots

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def allocate(self) -> int:
        """Take one free slot; raises if none is free (callers check num_free_slots first)."""
        if not self._free_slots:
            raise RuntimeError(f"StatePool.allocate: all {self.num_slots} KDA state slots are in use; "
                               "check num_free_slots before admitting a request")
        slot = self._free_slots.popleft()
        self._is_free[slot] = False
        return slot

    def free(self, slot: int) -> None:
        """Return a slot; it must be one this pool handed out and not yet freed."""
        if not (isinstance(slot, int) and 0 <= slot < self.num_slots):
            raise ValueError(f"StatePool.free: slot {slot!r} is not in [0, {self.num_slots}); "
                             "free only slots that this pool's allocate() returned")
        if self._is_free[slot]:
            raise ValueError(f"StatePool.free: slot {slot} is already free (double free); "
                             "a request's state_slot must be set to None when its slot is returned")
        self._is_free[slot] = True
        self._free_slots.append(slot)
