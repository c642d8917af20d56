"""Sessions: keys, lifecycle, refresh, timeouts, and the trajectories they produce.

:class:`SessionManager` holds the logic the ``SessionStore`` actor serves. It
never sees a raw key: the gateway hashes keys (SHA-256 of a 256-bit random
key) before they reach it. Capacity and persistence are injected, so tests
can drive it without Ray:

* ``capacity.acquire(timeout_s, task_id, group_size) -> bool`` / ``capacity.release(accepted)``
* ``persist(records) -> None``: must return only once the records are on disk.

Errors a client can cause are :class:`SessionError` with the HTTP status and
a message that says what to do.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from rlgate.background import to_its_end
from rlgate.sessions.journal import JournalTooBig, SessionJournal
from rlgate.sessions.trajectory import ExportStyle, Interaction, SessionTrajectory, TrajectoryRecord

# A request still generating keeps its session from idling out, but no longer
# than this: a gateway that died mid-request must not pin a session forever.
MAX_REQUEST_S = 900.0


logger = logging.getLogger(__name__)


class SessionError(Exception):
    """A request the session layer refuses; carries the HTTP status to answer with."""

    def __init__(self, status: int, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.retry_after = status, message, retry_after

    def __reduce__(self):  # keep the fields when Ray ships the error across processes
        return (SessionError, (self.status, self.message, self.retry_after))


class Capacity(Protocol):
    async def acquire(
        self, timeout_s: float = 0.0, task_id: str | None = None, group_size: int | None = None
    ) -> bool: ...
    async def release(self, accepted: bool) -> None: ...


@dataclass
class Session:
    id: str
    task_id: str
    key_hash: str
    trajectory: SessionTrajectory
    created_at: float = field(default_factory=time.time)
    last_active: float = field(default_factory=time.monotonic)
    ending: bool = False
    group_size: int | None = None  # set per session at start; the trainer's default otherwise
    requests: list[float] = field(default_factory=list)  # start times of requests in flight
    train: bool = True  # False: an evaluation session, never saved or trained on
    save_failed: bool = False  # an end could not confirm its save: only a retried end may follow
    stored_tokens: int = 0  # prompt (once per request) and completion tokens of its interactions
    follow_template: bool = False  # each turn rendered afresh by the chat template, never continued

    def busy(self, now: float) -> bool:
        return any(now - started < MAX_REQUEST_S for started in self.requests)


@dataclass
class Parent:
    """What the gateway needs to continue an earlier exchange verbatim."""

    interaction_id: str
    key: str
    sequence: list[int]
    last_token: list[int]


class SessionManager:
    def __init__(
        self,
        capacity: Capacity,
        persist: Callable[[list[dict]], Awaitable[None]],
        *,
        export_style: ExportStyle = "individual",
        turn_discount: float = 1.0,
        session_timeout_s: float = 3600.0,
        refresh_timeout_s: float = 120.0,
        retry_after_s: float = 5.0,
        journal: SessionJournal | None = None,
        max_interactions: int = 1024,
        max_tokens: int = 1_048_576,
    ) -> None:
        self.capacity, self.persist, self.journal = capacity, persist, journal
        self.export_style, self.turn_discount = export_style, turn_discount
        self.session_timeout_s, self.refresh_timeout_s = session_timeout_s, refresh_timeout_s
        self.retry_after_s = retry_after_s
        self.max_interactions, self.max_tokens = max_interactions, max_tokens
        # Set when this owner cannot take its sessions back (see restore): every call answers 503 with it.
        self.refusing: str | None = None
        self.sessions: dict[str, Session] = {}
        self._by_key: dict[str, str] = {}  # key hash -> live session id
        self._ended: dict[str, float] = {}  # key hash -> when its last session ended (for 410)
        self._refreshing: set[str] = set()
        self._closing: set[str] = set()  # key hashes whose session is being exported now
        self._closed: dict[str, str] = {}  # key hash -> its session, open but closed to its key (close_keys)
        self.ended_by: dict[str, int] = {}  # sessions ended, by reason (ended, failed, refreshed, timeout, ...)
        self.counters = {
            "started": 0,
            "ended": 0,
            "failed": 0,
            "expired": 0,
            "refreshed": 0,
            "rejected": 0,
            "exported": 0,
            "evaluated": 0,
        }

    def restore(self, available_memory: int | None = None) -> int:
        """Take back the journal's open sessions and ended keys (after a restart);
        returns how many open training sessions hold a capacity slot. A journal
        too big to read back in ``available_memory`` (default: what is free)
        leaves this manager refusing every call with a 503 that says so."""
        if self.journal is None:
            return 0
        try:
            sessions, ended = self.journal.replay(available_memory)
        except JournalTooBig as err:  # answered to every call, not a restart loop of running out of memory
            logger.error("%s", err)
            self.refusing = str(err)
            return 0
        for fields in sessions:
            session = Session(
                fields["id"],
                fields["task_id"],
                fields["key_hash"],
                fields["trajectory"],
                created_at=fields["created_at"],
                group_size=fields["group_size"],
                train=fields["train"],
                follow_template=fields.get("follow_template", False),
                save_failed=fields.get("save_failed", False),
                stored_tokens=stored_tokens(fields["trajectory"].interactions.values()),
            )
            self.sessions[session.id] = session
            self._by_key[session.key_hash] = session.id
        self._ended.update(ended)
        try:
            self.journal.compact(self.sessions.values(), self._ended)
        except OSError:  # the journal as it is replays the same: go on, compact later
            logger.exception("could not compact the session journal %s", self.journal.path)
        return self.held_slots()

    def held_slots(self) -> int:
        """Capacity slots the open sessions hold: one per training session, from
        its acquire until its release (a session leaves ``sessions`` right before)."""
        return sum(s.train for s in self.sessions.values())

    # --- lifecycle ----------------------------------------------------------

    async def start(
        self,
        task_id: str,
        key_hash: str,
        refresh_key_hash: str | None = None,
        group_size: int | None = None,
        wait_s: float = 0.0,
        train: bool = True,
        follow_template: bool = False,
    ) -> str:
        """Start a session under ``key_hash``; with ``refresh_key_hash`` (the same
        key) end that key's live session first. ``group_size`` overrides the
        trainer's group size for this session's task; ``wait_s`` is how long a
        new session may wait for capacity. ``train=False`` starts an evaluation
        session: it takes no capacity slot and nothing of it is saved or
        trained on. ``follow_template``: no turn continues an earlier one (each
        prompt is rendered afresh). Returns the session id."""
        options = {"group_size": group_size, "follow_template": follow_template}
        if self.refusing:
            raise SessionError(503, self.refusing)
        if not train:
            if refresh_key_hash is not None:
                raise SessionError(400, "an evaluation session (train: false) starts with a new key, not a refresh")
            return self._open(task_id, key_hash, train=False, **options)
        if refresh_key_hash is None:
            if not await self.capacity.acquire(wait_s, task_id, group_size):
                self.counters["rejected"] += 1
                message = "no capacity for a new session now; retry later"
                if wait_s > 0:
                    message = f"no capacity for a new session within {wait_s:g} s; retry later"
                raise SessionError(429, message, self.retry_after_s)
            return await self._open_holding(task_id, key_hash, options)
        if refresh_key_hash in self._refreshing or refresh_key_hash in self._closing:
            raise SessionError(409, "this key is already being refreshed by another request")
        if refresh_key_hash not in self._by_key and refresh_key_hash not in self._ended:
            raise SessionError(401, "unknown api_key: refresh takes a key returned by /rl/start_session")
        self._refreshing.add(refresh_key_hash)
        try:
            if refresh_key_hash in self._by_key:
                await to_its_end(
                    self._end(self._by_key[refresh_key_hash], reason="refreshed"), "a refreshed session's save"
                )
                self.counters["refreshed"] += 1
            elif refresh_key_hash in self._closed:  # an earlier application's, not yet saved: saved first
                await to_its_end(
                    self._end(self._closed[refresh_key_hash], reason="restart"), "an earlier session's save"
                )
            waited_s = max(self.refresh_timeout_s, wait_s)
            if not await self.capacity.acquire(waited_s, task_id, group_size):
                self.counters["rejected"] += 1
                raise SessionError(
                    429,
                    f"the previous session of this key was ended and exported, but no capacity for a new "
                    f"one came within {waited_s:g} s; retry start_session with the same api_key",
                    self.retry_after_s,
                )
            session_id = await self._open_holding(task_id, refresh_key_hash, options)
            self._ended.pop(refresh_key_hash, None)
            return session_id
        finally:
            self._refreshing.discard(refresh_key_hash)

    async def _open_holding(self, task_id: str, key_hash: str, options: dict) -> str:
        """Open a session in the capacity slot just acquired; the slot goes back if it cannot open."""
        try:
            return self._open(task_id, key_hash, **options)
        except SessionError:
            await self.capacity.release(accepted=False)
            raise

    def _open(
        self,
        task_id: str,
        key_hash: str,
        group_size: int | None = None,
        train: bool = True,
        follow_template: bool = False,
    ) -> str:
        session_id = "sess-" + secrets.token_hex(12)
        trajectory = SessionTrajectory(session_id, task_id)
        session = Session(
            session_id,
            task_id,
            key_hash,
            trajectory,
            group_size=group_size,
            train=train,
            follow_template=follow_template,
        )
        self._journal("start the session", lambda journal: journal.opened(session))
        self.sessions[session_id] = session
        self._by_key[key_hash] = session_id
        self.counters["started"] += 1
        return session_id

    def _journal(self, change: str, write: Callable[[SessionJournal], None]) -> None:
        """Note a change in the journal before it is made; a failed write (a full
        disk) refuses the change with a 503, and the journal is as it was."""
        if self.journal is None:
            return
        try:
            write(self.journal)
        except OSError as err:
            logger.exception("could not write the session journal %s", self.journal.path)
            raise SessionError(
                503, f"could not {change}: the session journal cannot be written ({err}); nothing changed, retry"
            ) from err

    async def end(self, key_hash: str, failed: bool = False) -> int:
        """End the key's session; ``failed`` marks the episode as failed (nothing of it
        is trained on). Returns how many completions the session recorded."""
        session = self._live(key_hash)
        count = len(session.trajectory)
        await to_its_end(self._end(session.id, reason="failed" if failed else "ended"), "a session's end")
        return count

    def _end(self, session_id: str, reason: str) -> Awaitable[None]:
        """Close a session now, and (awaited) persist its trajectory and return its capacity slot.

        The session leaves the key index at once, when this is called, not when
        it is awaited (or run as a task: see :func:`rlgate.background.to_its_end`), so no request
        can add to it, and no other end start, while it is being exported. If
        persisting fails, the session is put back as it was (nothing is lost)
        and the caller gets a 503. A failed session is saved as one marker
        record (see ``SessionTrajectory.failure``).
        """
        session = self.sessions[session_id]
        if self._by_key.get(session.key_hash) == session_id:
            del self._by_key[session.key_hash]
        session.ending = True
        self._closing.add(session.key_hash)
        if not session.train:
            samples = []
        elif reason == "failed":
            samples = [session.trajectory.failure(self.export_style)]
        else:
            samples = session.trajectory.export(self.export_style, self.turn_discount)
        records = [sample.record(reason, session.group_size) for sample in samples]
        return self._save(session, reason, records)

    async def _save(self, session: Session, reason: str, records: list[TrajectoryRecord]) -> None:
        session_id = session.id
        try:
            if records:
                # From here the save may reach the disk whatever this call hears: a restarted
                # store must not take more turns into a session it may have saved already.
                self._journal("save the session", lambda journal: journal.saving(session_id))
                await self.persist(records)
        except SessionError:
            session.ending = False
            self._reopen(session)
            raise
        except Exception as err:
            # Put back as it was, but closed to changes: the export may have reached the disk (the
            # store died before answering), and a retried end must export the same thing again.
            session.ending, session.save_failed = False, True
            self._reopen(session)
            raise SessionError(503, f"could not save the trajectory ({err}); the session is still open, retry") from err
        finally:
            self._closing.discard(session.key_hash)
        del self.sessions[session_id]
        if self._closed.get(session.key_hash) == session_id:
            del self._closed[session.key_hash]
        self._ended[session.key_hash] = time.time()
        if self.journal is not None:
            try:
                self.journal.ended(session_id, session.key_hash, self._ended[session.key_hash])
                if self.journal.too_big():
                    self.journal.compact(self.sessions.values(), self._ended)
            except OSError:  # saved already; a restart would end it again, and the save is not repeated
                logger.exception("could not note the end of %s in the session journal", session_id)
        self.counters["exported"] += len(records)
        self.counters["ended"] += 1
        self.ended_by[reason] = self.ended_by.get(reason, 0) + 1
        self.counters["failed"] += reason == "failed"
        self.counters["evaluated"] += not session.train
        if session.train:
            await self.capacity.release(accepted=bool(records))

    async def expire_idle(self) -> int:
        """End every session idle past the timeout; return how many."""

        def idle(session: Session) -> bool:
            now = time.monotonic()
            return session.last_active < now - self.session_timeout_s and not session.ending and not session.busy(now)

        ended = 0
        for session_id in [s.id for s in self.sessions.values() if idle(s)]:
            # looked at again: while the one before was being saved, this one may have had a request
            if session_id not in self.sessions or not idle(self.sessions[session_id]):
                continue
            try:
                await self._end(session_id, reason="timeout")
            except SessionError:
                continue  # still open; the next sweep retries it
            self.counters["expired"] += 1
            ended += 1
        return ended

    def _reopen(self, session: Session) -> None:
        """A session whose end failed is reachable by its key again, unless its key was closed."""
        if session.key_hash not in self._ended:
            self._by_key[session.key_hash] = session.id

    def close_keys(self, session_ids: list[str]) -> None:
        """From now on these sessions' keys answer 410, as ended; the sessions stay
        until :meth:`end_sessions` saves them (an earlier application's, whose agents are gone)."""
        now = time.time()
        for session_id in session_ids:
            key_hash = self.sessions[session_id].key_hash
            self._by_key.pop(key_hash, None)
            self._ended[key_hash], self._closed[key_hash] = now, session_id

    async def end_sessions(self, session_ids: list[str], reason: str) -> None:
        """End these sessions if still open; one that cannot be saved now stays open
        (the idle sweep ends it later)."""
        for session_id in session_ids:
            if session_id in self.sessions and not self.sessions[session_id].ending:
                try:
                    await self._end(session_id, reason=reason)
                except SessionError:
                    logger.warning("could not end session %s (%s) yet", session_id, reason)

    async def close_all(self, reason: str = "shutdown") -> None:
        for session_id in [s.id for s in self.sessions.values() if not s.ending]:
            await self._end(session_id, reason=reason)

    # --- requests within a session -------------------------------------------

    def _live(self, key_hash: str) -> Session:
        if self.refusing:
            raise SessionError(503, self.refusing)
        session_id = self._by_key.get(key_hash)
        if session_id is None:
            if key_hash in self._closing:
                raise SessionError(409, "this session is being ended right now; retry")
            if key_hash in self._ended:
                raise SessionError(410, "this session has ended; start a new one with /rl/start_session")
            raise SessionError(401, "invalid API key")
        session = self.sessions[session_id]
        session.last_active = time.monotonic()
        return session

    def begin(self, key_hash: str, candidate_keys: list[str]) -> tuple[str, Parent | None]:
        """Authenticate a request and find the earlier exchange it continues.
        The request counts as in flight until ``record`` or ``abandon``."""
        session = self._changeable(key_hash)
        self._within_limits(session, 0, 0)
        session.requests.append(time.monotonic())
        parent = None if session.follow_template else session.trajectory.find(candidate_keys)
        if parent is None:
            return session.id, None
        return session.id, Parent(parent.id, parent.key, parent.sequence, list(parent.completion_ids[-1:]))

    def check(self, key_hash: str) -> None:
        """Raise unless the key is a live session's (401 unknown, 410 ended)."""
        self._live(key_hash)

    def _changeable(self, key_hash: str) -> Session:
        session = self._live(key_hash)
        if session.save_failed:
            raise SessionError(409, "saving this session failed; call /rl/end_session again before anything else")
        return session

    def record(self, session_id: str, interactions: list[Interaction]) -> None:
        session = self.sessions.get(session_id)
        if session is None or session.ending:
            self.abandon(session_id)  # a record settles its request, taken or not (an end may yet fail)
            raise SessionError(410, "the session ended while this completion was generated; it was not recorded")
        if session.save_failed:
            self.abandon(session_id)
            raise SessionError(409, "saving this session failed meanwhile; this completion was not recorded")
        try:
            tokens = stored_tokens(interactions)
            self._within_limits(session, len(interactions), tokens)
            earlier = session.trajectory.interactions
            self._journal("record this completion", lambda journal: journal.recorded(session_id, interactions, earlier))
            for interaction in interactions:
                session.trajectory.add(interaction)
            session.stored_tokens += tokens
        finally:
            self.abandon(session_id)

    def _within_limits(self, session: Session, interactions: int, tokens: int) -> None:
        """Refuse a turn of a session that is full (``interactions == 0``: before it
        is generated), or one whose completions would take it past a limit."""
        held = len(session.trajectory)
        limits = (
            (409, held, interactions, self.max_interactions, "completions", "max_session_interactions"),
            (413, session.stored_tokens, tokens, self.max_tokens, "stored tokens", "max_session_tokens"),
        )
        for status, held, adding, most, what, setting in limits:
            if adding == 0 and held >= most:
                problem = f"this session holds {held} {what}, the most [gateway] {setting} allows"
            elif adding and held + adding > most:
                problem = (
                    f"this completion would take the session to {held + adding} {what}, past [gateway] "
                    f"{setting} ({most}); it was not recorded"
                )
            else:
                continue
            raise SessionError(status, f"{problem}: end the session (its trajectory is saved) and start a new one")

    def abandon(self, session_id: str) -> None:
        """A request that ``begin`` admitted is over without a recorded completion."""
        session = self.sessions.get(session_id)
        if session is not None:
            if session.requests:
                session.requests.pop(0)
            session.last_active = time.monotonic()

    def set_reward(
        self, key_hash: str, reward: float, interaction_id: str | None, turn_rewards: list[float] | None = None
    ) -> str:
        session = self._changeable(key_hash)
        interactions = session.trajectory.interactions.values()
        before = [(i, i.reward) for i in interactions]
        try:
            if turn_rewards is not None:
                rewarded = session.trajectory.set_turn_rewards(turn_rewards, reward)
            else:
                rewarded = session.trajectory.set_reward(reward, interaction_id)
        except LookupError as err:
            raise SessionError(404 if interaction_id else 409, str(err)) from None
        try:
            self._journal("set the reward", lambda journal: journal.rewarded(session))
        except SessionError:
            for interaction, reward_before in before:
                interaction.reward = reward_before
            raise
        return rewarded

    def stats(self) -> dict:
        return {
            "open_sessions": len(self.sessions),
            "open_interactions": sum(len(s.trajectory) for s in self.sessions.values()),
            **self.counters,
        }


def stored_tokens(interactions) -> int:
    """Tokens that ``interactions`` hold: each prompt once (the choices of one
    request share their prompt list), and every completion."""
    interactions = list(interactions)
    prompts = {id(i.prompt_ids): len(i.prompt_ids) for i in interactions}
    return sum(prompts.values()) + sum(len(i.completion_ids) for i in interactions)


def hash_key(key: str) -> str:
    """Keys are 256-bit random tokens, so a plain SHA-256 is a safe verifier."""
    import hashlib

    return hashlib.sha256(key.encode()).hexdigest()


KEY_BYTES = 32  # every key rlgate makes is 256 random bits


def new_key(prefix: str) -> str:
    """A fresh secret: ``prefix`` and 256 random bits, URL-safe."""
    return prefix + secrets.token_urlsafe(KEY_BYTES)


def new_session_key(slot: int | None = None) -> str:
    """``rlg-<secret>``; ``rlg<slot>-<secret>`` from a colocated gateway replica
    (the slot routes the session's requests to it: ``rlgate.serving.routing``)."""
    return new_key("rlg-" if slot is None else f"rlg{slot}-")


def same_secret(given: str, expected: str) -> bool:
    """Constant-time comparison of two secrets."""
    return hmac.compare_digest(given.encode(), expected.encode())


def redact(text: str) -> str:
    """``text`` without session keys: an error quoting an inference URL names its key in the path."""
    return re.sub(r"/s/[^/\s'\"]+", "/s/<session key>", text)


async def sweep(manager: SessionManager, every_s: float, after: Callable[[], None] | None = None) -> None:
    """Background task: end idle sessions forever; ``after`` runs after each pass."""
    while True:
        await asyncio.sleep(every_s)
        await manager.expire_idle()
        if after is not None:
            after()
