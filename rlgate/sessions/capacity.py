"""Session admission: how many live sessions may start now.

Pure logic, no Ray. Used by :class:`rlgate.actors.capacity.CapacityActor`, which owns
the counters; kept apart so the rule is tested without a cluster.

The rule is AReaL's staleness bound. With batch size ``B``, maximum
off-policyness ``S`` and current policy version ``v``, every accepted
trajectory must be trainable by version ``v + S`` at the latest, so at most
``(S + v + 1) * B`` sessions may have been accepted or be running. ``S = 0`` is
synchronous RL: exactly ``B`` sessions per version.

Admission is by whole GRPO groups. The trainer only trains on complete groups
of ``group_size`` sessions of one ``task_id``, so when the first session of a
group starts, the whole group's slots are reserved (:class:`GroupReservations`);
its other sessions join without a new budget check. Admitting sessions one by
one would deadlock a synchronous run: the last sessions of a group could never
start, because the budget of this version went to other groups' first members.
A reservation whose sessions do not all come lapses after ``group_timeout_s``
(the trainer then trains on the partial group). Sessions that started before a
trainer attached took no reservation but belong to their groups all the same
(the trainer trains on them): a group they began reserves only its remaining
members.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class CapacityRule:
    """The admission settings; ``batch_size=None`` means no trainer is attached."""

    max_concurrent: int
    batch_size: int | None = None
    max_staleness: int = 0
    group_size: int = 1
    group_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1 (got {self.max_concurrent})")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None (got {self.batch_size})")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 (got {self.max_staleness})")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1 (got {self.group_size})")
        if self.group_timeout_s <= 0:
            raise ValueError(f"group_timeout_s must be > 0 (got {self.group_timeout_s})")

    def group_slots(self, group_size: int | None) -> int:
        """Slots a new group takes: its size, never more than a batch."""
        size = group_size or self.group_size
        return min(size, self.batch_size) if self.batch_size is not None else size


def free_slots(rule: CapacityRule, running: int, accepted: int, version: int, reserved: int = 0) -> int:
    """How many more sessions may start now, never below 0.

    ``min(max_concurrent - running, (S + v + 1) * B - accepted - running - reserved)``
    with a trainer attached, ``max_concurrent - running`` without one.
    ``running`` counts open sessions, ``accepted`` the accepted trajectories
    since the start, ``version`` the policy version the engines serve,
    ``reserved`` the slots held for sessions of groups already started.
    """
    for name, value in (("running", running), ("accepted", accepted), ("version", version), ("reserved", reserved)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0 (got {value})")
    free = rule.max_concurrent - running
    if rule.batch_size is not None:
        budget = (rule.max_staleness + version + 1) * rule.batch_size
        free = min(free, budget - accepted - running - reserved)
    return max(free, 0)


@dataclass
class GroupReservations:
    """Slots held for the sessions still to come of groups already started, by ``task_id``."""

    pending: dict[str, tuple[int, float]] = field(default_factory=dict)  # task -> (sessions to come, opened at)
    early: dict[str, int] = field(default_factory=dict)  # task -> sessions started before a trainer attached
    early_limit: int = 10_000  # tasks remembered; the oldest are forgotten first

    def held(self) -> int:
        return sum(left for left, _ in self.pending.values())

    def joins(self, task_id: str | None) -> bool:
        return task_id is not None and task_id in self.pending

    def started_early(self, task_id: str) -> None:
        """A session of ``task_id`` started while no trainer was attached (so reserved nothing)."""
        self.early[task_id] = self.early.pop(task_id, 0) + 1
        if len(self.early) > self.early_limit:
            del self.early[next(iter(self.early))]

    def needed(self, task_id: str | None, slots: int) -> int:
        """Slots a new group of ``task_id`` of ``slots`` sessions takes: fewer by the
        members that started before a trainer attached."""
        return slots - self.early.get(task_id, 0) % slots if task_id is not None else slots

    def open(self, task_id: str, slots: int, now: float) -> None:
        """A new group of ``slots`` sessions has a session starting: hold the rest."""
        left = self.needed(task_id, slots) - 1
        self.early.pop(task_id, None)
        if left > 0:
            self.pending[task_id] = (left, now)

    def join(self, task_id: str) -> None:
        left, opened = self.pending[task_id]
        if left > 1:
            self.pending[task_id] = (left - 1, opened)
        else:
            del self.pending[task_id]

    def expire(self, now: float, timeout_s: float) -> int:
        """Let go of reservations older than ``timeout_s``; how many slots that freed."""
        lapsed = [task for task, (_, opened) in self.pending.items() if now - opened >= timeout_s]
        return sum(self.pending.pop(task)[0] for task in lapsed)


@dataclass
class CapacityStats:
    """A snapshot of the admission state; ``dataclasses.asdict`` makes it JSON."""

    running: int
    accepted: int
    discarded: int
    rejected: int
    version: int
    max_concurrent: int
    batch_size: int | None
    max_staleness: int
    group_size: int
    reserved: int
    free: int
