"""Session admission: how many live sessions may start now.

Pure logic, no Ray. Used by :class:`actors.capacity.CapacityActor`, which owns
the counters; kept apart so the rule is tested without a cluster.

The rule is AReaL's staleness bound. With batch size ``B``, maximum
off-policyness ``S`` and current policy version ``v``, every accepted
trajectory must be trainable by version ``v + S`` at the latest, so at most
``(S + v + 1) * B`` sessions may have been accepted or be running. ``S = 0`` is
synchronous RL: exactly ``B`` sessions per version.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CapacityRule:
    """The admission settings; ``batch_size=None`` means no trainer is attached."""

    max_concurrent: int
    batch_size: int | None = None
    max_staleness: int = 0

    def __post_init__(self) -> None:
        if self.max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1 (got {self.max_concurrent})")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None (got {self.batch_size})")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 (got {self.max_staleness})")


def free_slots(rule: CapacityRule, running: int, accepted: int, version: int) -> int:
    """How many more sessions may start now, never below 0.

    ``min(max_concurrent - running, (S + v + 1) * B - accepted - running)``
    with a trainer attached, ``max_concurrent - running`` without one.
    ``running`` counts open sessions, ``accepted`` the accepted trajectories
    since the start, ``version`` the policy version the engines serve.
    """
    for name, value in (("running", running), ("accepted", accepted), ("version", version)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0 (got {value})")
    free = rule.max_concurrent - running
    if rule.batch_size is not None:
        budget = (rule.max_staleness + version + 1) * rule.batch_size
        free = min(free, budget - accepted - running)
    return max(free, 0)


@dataclass
class CapacityStats:
    """A snapshot of the admission state; ``dataclasses.asdict`` makes it JSON."""

    running: int
    accepted: int
    rejected: int
    version: int
    max_concurrent: int
    batch_size: int | None
    max_staleness: int
    free: int
