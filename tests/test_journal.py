"""The SessionStore's journal: a restarted store gets back exactly the open
sessions (completions, rewards, keys) and the recently ended keys."""

from __future__ import annotations

import asyncio

from rlgate.journal import SessionJournal
from rlgate.sessions import SessionError, SessionManager
from rlgate.trajectory import Interaction


class Slots:
    def __init__(self) -> None:
        self.running = 0

    async def acquire(self, timeout_s: float = 0.0, task_id=None, group_size=None) -> bool:
        self.running += 1
        return True

    async def release(self, accepted: bool) -> None:
        self.running -= 1


def manager(journal: SessionJournal, saved: list) -> SessionManager:
    async def persist(records):
        saved.extend(records)

    return SessionManager(Slots(), persist, journal=journal)


def turn(i: int, parent: Interaction | None = None) -> Interaction:
    prompt = (parent.sequence if parent else [1, 2]) + [10 + i]
    return Interaction(f"c{i}", prompt, [20 + i, 21 + i], [-0.5, -0.25], [0, 0], "stop", parent=parent and parent.id)


def test_a_restarted_store_resumes_open_sessions_and_remembers_ended_keys(tmp_path):
    path = tmp_path / "journal.jsonl"
    saved: list = []

    async def before_the_crash():
        first = manager(SessionJournal(path), saved)
        a = await first.start("task-a", "hash-a", group_size=4)
        first.begin("hash-a", [])
        first.record(a, [turn(0)])
        parent = first.sessions[a].trajectory.interactions["c0"]
        first.begin("hash-a", [])
        first.record(a, [turn(1, parent)])
        first.set_reward("hash-a", 0.75, "c1")
        b = await first.start("task-b", "hash-b")
        first.begin("hash-b", [])
        first.record(b, [turn(2)])
        assert await first.end("hash-b") == 1
        await first.start("eval", "hash-e", train=False)
        return a, first

    a, first = asyncio.run(before_the_crash())
    with open(path, "a") as handle:
        handle.write('{"op": "record", "id": "')  # the process died mid-line

    second = manager(SessionJournal(path), [])
    assert second.restore() == 1  # one open training session holds a slot; the evaluation session none
    assert set(second.sessions) == set(first.sessions)
    restored, original = second.sessions[a], first.sessions[a]
    assert restored.task_id == "task-a" and restored.group_size == 4 and restored.train
    assert [asdict_of(i) for i in restored.trajectory.interactions.values()] == [
        asdict_of(i) for i in original.trajectory.interactions.values()
    ]
    assert restored.trajectory.interactions["c1"].reward == 0.75
    # the restored session goes on: rewarded, ended, exported as it would have been
    assert second.set_reward("hash-a", 1.0, None) == "c1"
    exported: list = []
    second.persist = _collect(exported)
    assert asyncio.run(second.end("hash-a")) == 2
    assert [r["reward"] for r in exported] == [1.0, 1.0]  # the reward flows back to the first turn
    # the ended key answers 410, an unknown key 401, after the restart too
    for key, status in (("hash-b", 410), ("hash-x", 401)):
        try:
            second.set_reward(key, 1.0, None)
        except SessionError as err:
            assert err.status == status
        else:
            raise AssertionError(f"{key} was accepted")
    # compaction keeps exactly what is live
    third = manager(SessionJournal(path), [])
    third.restore()
    assert set(third.sessions) == set(second.sessions) and "hash-a" in third._ended


def test_the_journal_compacts_itself_to_what_is_open(tmp_path):
    path = tmp_path / "journal.jsonl"
    journal = SessionJournal(path, compact_bytes=4096)
    store = manager(journal, [])

    async def churn():
        for i in range(100):
            await store.start(f"t{i}", f"h{i}")
            store.begin(f"h{i}", [])
            store.record(store._by_key[f"h{i}"], [turn(i)])
            if i % 10:
                await store.end(f"h{i}")

    asyncio.run(churn())
    assert path.stat().st_size < 20_000  # about ten open sessions' worth, not a hundred
    restored = manager(SessionJournal(path), [])
    assert restored.restore() == 10 and set(restored.sessions) == set(store.sessions)


def asdict_of(interaction: Interaction) -> dict:
    from dataclasses import asdict

    return asdict(interaction)


def _collect(into: list):
    async def persist(records):
        into.extend(records)

    return persist


def test_any_text_python_holds_is_journaled(tmp_path):
    path = tmp_path / "journal.jsonl"
    store = manager(SessionJournal(path), [])
    asyncio.run(store.start("lone \ud800 surrogate", "h"))  # JSON allows it; UTF-8 does not
    restored = manager(SessionJournal(path), [])
    assert restored.restore() == 1
    [session] = restored.sessions.values()
    assert session.task_id == "lone \ud800 surrogate"
