"""CapacityActor: the policy version and staleness-bounded session admission.

Created by ``serve_app`` (or ``train_driver``) as one named detached actor
through :func:`get_or_create_capacity`, so it outlives the driver that made it
and every part finds the same one by name.
Called by whoever holds sessions, the SessionStore or each colocated Gateway
replica, through its :class:`CapacityClient` (``lease`` when a session opens:
one slot, or a block of them while no trainer is attached; ``settle`` or
``release`` when sessions end; each under its ``holder`` name, so a holder
that restarts recounts only its own),
and by the trainer (``grant`` when it attaches, ``on_new_version`` after
publishing weights, ``discard`` for sessions it dropped untrained, ``detach``
when it leaves).
Owns: the :class:`rlgate.sessions.capacity.CapacityRule`, the ``running`` (per holder), ``accepted``
and ``rejected`` counters and the policy ``version``. Every change appends the
whole state as a line to ``state_path`` (``<run>/capacity.jsonl``; the last
whole line counts, and the file is rewritten when it passes 1 MiB: a rename
per change cost more than the rest of the call) before the call that made it
returns, and Ray restarts a killed actor in place, which reads it back. What
it cannot know is which of the calls in flight at its death took effect, so a
restarted actor refuses each holder's calls (:class:`HolderUnknown`) until that
holder has told it how many sessions it holds (``reconcile``); holders do so
on their own (:class:`CapacityClient`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import ray

from rlgate.background import keep, to_its_end
from rlgate.logfile import append_whole, json_line, json_lines, open_log
from rlgate.run import run_of
from rlgate.sessions.capacity import CapacityRule, CapacityStats, GroupReservations, free_slots
from rlgate.telemetry import Metrics

logger = logging.getLogger(__name__)
STATE_REWRITE_BYTES = 2**20  # the state log is rewritten to its last line past this size


RECOVER_S = 120.0  # how long a holder waits for a restarting CapacityActor before its call fails
LINGER_S = 0.2  # a leasing holder gives ended sessions' slots back together, this long after the first ends
SPARE_IDLE_S = 0.5  # leased slots go back once no session asked for one for this long
SPARES_BACK_S = 1.0  # a session refused while other holders lease waits this long for their slots (LINGER_S each way)
LEASED_RECENTLY_S = 5.0  # a holder that took spares or settled this recently may hold slots it has not given back
PERMIT_S = 1.0  # an answer that says slots are leased lets its holder open sessions without a call this long


class HolderUnknown(Exception):
    """A restarted CapacityActor does not know this holder's count yet: reconcile first."""


# num_cpus=0: pure bookkeeping; it must never wait for a CPU on a packed cluster.
# Restarted in place when killed (max_restarts=-1); calls in flight then fail, never replay.
@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class CapacityActor:
    def __init__(self, max_concurrent: int, state_path: str | None = None) -> None:
        self.state_path = Path(state_path) if state_path else None
        self.rule = CapacityRule(max_concurrent=max_concurrent)
        self.held: dict[str, int] = {}  # holder -> its open sessions
        self.accepted = 0
        self.rejected = 0
        self.version = 0
        # What a trainer's staleness rule counts from: sessions accepted and
        # versions published before it attached are not its business.
        self.accepted_base = 0
        self.version_base = 0
        # Accepted sessions the trainer threw away (equal rewards, partial or stale
        # groups): they fill no batch, so they must not use up the staleness budget.
        self.discarded = 0
        self.reservations = GroupReservations()  # slots held for groups already started
        # Bumped by a holder's reconcile: an acquire that waited across that holder's restart
        # was made by the holder that died, and must not take a slot no one will release.
        self.generations: dict[str, int] = {}
        # Notified on every change that can free a slot (release, new version, new settings).
        self._changed = asyncio.Condition()
        # Holders whose count this actor does not know (after its restart), until they reconcile.
        self.unknown: set[str] = set()
        self.leased: dict[str, float] = {}  # holder -> when it last took spares or settled (it may hold slots)
        self._waiting = 0  # sessions waiting here for a slot
        self._attaching = False  # a trainer's grant waits for the holders' leasing permits to run out
        self._permitted_at = float("-inf")  # when an answer last said slots are leased (a permit of PERMIT_S)
        name = (ray.get_runtime_context().get_actor_name() if ray.is_initialized() else None) or "rlgate-capacity"
        self.metrics = Metrics(run_of(name, "capacity"))
        self._state_log, self._state_bytes, self.state_rewrite_bytes = None, None, STATE_REWRITE_BYTES
        restarted = ray.is_initialized() and ray.get_runtime_context().was_current_actor_reconstructed
        if restarted and self.state_path is not None and self.state_path.exists():
            with self.state_path.open() as lines:
                states = [state for _, state in json_lines(lines, lambda line: logger.warning("bad line: %r", line))]
            if states:
                self._load(states[-1])
                logger.warning("restarted: state from %s; holders %s must reconcile", self.state_path, self.unknown)

    # --- state on disk --------------------------------------------------------------

    def _state(self) -> dict:
        return {
            "rule": asdict(self.rule),
            "held": self.held,
            "accepted": self.accepted,
            "rejected": self.rejected,
            "version": self.version,
            "accepted_base": self.accepted_base,
            "version_base": self.version_base,
            "discarded": self.discarded,
            # Groups under way only: `early` (up to 10,000 tasks seen before a trainer attached) would
            # make every write O(tasks). Forgotten, such a group reserves its full size: fewer admitted.
            "reservations": {"pending": self.reservations.pending},
            "generations": self.generations,
        }

    def _load(self, state: dict) -> None:
        self.rule = CapacityRule(**state["rule"])
        self.held, self.generations = state["held"], state["generations"]
        self.accepted, self.rejected, self.version = state["accepted"], state["rejected"], state["version"]
        self.accepted_base, self.version_base = state["accepted_base"], state["version_base"]
        self.discarded = state["discarded"]
        pending = state["reservations"]["pending"]
        self.reservations = GroupReservations(pending={task: tuple(held) for task, held in pending.items()})
        self.unknown = set(self.held)

    def _save(self) -> None:
        if self.state_path is None:
            return
        line = json_line(self._state())
        if self._state_bytes is None or self._state_bytes + len(line) > self.state_rewrite_bytes:
            self._rewrite(line)
            return
        size, self._state_bytes = self._state_bytes, None  # unknown if the append fails: rewritten next
        # whole or not at all: the last whole line is the state
        self._state_bytes = append_whole(self._state_log, line, whole_at=size)

    def _rewrite(self, line: bytes) -> None:
        """The state log as this one line (a new file renamed over the old: a crash leaves either)."""
        temporary = self.state_path.with_suffix(".tmp")
        temporary.write_bytes(line)
        os.replace(temporary, self.state_path)
        if self._state_log is not None:
            self._state_log.close()
        self._state_log, self._state_bytes = open_log(self.state_path), len(line)

    def _known(self, holder: str) -> None:
        if holder in self.unknown:
            raise HolderUnknown(
                f"the capacity actor restarted and does not know how many sessions holder {holder!r} holds; "
                "reconcile first"
            )

    @property
    def running(self) -> int:
        return sum(self.held.values())

    def _report(self) -> None:
        """After every change: on disk first, then on the dashboard."""
        self._save()
        self.metrics.set("rlgate_policy_version", self.version)
        self.metrics.set("rlgate_capacity_running", self.running)
        self.metrics.set("rlgate_capacity_free", self._free())

    def _free(self) -> int:
        counted = self.accepted - self.accepted_base - self.discarded
        reserved = self.reservations.held() if self.rule.batch_size is not None else 0
        return free_slots(self.rule, self.running, max(counted, 0), self.version - self.version_base, reserved)

    def _admits(self, task_id: str | None, group_size: int | None) -> bool:
        self.reservations.expire(time.monotonic(), self.rule.group_timeout_s)
        if self.rule.batch_size is None or task_id is None:
            return self._free() > 0
        if self.reservations.joins(task_id):  # its slot is held: only max_concurrent applies
            return self.running < self.rule.max_concurrent
        return self._free() >= self.reservations.needed(task_id, self.rule.group_slots(group_size))

    async def acquire(
        self, timeout_s: float = 0.0, task_id: str | None = None, group_size: int | None = None, holder: str = ""
    ) -> bool:
        """Take one slot, waiting up to ``timeout_s`` for one; False (a rejection) on timeout.

        With a trainer attached and a ``task_id``, the first session of a group
        needs room for the whole group (``group_size``, default the trainer's)
        and reserves it; the group's other sessions take the reserved slots.
        """
        return bool(await self._take(timeout_s, task_id, group_size, holder, 1))

    async def lease(
        self,
        timeout_s: float = 0.0,
        task_id: str | None = None,
        group_size: int | None = None,
        holder: str = "",
        up_to: int = 1,
    ) -> tuple[int, bool]:
        """``acquire``, taking up to ``up_to`` slots at once while slots are leased
        (see ``leasing``): the first for the session asking, the rest spares for
        ``holder`` to open later sessions in without a call (given back unused
        with ``settle``), at most half of what is free after the first. Returns
        (slots taken, 0 on a rejection; whether slots are leased now). Every slot
        taken counts as running from now on, so admission stays exact."""
        if up_to < 1:
            raise ValueError(f"up_to must be >= 1 (got {up_to})")
        taken = await self._take(timeout_s, task_id, group_size, holder, up_to)
        return taken, self._permit()

    def leasing(self) -> bool:
        """Whether holders may lease slots and keep ended sessions' slots for their
        next sessions: only while max_concurrent alone admits (no trainer: its
        groups and staleness bound are decided here, a session at a time), no
        session waits here for a slot (it gets the next one given back), and
        no more run than max_concurrent (lowered: the holders drain)."""
        on = self.rule.batch_size is None and not self._attaching and not self._waiting
        return on and self.running <= self.rule.max_concurrent

    def _permit(self) -> bool:
        """``leasing()``, for an answer: a True lets its holder open sessions
        without a call for ``PERMIT_S`` from when it asked."""
        if on := self.leasing():
            self._permitted_at = time.monotonic()
        return on

    async def _take(
        self, timeout_s: float, task_id: str | None, group_size: int | None, holder: str, up_to: int
    ) -> int:
        if timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0 (got {timeout_s})")
        self._known(holder)
        now, generation = time.monotonic(), self.generations.get(holder, 0)
        deadline = now + timeout_s
        leasers = (h for h, at in self.leased.items() if h != holder and now - at < LEASED_RECENTLY_S)
        if self.rule.batch_size is None and not self._admits(task_id, group_size) and any(leasers):
            # Other holders may hold slots they have not given back (spares, ended sessions' slots): they give
            # them back within SPARES_BACK_S once an answer tells them that a session waits (leasing() is off).
            deadline = max(deadline, now + SPARES_BACK_S)
        async with self._changed:
            # Reservations lapse with time, not with an event: look again at least every second.
            while not self._admits(task_id, group_size) and (left := deadline - time.monotonic()) > 0:
                self._waiting += 1
                try:
                    await asyncio.wait_for(self._changed.wait(), min(left, 1.0))
                except TimeoutError:  # the builtin TimeoutError only from Python 3.11
                    pass
                finally:
                    self._waiting -= 1
            if generation != self.generations.get(holder, 0):
                return 0  # its caller is gone
            if not self._admits(task_id, group_size):
                self.rejected += 1
                self._report()
                return 0
            if self.rule.batch_size is None and task_id is not None:
                self.reservations.started_early(task_id)
            elif task_id is not None:
                if self.reservations.joins(task_id):
                    self.reservations.join(task_id)
                else:
                    self.reservations.open(task_id, self.rule.group_slots(group_size), time.monotonic())
            self.held[holder] = self.held.get(holder, 0) + 1
            spare = min(up_to - 1, self._free() // 2) if up_to > 1 and self.leasing() else 0
            if spare:
                self.held[holder] += spare
                self.leased[holder] = time.monotonic()
            self._report()
            return 1 + spare

    async def note_accepted(self, sessions: int) -> None:
        """Count ``sessions`` as accepted: ones whose release may have been lost with a
        restart (a holder that cannot tell errs towards admitting fewer), or a stopped
        run's that the resumed trainer trains (it did not admit them, yet they fill its
        batches: those of groups that filled after it attached; see ``grant``)."""
        async with self._changed:
            self.accepted += sessions
            self._report()

    async def release(self, accepted: bool, holder: str = "") -> None:
        """A session of ``holder`` ended; ``accepted`` when its trajectory was finished and exported."""
        await self._given_back(holder, 1, int(accepted))

    async def settle(
        self,
        ended: int,
        accepted: int,
        holder: str = "",
        started: tuple[str, ...] = (),
        unused: int = 0,
    ) -> bool:
        """What ``holder`` did with its slots since it last said: ``ended``
        sessions' slots come back (it kept the slots of others that ended for
        its next sessions), ``accepted`` sessions ended with a trajectory
        exported, ``started`` names the tasks of sessions it opened without a
        call (a group they begin reserves fewer once a trainer attaches; told
        after one attached, they reserve nothing), and it gives ``unused``
        spares back. Returns whether slots are leased now (``leasing``)."""
        for name, value in (("ended", ended), ("accepted", accepted), ("unused", unused)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0 (got {value})")
        self.leased[holder] = time.monotonic()  # it leases: it may keep slots until it settles again
        await self._given_back(holder, ended + unused, accepted, started)
        return self._permit()

    async def _given_back(self, holder: str, slots: int, accepted: int, started: tuple[str, ...] = ()) -> None:
        self._known(holder)
        async with self._changed:
            if (held := self.held.get(holder, 0)) < slots:
                raise ValueError(f"{slots} slot(s) given back by holder {holder!r}, which holds {held or 'none'}")
            self.held[holder] -= slots
            self.accepted += accepted
            if self.rule.batch_size is None:
                for task_id in started:
                    self.reservations.started_early(task_id)
            self._changed.notify_all()
            self._report()

    async def reconcile(self, running: int, holder: str = "") -> None:
        """``holder`` (re)started holding ``running`` slots: that is its count."""
        async with self._changed:
            self.held[holder], self.generations[holder] = running, self.generations.get(holder, 0) + 1
            self.unknown.discard(holder)
            self._changed.notify_all()
            self._report()

    async def grant(
        self,
        batch_size: int,
        max_staleness: int,
        group_size: int = 1,
        group_timeout_s: float = 600.0,
        carried: int = 0,
        discarded: int = 0,
    ) -> None:
        """A trainer attaches (or changes its settings): admit whole groups by the
        staleness rule, counting accepted sessions and versions from now.

        Attaching waits until no holder may still open a session without a call
        (the last leasing permit, ``PERMIT_S``, has run out): sessions opened so
        are then all ones that began before the trainer attached. ``carried``: a
        resumed trainer's sessions that an earlier run saved and it trains,
        counted as accepted when it attaches, of which it has dropped ``discarded``
        (in the same call, so no session is admitted before they count)."""
        if carried < 0 or discarded < 0:
            raise ValueError(f"carried and discarded must be >= 0 (got {carried}, {discarded})")
        if self.rule.batch_size is None:
            self._attaching = True  # answers from now on say slots are not leased
            try:
                while (left := self._permitted_at + PERMIT_S - time.monotonic()) > 0:
                    await asyncio.sleep(left)
            finally:
                self._attaching = False
            # carried: as if admitted since it attached (a grant made again, its answer lost, counts them once)
            self.accepted_base, self.version_base, self.discarded = self.accepted - carried, self.version, discarded
            self.reservations = GroupReservations(early=self.reservations.early)
        await self._set_rule(
            batch_size=batch_size,
            max_staleness=max_staleness,
            group_size=group_size,
            group_timeout_s=group_timeout_s,
        )

    async def discard(self, sessions: int) -> None:
        """The trainer dropped ``sessions`` accepted sessions without training on
        them; as many new ones may start in their place."""
        if sessions < 0:
            raise ValueError(f"sessions must be >= 0 (got {sessions})")
        async with self._changed:
            self.discarded += sessions
            self._changed.notify_all()
            self._report()

    async def detach(self) -> None:
        """The trainer left: admit by ``max_concurrent`` only."""
        await self._set_rule(batch_size=None, max_staleness=0)

    async def set_max_concurrent(self, n: int) -> None:
        await self._set_rule(max_concurrent=n)

    async def on_new_version(self, version: int) -> None:
        """The trainer published weights of ``version``; versions never go backwards."""
        async with self._changed:
            if version < self.version:
                raise ValueError(f"policy version cannot go backwards: {self.version} -> {version}")
            self.version = version
            self._changed.notify_all()
            self._report()

    async def stats(self) -> dict:
        rule = self.rule
        return asdict(
            CapacityStats(
                running=self.running,
                accepted=self.accepted,
                discarded=self.discarded,
                rejected=self.rejected,
                version=self.version,
                max_concurrent=rule.max_concurrent,
                batch_size=rule.batch_size,
                max_staleness=rule.max_staleness,
                group_size=rule.group_size,
                reserved=self.reservations.held() if rule.batch_size is not None else 0,
                free=self._free(),
            )
        )

    async def _set_rule(self, **changes) -> None:
        async with self._changed:
            self.rule = replace(self.rule, **changes)  # validated by CapacityRule
            self._changed.notify_all()
            self._report()


_RESTARTED = object()  # what CapacityClient._call answers for a call the actor's restart swallowed


class CapacityClient:
    """A holder's side of the CapacityActor: the plain async interface
    :class:`rlgate.sessions.manager.SessionManager` expects (``acquire``, ``release``),
    counted under ``holder``, leases while no trainer is attached, and recovery
    from the actor's restart.

    Leasing (``block`` > 1), while the actor says slots are leased (no trainer
    attached: max_concurrent alone admits; no session waiting there). A call for
    a slot takes up to ``block`` (as many as sessions asked for here in the last
    ``SPARE_IDLE_S``, so a quiet holder takes one): one for the session asking,
    the rest spares that later sessions open in without a call. An ended
    session's slot is kept for the holder's next session, or goes back with the
    others at most ``LINGER_S`` after it ended, as do the spares once no session
    asked for ``SPARE_IDLE_S`` (spares are taken before ended sessions' slots, so
    none stays unused while sessions ask); the sessions accepted and started go
    with them. A slot counts as running at the actor from when it is taken until
    it is back, so the holders together never run more than max_concurrent; the
    actor's counts trail the holders' by up to ``LINGER_S`` (``flush`` sends
    everything now).
    Otherwise (a trainer attached, a session waiting at the actor) every session
    takes and gives back its own slot at once, as whole-group admission and the
    staleness rule need; spares taken before go back at the next ``LINGER_S``.
    A holder opens sessions without a call only within ``PERMIT_S`` of asking
    the actor, whose answer said slots are leased, and a trainer's ``grant``
    waits for the last such permit to run out, so no session opens so once a
    trainer's rule applies. Without a trainer, a session refused at the actor
    while other holders lease first waits up to ``SPARES_BACK_S`` for the slots
    they hold.

    When a call finds the actor dead or restarted (the call failed, or it was
    refused as :class:`HolderUnknown`), whether it took effect is unknown, so
    the client waits for its other calls to settle, tells the actor how many
    slots the holder holds and goes on: an
    acquire is made again, a release is then done (its accepted sessions noted
    with ``note_accepted``, which at worst counts them twice and so admits fewer).

    What it holds is ``count()`` (a session is in it from the moment its acquire
    returns until its release is called), plus the slots granted whose acquire
    has not returned yet, plus the spares, plus the releases called but not sent
    yet: one waiting behind a recount (or gathered for the next ``LINGER_S``) is
    still held when the recount is made, and is taken off when it is sent.
    """

    def __init__(self, actor, holder: str, count: Callable[[], int] = lambda: 0, block: int = 1) -> None:
        if block < 1:
            raise ValueError(f"block must be >= 1 (got {block})")
        self.actor, self.holder, self.count, self.block = actor, holder, count, block
        self._in_flight = 0
        self._settled = asyncio.Condition()
        self._recovering = asyncio.Lock()
        self._lost = False
        self._reconciling = None  # the holder's (re)start count, sent but not yet applied
        self._unsent_releases = 0  # releases called, not yet sent: still held
        self._unclaimed_grants = 0  # acquires granted, not yet back with their callers: held, in no count()
        self._spares = 0  # leased slots no session has taken yet: held
        self._permit_until = float("-inf")  # open sessions without a call until then (an answer said so)
        self._ended = 0  # sessions ended whose slots are neither sent back nor taken by a new session yet
        self._accepted = 0  # sessions ended accepted, not told yet
        self._opened = 0  # sessions opened without a call since the last settle (whose answer says if leasing is on)
        self._started: list[str] = []  # tasks of sessions opened without a call, not told yet
        self._asked: collections.deque[float] = collections.deque(maxlen=block)  # when the last sessions asked
        self._coming = 0  # slots asked for by leases in flight (so concurrent asks take no more between them)
        self._flusher: asyncio.Future | None = None

    async def acquire(self, timeout_s: float = 0.0, task_id: str | None = None, group_size: int | None = None) -> bool:
        """As the actor's; a caller cancelled while it waits (its client hung up)
        leaves the call going on, and a slot it is granted then is given back."""
        self._asked.append(time.monotonic())
        if self._leasing() and (self._spares or self._ended):
            # Claimed at once (the caller opens its session before anything else runs): a spare first (so
            # none stays unused while sessions ask), else an ended session's slot (nothing changes at the
            # actor: max_concurrent alone counts).
            if self._spares:
                self._spares -= 1
            else:
                self._ended -= 1
                self._unsent_releases -= 1
            self._opened += 1
            if task_id is not None:
                self._started.append(task_id)
            self._keep_flushing()
            return True
        # the actor leases only while no trainer is attached, and takes one slot for the session otherwise
        up_to = self._lease_size()
        self._coming += up_to  # before any await: a concurrent ask sees it
        granted = await to_its_end(
            self._acquire(timeout_s, task_id, group_size, up_to), "a slot's acquire", self._give_back
        )
        if granted:  # claimed: the caller opens its session before anything else runs, so count() has it
            self._unclaimed_grants -= 1
        return granted

    def _lease_size(self) -> int:
        """Slots to ask for: as many as sessions asked for here in the last
        ``SPARE_IDLE_S`` (this one included), at most ``block``, less the slots
        that leases in flight already ask for (a burst of asks takes one each)."""
        now = time.monotonic()
        recent = sum(now - asked <= SPARE_IDLE_S for asked in self._asked)
        return max(1, recent - self._coming)

    async def _acquire(self, timeout_s: float, task_id: str | None, group_size: int | None, up_to: int) -> bool:
        try:
            answer = _RESTARTED
            while answer is _RESTARTED:
                answer = await self._call("lease", timeout_s, task_id, group_size, self.holder, up_to)
        finally:
            self._coming -= up_to
        return answer[0] > 0

    def _give_back(self, acquired: asyncio.Future) -> None:
        if not acquired.cancelled() and acquired.exception() is None and acquired.result():
            self._unclaimed_grants -= 1  # never claimed: held until its release is sent
            self._unsent_releases += 1
            keep(self._release(accepted=False), "giving back a slot no session took")  # if not: the next recount

    async def release(self, accepted: bool) -> None:
        self._unsent_releases += 1  # before any await: its session has just left count()
        if self._leasing() and self.block > 1:  # sent with the others within LINGER_S, or kept for the next session
            self._ended += 1
            self._accepted += int(accepted)
            self._keep_flushing()
            return
        await self._release(accepted)

    async def _release(self, accepted: bool) -> None:
        if await self._call("release", accepted, self.holder, releases=1) is _RESTARTED and accepted:
            await self.actor.note_accepted.remote(1)

    async def flush(self) -> None:
        """Give back now what leasing holds: the slots of ended sessions and every
        spare (to its end, even if the caller is cancelled: what it took to send
        is no longer held here)."""
        await to_its_end(self._settle(everything=True), "giving capacity slots back")

    async def _settle(self, everything: bool = False) -> None:
        """Tell the actor in one call what happened since the last: the ended
        sessions' slots back, the sessions accepted and opened (so the answer
        says whether leasing is still on), and the spares back once no session
        asked for ``SPARE_IDLE_S`` (every spare with ``everything``, or once the
        actor leases no more)."""
        idle = not self._asked or time.monotonic() - self._asked[-1] >= SPARE_IDLE_S
        unused = self._spares if everything or idle or not self._leasing() else 0
        ended, accepted, opened, started = self._ended, self._accepted, self._opened, tuple(self._started)
        if not (ended or accepted or opened or unused or started):
            return
        self._ended, self._accepted, self._opened, self._started = 0, 0, 0, []
        self._spares -= unused
        self._unsent_releases += unused  # held until sent, as an ended session's slot is
        slots = ended + unused
        answer = await self._call("settle", ended, accepted, self.holder, started, unused, releases=slots)
        if answer is _RESTARTED and accepted:
            await self.actor.note_accepted.remote(accepted)

    def _leasing(self) -> bool:
        """Whether this holder may open sessions without a call now: an answer of
        the actor said slots are leased, less than ``PERMIT_S`` ago (counted from
        when it asked, so the actor, which waits that long after its last such
        answer before a trainer's rule applies, never admits past it)."""
        return time.monotonic() < self._permit_until

    def _keep_flushing(self) -> None:
        if self._flusher is None or self._flusher.done():
            self._flusher = keep(self._flush_while_held(), "giving capacity slots back")

    async def _flush_while_held(self) -> None:
        while self._ended or self._accepted or self._opened or self._spares or self._started:
            await asyncio.sleep(LINGER_S)
            await self._settle()

    def reconcile(self, running: int):
        """Tell the actor how many sessions the holder holds (it (re)started). Sent at
        once (from a constructor, say); every later call of this client waits until
        the actor has applied it: sent from another thread, an acquire could overtake
        it and then be wiped by it (a slot held but no longer counted)."""
        self._reconciling = self.actor.reconcile.remote(running, self.holder)
        return self._reconciling

    async def _call(self, method: str, *args, releases: int = 0):
        """The call's answer; ``_RESTARTED`` when the actor restarted under it (the
        holder has reconciled since). ``releases``: the slots it gives back."""
        from ray.exceptions import RayActorError

        try:
            if self._reconciling is not None:
                try:
                    await self._reconciling
                except RayActorError:  # the actor died under it: recover says the count again
                    self._lost = True
                self._reconciling = None
            await self._recover()
        except BaseException:  # never sent: those slots are not coming back either (its caller hears why)
            self._unsent_releases -= releases
            raise
        self._in_flight += 1  # from here a recount waits for this call, and no longer counts its releases as held
        self._unsent_releases -= releases
        asked_at = time.monotonic()  # before the actor answers: a permit never outlasts the actor's own count of it
        try:
            answer = await getattr(self.actor, method).remote(*args)
            if method in ("settle", "lease"):  # the actor's word on leasing: a permit from when it was asked, or none
                leasing = answer if method == "settle" else answer[1]
                self._permit_until = asked_at + PERMIT_S if leasing else float("-inf")
            if method == "lease":  # counted before a recount can run (it waits for this call)
                taken = answer[0]
                if taken:
                    self._unclaimed_grants += 1
                    self._spares += taken - 1
                if self._spares:
                    self._keep_flushing()
            return answer
        except (RayActorError, HolderUnknown) as err:
            logger.warning("capacity %s for %s: the actor restarted (%s); reconciling", method, self.holder, err)
            self._lost = True
        finally:
            self._in_flight -= 1
            async with self._settled:
                self._settled.notify_all()
        await self._recover()
        return _RESTARTED

    async def _recover(self) -> None:
        from ray.exceptions import ActorUnavailableError

        async with self._recovering:
            if not self._lost:
                return
            async with self._settled:  # a call of ours applied after the count would count twice
                await self._settled.wait_for(lambda: self._in_flight == 0)
            deadline, pause = time.monotonic() + RECOVER_S, 0.1
            while True:
                try:  # the actor may still be restarting (ActorUnavailableError): ask until it answers
                    held = self.count() + self._unsent_releases + self._unclaimed_grants + self._spares
                    await self.actor.reconcile.remote(held, self.holder)
                    break
                except ActorUnavailableError as err:  # restarting; a dead actor (ActorDiedError) fails at once
                    if time.monotonic() > deadline:
                        raise
                    logger.info("capacity: reconciling %s waits for the actor's restart (%s)", self.holder, err)
                    await asyncio.sleep(pause)
                    pause = min(2 * pause, 2.0)
            self._lost = False


def get_or_create_capacity(name: str, namespace: str | None, max_concurrent: int, state_path: str | None = None):
    """The named detached CapacityActor, created with ``max_concurrent`` if it does not
    exist, keeping its state at ``state_path`` (read back only when Ray restarts it).

    An existing actor keeps its settings and counters; call ``set_max_concurrent``
    to change them.
    """
    return CapacityActor.options(name=name, namespace=namespace, lifetime="detached", get_if_exists=True).remote(
        max_concurrent, state_path
    )
