"""From saved trajectories to GRPO batches (pure; no Ray, no torch).

The trainer reads records from the TrajectoryStore in ``seq`` order and feeds
them to a :class:`GroupBuffer`. A *group* is ``group_size`` sessions with the
same ``task_id`` (a record may carry its own ``group_size``, set per session);
all records of a session belong to its group. A *batch* is ``batch_size``
sessions' worth of whole groups.

* A group whose rewards are all equal carries no learning signal; with
  ``drop_equal_reward_groups`` it is dropped when it completes (DAPO's
  dynamic sampling).
* A group still short after ``group_timeout_s`` is *partial*: it joins the
  next batch as it is, and its advantages are normalised over the batch
  instead of within the group (``Batch.partial``), or is dropped when
  ``partial_groups = "drop"``.
* A *failed* session (its record says ``failed``: the episode's environment
  errored) is a member of its group with nothing to train: the group
  completes without waiting for it, and it fills its slot in the batch as
  it filled a slot of capacity. A group that is all failures trains nothing.
  Drop counts are of members (failed ones included): the slots handed back.
* A group nothing of which may be trained at the current policy version is
  dropped (``take(version, max_staleness)``): every sampled token is older
  than ``version - max_staleness``, or some token was sampled by a version
  newer than the trainer's own (a policy a crash discarded before its
  checkpoint; its logprobs describe weights that no longer exist). After a
  resume that is also a group holding a session saved before it
  (``seq <= backlog_end``), or ended by it (``end_reason: restart``: open when
  the run stopped), with a token newer than the version resumed at:
  the stopped run sampled it from weights the resume abandoned, whatever
  version the resumed run has reached by the time the group completes.
* A resumed run's CapacityActor did not admit the stopped run's sessions,
  yet the run trains them: each member saved before the resume counts once
  its group leaves the filling stage (complete, or timed out),
  ``Counters.carried``, against the budget of the version it is trained at.
  The backlog is read before the trainer attaches, and the actor counts
  those from the start (its ``grant``), later ones when told (its
  ``note_accepted``): a synchronous run (``max_staleness`` 0) admits only
  what the batch at the resumed version still needs; more would run on past
  the next version and mix two versions in their groups. Groups still filling
  are not counted until they fill: one whose missing members never come would
  otherwise hold back the batch until ``group_timeout_s``. Sessions the run's
  stores take back from their journals (``reopened``: open at the stop, some
  perhaps saved as they stopped) are not carried: the actor counts them when
  they end.
* ``Counters.discardable`` counts the dropped members the run's CapacityActor
  counts (saved after ``backlog_end``, carried, or reopened), which it is told
  of (its ``discard``); an earlier run's others are not its to forget.

Every record is handed out or dropped exactly once. :meth:`GroupBuffer.state`
is small and restores exactly: records read but not yet in a batch are simply
read again after a restart, and records already consumed are skipped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from rlgate.sessions.trajectory import TrajectoryRecord


@dataclass
class Group:
    task_id: str
    size: int
    sessions: dict[str, list[dict]] = field(default_factory=dict)  # session id -> its records
    failed: dict[str, list[dict]] = field(default_factory=dict)  # failed session id -> its marker record
    opened_at: float = 0.0

    @property
    def records(self) -> list[TrajectoryRecord]:
        return [record for records in self.sessions.values() for record in records]

    @property
    def members(self) -> int:
        return len(self.sessions) + len(self.failed)

    def full(self) -> bool:
        return self.members >= self.size

    def rewards_equal(self) -> bool:
        rewards = {record["reward"] for record in self.records}
        return len(rewards) <= 1


@dataclass
class Batch:
    groups: list[Group]  # complete groups: advantages within each group
    partial: list[Group]  # groups that timed out short: advantages over the whole batch

    @property
    def records(self) -> list[TrajectoryRecord]:
        return [r for g in self.groups + self.partial for r in g.records]

    @property
    def sessions(self) -> int:
        return sum(len(g.sessions) for g in self.groups + self.partial)

    @property
    def failed(self) -> int:
        return sum(len(g.failed) for g in self.groups + self.partial)


@dataclass
class Counters:
    """Records read and batched; sessions (episodes) dropped, by reason; failed sessions."""

    read: int = 0
    batched: int = 0
    failed: int = 0
    dropped_equal_reward: int = 0
    dropped_partial: int = 0
    dropped_stale: int = 0
    dropped_failed: int = 0  # members of groups that are nothing but failed sessions
    carried: int = 0  # members saved before the (re)start whose groups filled or timed out: to be counted
    discardable: int = 0  # dropped members this run's CapacityActor counts (admitted, carried or reopened)

    @property
    def dropped(self) -> int:
        return self.dropped_equal_reward + self.dropped_partial + self.dropped_stale + self.dropped_failed


def _sessions(records: list[TrajectoryRecord]) -> list[list[dict]]:
    """Consecutive records of the same session, as runs."""
    runs: list[list[dict]] = []
    for record in records:
        if runs and runs[-1][0]["session_id"] == record["session_id"]:
            runs[-1].append(record)
        else:
            runs.append([record])
    return runs


class GroupBuffer:
    def __init__(
        self,
        batch_size: int,
        group_size: int,
        group_timeout_s: float = 600.0,
        drop_equal_reward_groups: bool = False,
        partial_groups: Literal["batch", "drop"] = "batch",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if batch_size < 1 or group_size < 1:
            raise ValueError("batch_size and group_size must be at least 1")
        self.batch_size, self.group_size = batch_size, group_size
        self.group_timeout_s = group_timeout_s
        self.drop_equal_reward_groups, self.partial_groups = drop_equal_reward_groups, partial_groups
        self.clock = clock
        self.open: dict[str, Group] = {}  # task id -> the group being filled
        self.ready: list[Group] = []  # complete groups waiting for a batch
        self.expired: list[Group] = []  # partial groups waiting for a batch
        self.watermark = 0  # every seq <= watermark is consumed or dropped
        self.done_above: set[int] = set()  # consumed or dropped seqs above the watermark
        self.last_read = 0
        self.counters = Counters()
        # what was saved before this run (re)started, and the version it started at (see the module notes)
        self.backlog_end, self.resumed_version = 0, 0
        self._carried: set[int] = set()  # the first seq of each carried member
        self.reopened: frozenset[str] = frozenset()  # sessions the run's stores take back from their journals

    # --- input ----------------------------------------------------------------

    def add(self, records: list[TrajectoryRecord]) -> None:
        """Records in ``seq`` order, as read from the TrajectoryStore: a session's
        records (saved together) come together, so a group completes only with
        every record of its last session."""
        for session in _sessions(records):
            self.last_read = max(self.last_read, session[-1]["seq"])
            fresh = [r for r in session if r["seq"] > self.watermark and r["seq"] not in self.done_above]
            if not fresh:
                continue  # consumed before a restart
            self.counters.read += len(fresh)
            first = fresh[0]
            task, session_id = first["task_id"], first["session_id"]
            group = self.open.get(task)
            if group is None:
                size = int(first.get("group_size") or self.group_size)
                group = self.open[task] = Group(task, size, opened_at=self.clock())
            if first.get("failed"):
                group.failed[session_id] = fresh
                self.counters.failed += 1
            else:
                group.sessions.setdefault(session_id, []).extend(fresh)
            if group.full():
                del self.open[task]
                self._carry(group)
                self._complete(group)

    def _carry(self, group: Group) -> None:
        """Count the members of ``group`` saved before the run (re)started (see the module notes)."""
        for first in self._firsts(group):
            taken_back = first["session_id"] in self.reopened
            if first["seq"] <= self.backlog_end and first["seq"] not in self._carried and not taken_back:
                self._carried.add(first["seq"])
                self.counters.carried += 1

    @staticmethod
    def _firsts(group: Group) -> list[dict]:
        return [records[0] for records in [*group.sessions.values(), *group.failed.values()]]

    def _complete(self, group: Group) -> None:
        if not group.sessions:  # nothing but failures: hand its slots back
            self._drop(group, "dropped_failed")
        elif self.drop_equal_reward_groups and group.rewards_equal():
            self._drop(group, "dropped_equal_reward")
        else:
            self.ready.append(group)

    def expire(self) -> None:
        """Move groups open longer than the timeout out of waiting."""
        now = self.clock()
        for task, group in list(self.open.items()):
            if now - group.opened_at >= self.group_timeout_s:
                del self.open[task]
                self._carry(group)
                if not group.sessions:
                    self._drop(group, "dropped_failed")
                elif self.partial_groups == "drop":
                    self._drop(group, "dropped_partial")
                else:
                    self.expired.append(group)

    # --- output ---------------------------------------------------------------

    def take(self, version: int | None = None, max_staleness: int = 0) -> Batch | None:
        """A batch once waiting groups hold at least ``batch_size`` sessions, else None.

        Complete groups go first, whole, then partial ones. Batches of complete
        groups are exactly ``batch_size`` sessions (it is a multiple of
        ``group_size``); a partial group may make a batch slightly larger.
        Given the trainer's ``version``, groups it may not train on are dropped first.
        """
        self.expire()
        if version is not None:
            self.drop_unusable(version, max_staleness)
        waiting = sum(g.members for g in self.ready + self.expired)
        if waiting < self.batch_size:
            return None
        return self._emit(self.batch_size)

    def flush(self) -> Batch | None:
        """Whatever whole or partial groups are waiting, however few (e.g. at the end)."""
        self.expire()
        return self._emit(None) if self.ready or self.expired else None

    def _emit(self, limit: int | None) -> Batch:
        batch, sessions = Batch([], []), 0
        for pool, target in ((self.ready, batch.groups), (self.expired, batch.partial)):
            while pool and (limit is None or sessions < limit):
                group = pool.pop(0)
                target.append(group)
                sessions += group.members
        for group in batch.groups + batch.partial:
            self._done(group)
        self.counters.batched += len(batch.records)
        return batch

    def _done(self, group: Group) -> None:
        for record in group.records + [r for records in group.failed.values() for r in records]:
            self.done_above.add(record["seq"])
        while self.watermark + 1 in self.done_above:
            self.watermark += 1
            self.done_above.discard(self.watermark)

    def drop_unusable(self, version: int, max_staleness: int) -> None:
        """Drop waiting groups with no token trainable at ``version`` (see the module notes)."""
        oldest = version - max_staleness

        def sampled(records: list[dict]) -> list[int]:
            return [v for r in records for m, v in zip(r["loss_mask"], r["versions"]) if m]

        def usable(group: Group) -> bool:
            versions = sampled(group.records)
            # the stopped run's: saved before the resume, or ended by it ("restart": open when it stopped)
            abandoned = sampled(
                [r for r in group.records if r["seq"] <= self.backlog_end or r.get("end_reason") == "restart"]
            )
            return (
                all(v <= version for v in versions)
                and any(v >= oldest for v in versions)
                and all(v <= self.resumed_version for v in abandoned)
            )

        for pool in (self.ready, self.expired):
            for group in [g for g in pool if not usable(g)]:
                pool.remove(group)
                self._drop(group, "dropped_stale")

    def _drop(self, group: Group, reason: str) -> None:
        setattr(self.counters, reason, getattr(self.counters, reason) + group.members)
        counted = [
            first["seq"] > self.backlog_end or first["seq"] in self._carried or first["session_id"] in self.reopened
            for first in self._firsts(group)
        ]
        self.counters.discardable += sum(counted)
        self._done(group)

    def pending_sessions(self) -> int:
        return sum(g.members for g in [*self.open.values(), *self.ready, *self.expired])

    # --- checkpoints ------------------------------------------------------------

    def state(self) -> dict:
        """What a checkpoint must keep: read again from ``watermark``, skipping ``done_above``."""
        return {"watermark": self.watermark, "done_above": sorted(self.done_above)}

    @classmethod
    def restore(
        cls,
        state: dict,
        backlog_end: int = 0,
        resumed_version: int = 0,
        reopened: Iterable[str] = (),
        **settings,
    ) -> GroupBuffer:
        """The buffer of ``state``; ``backlog_end``: the last seq saved when the run
        (re)started, at policy version ``resumed_version``; ``reopened``: the sessions
        its stores take back from their journals (see the module notes)."""
        buffer = cls(**settings)
        buffer.watermark = state["watermark"]
        buffer.done_above = set(state["done_above"])
        buffer.last_read = state["watermark"]
        buffer.backlog_end, buffer.resumed_version = backlog_end, resumed_version
        buffer.reopened = frozenset(reopened)
        return buffer
