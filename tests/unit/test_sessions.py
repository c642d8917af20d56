"""SessionManager with a fake capacity and a fake persist: lifecycle, refresh, errors, timeouts."""

from __future__ import annotations

import asyncio
import hashlib
import pickle
import time

import pytest

from rlgate.sessions import manager as sessions
from rlgate.sessions.manager import SessionError, SessionManager, hash_key, new_session_key, same_secret, sweep
from rlgate.sessions.trajectory import Interaction


class FakeCapacity:
    """``slots`` concurrent sessions; ``closed`` refuses everything; ``delay`` makes acquire yield."""

    def __init__(self, slots: int = 10, delay: float = 0.0) -> None:
        self.slots, self.delay, self.used, self.closed = slots, delay, 0, False
        self.releases: list[bool] = []

    async def acquire(self, timeout_s: float = 0.0, task_id: str | None = None, group_size: int | None = None) -> bool:
        if self.delay:
            await asyncio.sleep(self.delay)
        deadline = time.monotonic() + timeout_s
        while self.closed or self.used >= self.slots:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.005)
        self.used += 1
        return True

    async def release(self, accepted: bool) -> None:
        self.used -= 1
        self.releases.append(accepted)


class FakePersist:
    def __init__(self, fail_times: int = 0) -> None:
        self.records: list[dict] = []
        self.calls, self.fail_times = 0, fail_times

    async def __call__(self, records: list[dict]) -> None:
        self.calls += 1
        if self.fail_times:
            self.fail_times -= 1
            raise OSError("disk full")
        self.records.extend(records)


def make_manager(slots=10, delay=0.0, fail_times=0, **kwargs):
    capacity, persist = FakeCapacity(slots, delay), FakePersist(fail_times)
    return SessionManager(capacity, persist, **kwargs), capacity, persist


def turn(id, prompt=(1, 2), completion=(3,), parent=None, key=None):
    return Interaction(
        id,
        list(prompt),
        list(completion),
        [-0.5] * len(completion),
        [0] * len(completion),
        "stop",
        parent=parent,
        key=key,
    )


def gated_saves(m: SessionManager, persist: FakePersist) -> tuple[asyncio.Event, asyncio.Event]:
    """Make ``m``'s saves wait at a gate: (set when a save reaches it, what opens it)."""
    saving, go_on = asyncio.Event(), asyncio.Event()

    async def gated(records):
        saving.set()
        await go_on.wait()
        await persist(records)

    m.persist = gated
    return saving, go_on


async def expect_error(status, awaitable_or_call, match=None):
    with pytest.raises(SessionError) as info:
        result = awaitable_or_call()
        if asyncio.iscoroutine(result):
            await result
    assert info.value.status in (status if isinstance(status, tuple) else (status,)), info.value.message
    if match:
        assert match in info.value.message
    return info.value


async def test_start_then_429_without_capacity():
    m, capacity, _ = make_manager(slots=1, retry_after_s=2.5)
    session_id = await m.start("task", "k1")
    assert session_id.startswith("sess-")
    err = await expect_error(429, lambda: m.start("task", "k2"), match="no capacity")
    assert err.retry_after == 2.5
    assert (m.counters["started"], m.counters["rejected"], capacity.used) == (1, 1, 1)
    assert m.begin("k1", []) == (session_id, None)
    await expect_error(401, lambda: m.begin("k2", []))


async def test_start_may_wait_for_capacity():
    m, _, _ = make_manager(slots=1)
    first = await m.start("task", "k1")
    waiting = asyncio.ensure_future(m.start("task", "k2", wait_s=30.0))
    await asyncio.sleep(0.05)
    assert not waiting.done()  # a long poll, not a 429
    await m.end("k1")
    assert (await asyncio.wait_for(waiting, 5)).startswith("sess-") and first != waiting.result()
    await expect_error(429, lambda: m.start("task", "k3", wait_s=0.05), match="within 0.05 s")


async def test_refresh_ends_the_old_session_and_starts_a_new_one():
    m, capacity, persist = make_manager(slots=1)
    old = await m.start("task", "k")
    m.record(old, [turn("i1")])
    new = await m.start("task", "k", refresh_key_hash="k")
    assert new != old and new.startswith("sess-")
    assert [(r["session_id"], r["interaction_ids"], r["end_reason"], r["reward"]) for r in persist.records] == [
        (old, ["i1"], "refreshed", 0.0)
    ]
    assert m.begin("k", []) == (new, None)  # same key, new session
    assert m.sessions[new].key_hash == "k"
    await expect_error(410, lambda: m.record(old, [turn("i2")]))
    assert capacity.releases == [True] and capacity.used == 1
    assert m.stats()["open_sessions"] == 1
    assert (m.counters["refreshed"], m.counters["started"], m.counters["ended"]) == (1, 2, 1)


async def test_refresh_of_unknown_key_is_401():
    m, capacity, _ = make_manager()
    await expect_error(401, lambda: m.start("task", "k", refresh_key_hash="k"), match="unknown api_key")
    assert capacity.used == 0 and m.sessions == {}


async def test_concurrent_refreshes_of_one_key():
    m, capacity, persist = make_manager(slots=1, delay=0.05, refresh_timeout_s=1.0)  # acquire waits: they overlap
    old = await m.start("task", "k")
    m.record(old, [turn("i1")])
    results = await asyncio.gather(
        m.start("task", "k", refresh_key_hash="k"),
        m.start("task", "k", refresh_key_hash="k"),
        return_exceptions=True,
    )
    winners = [r for r in results if isinstance(r, str)]
    losers = [r for r in results if isinstance(r, SessionError)]
    assert len(winners) == 1 and len(losers) == 1, results
    assert losers[0].status == 409
    assert list(m.sessions) == winners and m.begin("k", [])[0] == winners[0]
    assert capacity.used == 1 and capacity.releases == [True]
    assert len(persist.records) == 1  # the old session exported once


async def test_refresh_without_capacity_is_429_and_says_the_old_session_ended():
    m, capacity, persist = make_manager(slots=1, refresh_timeout_s=0.05, retry_after_s=3.0)
    old = await m.start("task", "k")
    m.record(old, [turn("i1")])
    capacity.closed = True
    started = time.monotonic()
    err = await expect_error(
        429, lambda: m.start("task", "k", refresh_key_hash="k"), match="previous session of this key was ended"
    )
    assert time.monotonic() - started >= 0.05
    assert err.retry_after == 3.0
    assert [r["end_reason"] for r in persist.records] == ["refreshed"]
    assert m.sessions == {} and capacity.used == 0
    await expect_error(410, lambda: m.begin("k", []))
    capacity.closed = False  # retrying the refresh with the same key works
    new = await m.start("task", "k", refresh_key_hash="k")
    assert m.begin("k", [])[0] == new


async def test_a_failed_session_is_saved_as_one_marker_with_no_tokens():
    m, capacity, persist = make_manager()
    sid = await m.start("task", "k", group_size=4)
    m.record(sid, [turn("i1", key="x1")])
    assert await m.end("k", failed=True) == 1
    [marker] = persist.records
    assert (marker["session_id"], marker["task_id"], marker["failed"], marker["end_reason"]) == (
        sid,
        "task",
        True,
        "failed",
    )
    assert marker["input_ids"] == marker["loss_mask"] == marker["interaction_ids"] == [] and marker["group_size"] == 4
    # it took a slot like any finished session; the trainer hands the slot back if it drops the group
    assert capacity.releases == [True] and (m.counters["ended"], m.counters["failed"]) == (1, 1)
    await expect_error(410, lambda: m.begin("k", []))
    await m.start("task", "k2")
    await m.end("k2", failed=True)  # a session that failed before its first completion is marked too
    assert [r["failed"] for r in persist.records] == [True, True] and capacity.releases == [True, True]


async def test_an_evaluation_session_takes_no_slot_and_saves_nothing():
    m, capacity, persist = make_manager(slots=1)
    await m.start("task", "busy")  # the only slot is taken
    sid = await m.start("eval-seed-3", "k", train=False)
    m.record(sid, [turn("i1")])
    m.set_reward("k", 1.0, None)
    assert await m.end("k") == 1
    assert persist.records == [] and capacity.releases == [] and m.counters["evaluated"] == 1
    await expect_error(400, lambda: m.start("task", "k", refresh_key_hash="k", train=False), match="new key")


async def test_turn_rewards_go_to_completions_in_order_and_the_outcome_to_the_latest():
    m, _, persist = make_manager(export_style="individual")
    sid = await m.start("task", "k")
    m.record(sid, [turn("i1", key="x1"), turn("i2", parent="i1", prompt=(1, 2, 3, 4), key="x2"), turn("i3")])
    assert m.set_reward("k", 1.0, None, turn_rewards=[0.1, 0.2]) == "i3"
    await expect_error(409, lambda: m.set_reward("k", 1.0, None, turn_rewards=[0.0] * 4), match="4 turn rewards")
    await m.end("k")
    assert {r["interaction_ids"][0]: r["rewards"][0] for r in persist.records} == {
        "i1": pytest.approx(0.1 + 0.2),  # its own plus its child's (turn_discount 1)
        "i2": pytest.approx(0.2),
        "i3": 1.0,
    }
    sid = await m.start("task", "k2")
    m.record(sid, [turn("j1"), turn("j2")])
    m.set_reward("k2", 0.5, None, turn_rewards=[0.1, 0.2])  # a turn reward for every completion: both on the latest
    await m.end("k2")
    assert [r["rewards"][0] for r in persist.records[3:]] == [pytest.approx(0.1), pytest.approx(0.7)]


async def test_end_then_410_for_that_key():
    m, capacity, persist = make_manager()
    sid = await m.start("task", "k")
    m.record(sid, [turn("i1", key="x1"), turn("i2", key="x2")])
    assert await m.end("k") == 2
    assert [r["end_reason"] for r in persist.records] == ["ended", "ended"]
    await expect_error(410, lambda: m.begin("k", []), match="ended")
    await expect_error(410, lambda: m.set_reward("k", 1.0, None))
    await expect_error(410, lambda: m.end("k"))
    await expect_error(410, lambda: m.record(sid, [turn("i3")]))
    assert capacity.releases == [True]


async def test_unknown_key_is_401():
    m, _, _ = make_manager()
    await m.start("task", "k")
    await expect_error(401, lambda: m.begin("other", []), match="invalid API key")
    await expect_error(401, lambda: m.set_reward("other", 1.0, None))
    await expect_error(401, lambda: m.end("other"))
    await expect_error(410, lambda: m.record("sess-unknown", [turn("i1")]))


async def test_begin_finds_the_parent_and_set_reward_errors():
    m, _, persist = make_manager()
    sid = await m.start("task", "k")
    await expect_error(409, lambda: m.set_reward("k", 1.0, None), match="no completions")
    m.record(sid, [turn("i1", prompt=[1, 2], completion=[3, 4], key="x1")])
    session_id, parent = m.begin("k", ["zz", "x1"])
    assert session_id == sid
    assert (parent.interaction_id, parent.key, parent.sequence, parent.last_token) == ("i1", "x1", [1, 2, 3, 4], [4])
    assert m.set_reward("k", 2.0, None) == "i1"
    await expect_error(404, lambda: m.set_reward("k", 1.0, "nope"))
    await m.end("k")
    assert persist.records[0]["reward"] == 2.0


async def test_persist_failure_keeps_the_session_and_loses_nothing():
    m, capacity, persist = make_manager(fail_times=1)
    sid = await m.start("task", "k")
    m.record(sid, [turn("i1", key="x1"), turn("i2", key="x2")])
    err = await expect_error(503, lambda: m.end("k"), match="still open")
    assert capacity.releases == [] and m.counters["ended"] == 0 and m.counters["exported"] == 0
    # still open, but closed to changes: the failed save may have reached the disk, and the
    # retried end must export the same thing (the store keeps a session it holds once)
    await expect_error(409, lambda: m.begin("k", ["x2"]), match="end_session again")
    await expect_error(409, lambda: m.set_reward("k", 5.0, None), match="end_session again")
    assert m.stats()["open_interactions"] == 2
    assert await m.end("k") == 2
    assert sorted(r["interaction_ids"][0] for r in persist.records) == ["i1", "i2"]
    assert persist.calls == 2 and capacity.releases == [True]
    assert (m.counters["ended"], m.counters["exported"]) == (1, 2)
    assert err.status == 503


async def test_refresh_with_persist_failure_keeps_the_old_session():
    m, capacity, persist = make_manager(fail_times=1)
    old = await m.start("task", "k")
    m.record(old, [turn("i1")])
    await expect_error(503, lambda: m.start("task", "k", refresh_key_hash="k"))
    assert capacity.used == 1 and old in m.sessions
    await expect_error(409, lambda: m.begin("k", []))  # only ending it again is allowed
    new = await m.start("task", "k", refresh_key_hash="k")  # the lock on the key was released
    assert new != old and [r["interaction_ids"] for r in persist.records] == [["i1"]]


async def test_expire_idle_ends_idle_sessions_only():
    m, capacity, persist = make_manager(session_timeout_s=0.05)
    idle = await m.start("task", "idle")
    m.record(idle, [turn("i1")])
    await m.start("task", "idle-empty")
    active = await m.start("task", "active")
    await asyncio.sleep(0.08)
    m.begin("active", [])  # a request keeps it alive
    assert await m.expire_idle() == 2
    assert [(r["session_id"], r["end_reason"]) for r in persist.records] == [(idle, "timeout")]
    assert persist.calls == 1  # an empty session persists nothing
    assert sorted(capacity.releases) == [False, True]
    await expect_error(410, lambda: m.begin("idle", []))
    await expect_error(410, lambda: m.begin("idle-empty", []))
    assert m.begin("active", [])[0] == active
    assert (m.counters["expired"], m.counters["ended"]) == (2, 2)
    assert await m.expire_idle() == 0


async def test_a_request_in_flight_keeps_its_session_from_expiring(monkeypatch):
    m, _, persist = make_manager(session_timeout_s=0.05)
    a, b = await m.start("task", "a"), await m.start("task", "b")
    m.begin("a", [])  # a completion is being generated for a, and one for b
    m.begin("b", [])
    await asyncio.sleep(0.08)
    assert await m.expire_idle() == 0
    m.record(a, [turn("a1")])  # a's request is over; b's is abandoned (e.g. the client went away)
    m.abandon(b)
    assert await m.expire_idle() == 0  # idle time counts from the end of the request
    await asyncio.sleep(0.08)
    assert await m.expire_idle() == 2
    assert [r["end_reason"] for r in persist.records] == ["timeout"]
    monkeypatch.setattr(sessions, "MAX_REQUEST_S", 0.05)  # a request that never reports back pins it only so long
    await m.start("task", "c")
    m.begin("c", [])
    await asyncio.sleep(0.08)
    assert await m.expire_idle() == 1 and m.sessions == {}


async def test_sweep_survives_a_persist_failure():
    """The background sweep ends idle sessions "forever": one failed save must neither
    stop it nor keep the other idle sessions open; the failed one is retried later."""
    m, capacity, persist = make_manager(session_timeout_s=0.05, fail_times=1)
    for key in ("a", "b"):
        m.record(await m.start("task", key), [turn(key + "1")])
    task = asyncio.create_task(sweep(m, 0.02))
    try:
        await asyncio.sleep(0.3)
        assert not task.done(), task.exception()
        assert sorted(r["interaction_ids"][0] for r in persist.records) == ["a1", "b1"]
        assert m.sessions == {} and capacity.releases == [True, True]
    finally:
        task.cancel()


async def test_capacity_released_once_per_ended_session():
    m, capacity, persist = make_manager(slots=3, fail_times=1)
    a = await m.start("task", "a")
    await m.start("task", "b")
    c = await m.start("task", "c")
    m.record(a, [turn("a1")])
    m.record(c, [turn("c1")])
    await expect_error(503, lambda: m.end("a"))  # failed persist: nothing released
    assert capacity.releases == []
    assert await m.end("a") == 1
    assert await m.end("b") == 0
    await m.close_all()
    assert capacity.releases == [True, False, True] and capacity.used == 0
    assert [r["end_reason"] for r in persist.records] == ["ended", "shutdown"]
    await expect_error(410, lambda: m.end("c"))
    assert capacity.releases == [True, False, True]


async def test_stats_counters():
    m, capacity, _ = make_manager(slots=2)
    s1 = await m.start("task", "k1")
    await m.start("task", "k2")
    await expect_error(429, lambda: m.start("task", "k3"))
    m.record(s1, [turn("i1"), turn("i2")])
    await m.start("task", "k1", refresh_key_hash="k1")
    assert m.stats() == {
        "open_sessions": 2,
        "open_interactions": 0,
        "started": 3,
        "ended": 1,
        "failed": 0,
        "expired": 0,
        "refreshed": 1,
        "rejected": 1,
        "exported": 2,
        "evaluated": 0,
    }


async def test_requests_during_an_ending_session_are_not_told_the_key_is_invalid():
    """While a session's trajectory is being persisted its key is still a real key: a
    request or a refresh with it must hear that the session is ending/ended (409/410),
    not "invalid API key" (401), which clients treat as a bad credential."""
    gate = asyncio.Event()

    async def slow_persist(records):
        await gate.wait()

    m = SessionManager(FakeCapacity(), slow_persist)
    sid = await m.start("task", "k")
    m.record(sid, [turn("i1")])
    ending = asyncio.create_task(m.end("k"))
    await asyncio.sleep(0.01)
    try:
        await expect_error((409, 410), lambda: m.begin("k", []))
        await expect_error((409, 410), lambda: m.end("k"))
        await expect_error((409, 410), lambda: m.start("task", "k", refresh_key_hash="k"))
    finally:
        gate.set()
        assert await ending == 1


def test_hash_key_and_same_secret():
    assert hash_key("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    key = new_session_key()
    assert key.startswith("rlg-") and len(key) == 4 + 43 and key != new_session_key()
    assert hash_key(key) == hashlib.sha256(key.encode()).hexdigest()
    assert same_secret("s3cret", "s3cret")
    assert not same_secret("s3cret", "s3creT") and not same_secret("s3cret", "s3cret ")


def test_session_error_survives_pickling():
    err = pickle.loads(pickle.dumps(SessionError(429, "busy", 5.0)))
    assert isinstance(err, SessionError)
    assert (err.status, err.message, err.retry_after, str(err)) == (429, "busy", 5.0, "busy")
    err = pickle.loads(pickle.dumps(SessionError(401, "who")))
    assert (err.status, err.message, err.retry_after) == (401, "who", None)


async def test_a_session_group_size_is_carried_into_its_records():
    manager, _, persist = make_manager()
    sized, plain = hash_key("sized"), hash_key("plain")
    sized_id = await manager.start("t", sized, group_size=3)
    plain_id = await manager.start("t", plain)
    for session_id in (sized_id, plain_id):
        manager.begin(sized if session_id == sized_id else plain, [])
        manager.record(session_id, [turn(f"{session_id}-c")])
    await manager.end(sized)
    await manager.end(plain)
    by_session = {r["session_id"]: r for r in persist.records}
    assert by_session[sized_id]["group_size"] == 3
    assert "group_size" not in by_session[plain_id]


def test_every_generated_key_is_256_random_bits(monkeypatch):
    import base64

    from rlgate.serving.app import admin_key

    monkeypatch.delenv("RLGATE_ADMIN_KEY", raising=False)
    monkeypatch.delenv("RLGATE_ADMIN_KEY_FILE", raising=False)
    generated, made = admin_key("127.0.0.1")
    assert made
    # session keys, RL job keys (the JobManager's new_key("rlg-job-")), a job's admin key, the gateway's own
    for prefix, key in [
        ("rlg-", new_session_key()),
        ("rlg-job-", sessions.new_key("rlg-job-")),
        ("rlg-admin-", generated),
    ]:
        assert key.startswith(prefix)
        assert len(base64.urlsafe_b64decode(key.removeprefix(prefix) + "=")) == 32


def test_keys_are_compared_as_sha256_digests_in_constant_time(monkeypatch):
    """The admin key is checked by its digest with hmac.compare_digest; session
    keys are looked up by digest, so no raw key is ever kept or compared."""
    import hmac

    from rlgate.serving.auth import Auth

    compared = []
    real = hmac.compare_digest
    monkeypatch.setattr(sessions.hmac, "compare_digest", lambda a, b: compared.append((a, b)) or real(a, b))
    admin = "rlgate-admin-key-for-this-test"
    auth = Auth(hash_key(admin))
    assert auth.is_admin(admin) and not auth.is_admin("rlgate-admin-key-for-this-tesT")
    assert len(compared) == 2 and all(admin.encode() not in pair for pair in compared)
    assert all(len(a) == len(b) == 64 for a, b in compared)  # hex SHA-256 both sides
    key = new_session_key()
    assert auth.session_key(f"Bearer {key}") == hash_key(key) != key


async def test_an_end_whose_caller_is_cancelled_mid_save_still_finishes():
    """A client that hangs up while its session is being saved cancels the request
    (Serve cancels a replica's handler on disconnect): the save, the end and the
    slot's release go on regardless, so the retried end finds the session ended,
    not an unknown key, and nothing is left half-ended."""
    m, capacity, persist = make_manager()
    saving, go_on = gated_saves(m, persist)
    a = await m.start("task", "a")
    m.record(a, [turn("a1")])
    ending = asyncio.ensure_future(m.end("a"))
    await saving.wait()
    ending.cancel()
    await expect_error(409, lambda: m.begin("a", []))  # being ended right now
    go_on.set()
    for _ in range(100):
        if not m.sessions:
            break
        await asyncio.sleep(0.005)
    assert ending.cancelled()
    assert [r["session_id"] for r in persist.records] == [a] and capacity.releases == [True]
    await expect_error(410, lambda: m.end("a"))  # the retried end: ended, saved once


async def test_the_idle_sweep_spares_a_session_that_became_busy_while_it_saved_another():
    m, _, persist = make_manager(session_timeout_s=0.05)
    a, b = await m.start("task", "a"), await m.start("task", "b")
    m.record(a, [turn("a1")])
    await asyncio.sleep(0.08)  # both idle
    saved = persist.__call__

    async def persist_then_b_gets_a_request(records):
        m.begin("b", [])  # b's agent sends a turn while a is being saved
        await saved(records)

    m.persist = persist_then_b_gets_a_request
    assert await m.expire_idle() == 1
    assert list(m.sessions) == [b]
    m.record(b, [turn("b1")])  # its turn is recorded: the session was kept


async def test_a_turn_that_finishes_while_its_session_is_saved_leaves_nothing_in_flight():
    """A completion that comes back while its session is being saved is refused
    (410), and its request is out of flight even if the save then fails and the
    session is put back: it must not look busy to the idle sweep."""
    m, _, persist = make_manager(fail_times=1)
    saving, go_on = gated_saves(m, persist)
    a = await m.start("task", "a")
    m.record(a, [turn("a1")])
    m.begin("a", [])  # a second turn is being generated
    ending = asyncio.ensure_future(m.end("a"))
    await saving.wait()
    await expect_error(410, lambda: m.record(a, [turn("a2")]))
    go_on.set()
    with pytest.raises(SessionError) as failed:
        await ending
    assert failed.value.status == 503  # the save failed: the session is put back
    assert m.sessions[a].requests == [] and len(m.sessions[a].trajectory) == 1
