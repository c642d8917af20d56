"""CapacityActor: the policy version and staleness-bounded session admission.

Created by ``serve_app`` (or ``train_driver``) as one named detached actor
through :func:`get_or_create_capacity`, so it outlives the driver that made it
and every part finds the same one by name.
Called by whoever holds sessions, the SessionStore or each colocated Gateway
replica (``acquire`` when a session opens, ``release`` when it ends, each
under its ``holder`` name, so a holder that restarts recounts only its own),
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
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import ray

from rlgate.background import keep, to_its_end
from rlgate.logfile import append_whole, json_lines, open_log
from rlgate.run import run_of
from rlgate.sessions.capacity import CapacityRule, CapacityStats, GroupReservations, free_slots
from rlgate.telemetry import Metrics

logger = logging.getLogger(__name__)
STATE_REWRITE_BYTES = 2**20  # the state log is rewritten to its last line past this size


RECOVER_S = 120.0  # how long a holder waits for a restarting CapacityActor before its call fails


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
        line = (json.dumps(self._state()) + "\n").encode()
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
        if timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0 (got {timeout_s})")
        self._known(holder)
        deadline, generation = time.monotonic() + timeout_s, self.generations.get(holder, 0)
        async with self._changed:
            # Reservations lapse with time, not with an event: look again at least every second.
            while not self._admits(task_id, group_size) and (left := deadline - time.monotonic()) > 0:
                try:
                    await asyncio.wait_for(self._changed.wait(), min(left, 1.0))
                except TimeoutError:  # the builtin TimeoutError only from Python 3.11
                    pass
            if generation != self.generations.get(holder, 0):
                return False  # its caller is gone
            if not self._admits(task_id, group_size):
                self.rejected += 1
                self._report()
                return False
            if self.rule.batch_size is None and task_id is not None:
                self.reservations.started_early(task_id)
            elif task_id is not None:
                if self.reservations.joins(task_id):
                    self.reservations.join(task_id)
                else:
                    self.reservations.open(task_id, self.rule.group_slots(group_size), time.monotonic())
            self.held[holder] = self.held.get(holder, 0) + 1
            self._report()
            return True

    async def note_accepted(self, sessions: int) -> None:
        """Count ``sessions`` as accepted whose release may have been lost with a
        restart (a holder that cannot tell errs towards admitting fewer)."""
        async with self._changed:
            self.accepted += sessions
            self._report()

    async def release(self, accepted: bool, holder: str = "") -> None:
        """A session of ``holder`` ended; ``accepted`` when its trajectory was finished and exported."""
        self._known(holder)
        async with self._changed:
            if not self.held.get(holder):
                raise ValueError(f"release without a running session of holder {holder!r} (it holds none)")
            self.held[holder] -= 1
            self.accepted += int(accepted)
            self._changed.notify_all()
            self._report()

    async def reconcile(self, running: int, holder: str = "") -> None:
        """``holder`` (re)started holding ``running`` open sessions: that is its count."""
        async with self._changed:
            self.held[holder], self.generations[holder] = running, self.generations.get(holder, 0) + 1
            self.unknown.discard(holder)
            self._changed.notify_all()
            self._report()

    async def grant(
        self, batch_size: int, max_staleness: int, group_size: int = 1, group_timeout_s: float = 600.0
    ) -> None:
        """A trainer attaches (or changes its settings): admit whole groups by the
        staleness rule, counting accepted sessions and versions from now."""
        if self.rule.batch_size is None:
            self.accepted_base, self.version_base, self.discarded = self.accepted, self.version, 0
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
    counted under ``holder``, and recovery from the actor's restart.

    When a call finds the actor dead or restarted (the call failed, or it was
    refused as :class:`HolderUnknown`), whether it took effect is unknown, so
    the client waits for its other calls to settle, tells the actor how many
    sessions the holder holds and goes on: an
    acquire is made again, a release is then done (its accepted session noted
    with ``note_accepted``, which at worst counts it twice and so admits fewer).

    What it holds is ``count()`` (a session is in it from the moment its acquire
    returns until its release is called), plus the slots granted whose acquire
    has not returned yet, plus the releases called but not sent yet: one
    waiting behind a recount is still held when the recount is made, and is
    taken off when it is sent.
    """

    def __init__(self, actor, holder: str, count: Callable[[], int] = lambda: 0) -> None:
        self.actor, self.holder, self.count = actor, holder, count
        self._in_flight = 0
        self._settled = asyncio.Condition()
        self._recovering = asyncio.Lock()
        self._lost = False
        self._reconciling = None  # the holder's (re)start count, sent but not yet applied
        self._unsent_releases = 0  # releases called, not yet sent: still held
        self._unclaimed_grants = 0  # acquires granted, not yet back with their callers: held, in no count()

    async def acquire(self, timeout_s: float = 0.0, task_id: str | None = None, group_size: int | None = None) -> bool:
        """As the actor's; a caller cancelled while it waits (its client hung up)
        leaves the call going on, and a slot it is granted then is given back."""
        granted = await to_its_end(self._acquire(timeout_s, task_id, group_size), "a slot's acquire", self._give_back)
        if granted:  # claimed: the caller opens its session before anything else runs, so count() has it
            self._unclaimed_grants -= 1
        return granted

    async def _acquire(self, timeout_s: float, task_id: str | None, group_size: int | None) -> bool:
        while (granted := await self._call("acquire", timeout_s, task_id, group_size, self.holder)) is _RESTARTED:
            pass
        return granted

    def _give_back(self, acquired: asyncio.Future) -> None:
        if not acquired.cancelled() and acquired.exception() is None and acquired.result():
            self._unclaimed_grants -= 1  # never claimed: held until its release is sent
            self._unsent_releases += 1
            keep(self._release(accepted=False), "giving back a slot no session took")  # if not: the next recount

    async def release(self, accepted: bool) -> None:
        self._unsent_releases += 1  # before any await: its session has just left count()
        await self._release(accepted)

    async def _release(self, accepted: bool) -> None:
        if await self._call("release", accepted, self.holder) is _RESTARTED and accepted:
            await self.actor.note_accepted.remote(1)

    def reconcile(self, running: int):
        """Tell the actor how many sessions the holder holds (it (re)started). Sent at
        once (from a constructor, say); every later call of this client waits until
        the actor has applied it: sent from another thread, an acquire could overtake
        it and then be wiped by it (a slot held but no longer counted)."""
        self._reconciling = self.actor.reconcile.remote(running, self.holder)
        return self._reconciling

    async def _call(self, method: str, *args):
        """The call's answer; ``_RESTARTED`` when the actor restarted under it (the
        holder has reconciled since)."""
        from ray.exceptions import RayActorError

        try:
            if self._reconciling is not None:
                try:
                    await self._reconciling
                except RayActorError:  # the actor died under it: recover says the count again
                    self._lost = True
                self._reconciling = None
            await self._recover()
        except BaseException:  # never sent: a release is not coming either (its caller hears why)
            self._unsent_releases -= method == "release"
            raise
        self._in_flight += 1  # from here a recount waits for this call, and no longer counts a release as held
        self._unsent_releases -= method == "release"
        try:
            answer = await getattr(self.actor, method).remote(*args)
            if method == "acquire" and answer is True:  # before a recount can run (it waits for this call)
                self._unclaimed_grants += 1
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
                    held = self.count() + self._unsent_releases + self._unclaimed_grants
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
