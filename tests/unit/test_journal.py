"""The SessionStore's journal: a restarted store gets back exactly the open
sessions (completions, rewards, keys) and the recently ended keys."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from rlgate.sessions.journal import SessionJournal, open_session_ids
from rlgate.sessions.manager import SessionError, SessionManager
from rlgate.sessions.trajectory import Interaction
from tests.support import Disk


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
    # what a resumed run's stores will take back, read without replaying the turns (compacted or not)
    assert open_session_ids(tmp_path) == set(store.sessions)


def test_the_sessions_open_in_every_journal_of_a_run_are_found_without_replaying_them(tmp_path):
    """The SessionStore's journal and each colocated replica's (``replica-<n>/``):
    a session ended since it opened is not open; a set-aside journal is not read."""
    store, replica = manager(SessionJournal(tmp_path / "journal.jsonl"), []), None

    async def sessions():
        nonlocal replica
        await store.start("t", "h1")
        await store.start("t", "h2")
        store.begin("h2", [])
        store.record(store._by_key["h2"], [turn(0)])
        await store.end("h2")
        replica = manager(SessionJournal(tmp_path / "replica-1" / "journal.jsonl"), [])
        await replica.start("t", "h3")

    asyncio.run(sessions())
    aside = tmp_path / "journal-20260101-000000.set-aside.jsonl"
    aside.write_text(json.dumps({"op": "open", "id": "old"}) + "\n")
    assert open_session_ids(tmp_path) == set(store.sessions) | set(replica.sessions)
    assert len(open_session_ids(tmp_path)) == 2 and open_session_ids(tmp_path / "missing") == set()


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


def test_a_journal_write_that_fails_refuses_the_change_and_leaves_the_journal_whole(tmp_path):
    path = tmp_path / "journal.jsonl"
    journal = SessionJournal(path)
    store = manager(journal, [])

    async def run():
        a = await store.start("task", "hash-a")
        store.begin("hash-a", [])
        store.record(a, [turn(0)])
        parent = store.sessions[a].trajectory.interactions["c0"]
        disk = Disk(room=10)  # the disk fills: a line starts, then ENOSPC
        journal._file = disk.wrap(journal._file)
        for change in (
            lambda: store.record(a, [turn(1, parent)]),
            lambda: store.set_reward("hash-a", 1.0, None),
        ):
            store.begin("hash-a", [])
            with pytest.raises(SessionError) as refused:
                change()
            assert refused.value.status == 503 and "journal cannot be written" in refused.value.message
        with pytest.raises(SessionError, match="journal cannot be written"):
            await store.start("task", "hash-b")
        # nothing changed: one turn, no reward, no session b, its capacity slot given back
        assert len(store.sessions[a].trajectory) == 1 and parent.reward is None
        assert "hash-b" not in store._by_key and store.capacity.running == 1
        disk.room = None  # space again: the retried turn is noted whole after the failed one
        store.begin("hash-a", [])
        store.record(a, [turn(1, parent)])
        return a

    a = asyncio.run(run())
    restored = manager(SessionJournal(path), [])
    assert restored.restore() == 1
    assert list(restored.sessions[a].trajectory.interactions) == ["c0", "c1"]


def test_a_session_whose_save_was_under_way_takes_no_turns_after_a_restart(tmp_path):
    path = tmp_path / "journal.jsonl"
    saved: list = []

    async def saved_then_lost(records):  # the save reaches the disk, the answer does not
        saved.extend(records)
        raise ConnectionError("the TrajectoryStore died before answering")

    first = SessionManager(Slots(), saved_then_lost, journal=SessionJournal(path))

    async def before_the_crash():
        a = await first.start("task", "hash-a")
        first.begin("hash-a", [])
        first.record(a, [turn(0)])
        with pytest.raises(SessionError, match="could not save"):
            await first.end("hash-a")
        return a

    a = asyncio.run(before_the_crash())
    second = manager(SessionJournal(path), [])
    assert second.restore() == 1 and second.sessions[a].save_failed
    # it takes no new turns (they would be lost: the store holds its save already), only the end
    for change in (lambda: second.begin("hash-a", []), lambda: second.set_reward("hash-a", 1.0, None)):
        with pytest.raises(SessionError, match="call /rl/end_session again") as refused:
            change()
        assert refused.value.status == 409
    # a compaction keeps that, and the retried end exports what was saved before, unchanged
    second.journal.compact(second.sessions.values(), second._ended)
    third = manager(SessionJournal(path), [])
    assert third.restore() == 1 and third.sessions[a].save_failed
    exported: list = []
    third.persist = _collect(exported)
    assert asyncio.run(third.end("hash-a")) == 1
    unstamped = [{k: v for k, v in r.items() if k != "ended_at"} for r in exported + saved]
    assert unstamped[:1] == unstamped[1:]


def test_the_choices_of_one_request_store_their_prompt_once(tmp_path):
    path = tmp_path / "journal.jsonl"
    store = manager(SessionJournal(path), [])
    prompt = list(range(1000, 1400))
    choices = [Interaction(f"c{i}", prompt, [7, i], [-0.5, -0.25], [0, 0], "stop") for i in range(8)]

    async def run():
        a = await store.start("task", "hash-a")
        store.begin("hash-a", [])
        store.record(a, choices)
        return a

    a = asyncio.run(run())
    assert store.sessions[a].stored_tokens == 400 + 8 * 2
    assert path.read_text().count("1399") == 1  # the prompt once, not eight times
    restored = manager(SessionJournal(path), [])
    restored.restore()
    again = list(restored.sessions[a].trajectory.interactions.values())
    assert [i.prompt_ids for i in again] == [prompt] * 8 and len({id(i.prompt_ids) for i in again}) == 1
    assert restored.sessions[a].stored_tokens == 416


def test_a_long_session_journals_each_token_once_and_comes_back_whole(tmp_path):
    """Each turn continues the last: its prompt is the previous prompt and completion
    and a new message. The journal holds each token once (a full prompt a turn would
    write the first message ten times), and replays every prompt whole."""
    path = tmp_path / "journal.jsonl"
    store = manager(SessionJournal(path), [])
    first = list(range(1000, 1400))  # a long first message
    turns, parent = [], None
    for i in range(10):
        prompt = (parent.sequence if parent else first) + list(range(5000 + 100 * i, 5050 + 100 * i))
        parent = Interaction(f"c{i}", prompt, [7, i], [-0.5, -0.25], [0, 0], "stop", parent=parent and parent.id)
        turns.append(parent)

    async def run():
        a = await store.start("task", "hash-a")
        for interaction in turns:
            store.begin("hash-a", [])
            store.record(a, [interaction])
        return a

    a = asyncio.run(run())
    text = path.read_text()
    assert text.count("1399") == 1 and text.count("5949") == 1  # the first message and the last turn's, once
    restored = manager(SessionJournal(path), [])
    restored.restore()
    again = list(restored.sessions[a].trajectory.interactions.values())
    assert [(i.id, i.parent, i.prompt_ids, i.completion_ids) for i in again] == [
        (i.id, i.parent, i.prompt_ids, i.completion_ids) for i in turns
    ]
    assert restored.sessions[a].stored_tokens == store.sessions[a].stored_tokens
    restored.journal.compact(restored.sessions.values(), {})  # compacted, it is written the same way
    assert path.read_text().count("1399") == 1
    again = manager(SessionJournal(path), [])
    again.restore()
    assert [i.prompt_ids for i in again.sessions[a].trajectory.interactions.values()] == [i.prompt_ids for i in turns]


def test_a_record_whose_prompt_does_not_continue_its_parent_is_journaled_whole(tmp_path):
    """A parent named but not continued (the trajectory refuses it): the journal keeps
    the prompt as it was given, so a replay refuses the same thing, nothing more."""
    from rlgate.sessions.journal import _as_continuation

    parent = turn(0)
    assert _as_continuation(turn(1, parent), {"c0": parent}) == {"parent": "c0", "after": [11]}
    stray = Interaction("c1", [1, 2, 99, 20, 21, 11], [5], [-0.1], [0], "stop", parent="c0")
    assert _as_continuation(stray, {"c0": parent}) is None
    assert _as_continuation(turn(1, parent), {}) is None  # a parent it does not know
    assert _as_continuation(turn(1), {"c0": parent}) is None  # no parent


def test_a_session_stops_growing_at_its_limits(tmp_path):
    store = SessionManager(Slots(), _collect([]), max_interactions=3, max_tokens=2000)

    async def run():
        a = await store.start("task", "hash-a")
        store.begin("hash-a", [])
        store.record(a, [turn(0), turn(1)])
        store.begin("hash-a", [])
        with pytest.raises(SessionError) as refused:  # 2 + 2 > 3 completions
            store.record(a, [turn(2), turn(3)])
        assert refused.value.status == 409 and "max_session_interactions (3)" in refused.value.message
        assert len(store.sessions[a].trajectory) == 2  # nothing of the refused turn was kept
        store.begin("hash-a", [])
        long = Interaction("c9", list(range(2000)), [1], [-0.1], [0], "stop")
        with pytest.raises(SessionError) as refused:
            store.record(a, [long])
        assert refused.value.status == 413 and "max_session_tokens (2000)" in refused.value.message
        store.begin("hash-a", [])
        store.record(a, [turn(4)])
        with pytest.raises(SessionError) as full:  # full: refused before anything is generated
            store.begin("hash-a", [])
        assert full.value.status == 409 and "holds 3 completions" in full.value.message
        assert await store.end("hash-a") == 3  # and it ends and saves as usual

    asyncio.run(run())


def test_a_journal_too_big_to_read_back_is_a_clear_error_not_a_restart_loop(tmp_path):
    path = tmp_path / "journal.jsonl"
    first = manager(SessionJournal(path), [])
    asyncio.run(first.start("task", "hash-a"))
    size = path.stat().st_size
    again = manager(SessionJournal(path), [])
    assert again.restore(available_memory=size * 2) == 0  # would not fit: nothing read, nothing raised
    for call in (lambda: asyncio.run(again.start("task", "hash-b")), lambda: again.check("hash-a")):
        with pytest.raises(SessionError) as refused:
            call()
        assert refused.value.status == 503 and "too big to read back" in refused.value.message
        assert str(path) in refused.value.message and "move the file away" in refused.value.message
    assert path.stat().st_size == size  # the journal is left as it was for the operator


def test_a_journal_of_long_sessions_is_judged_by_what_its_continuations_take_back(tmp_path):
    """A continuation is a few tokens on disk but its whole prompt in memory: the
    replay counts what continuations take from their parents as it reads, and stops
    with the same clear error before it would pass the memory there is."""
    from rlgate.sessions.journal import REPLAY_EXPANSION, SLOT_BYTES

    path = tmp_path / "journal.jsonl"
    store = manager(SessionJournal(path), [])
    first = list(range(1000, 3000))
    parent = None

    async def run():
        nonlocal parent
        a = await store.start("task", "hash-a")
        for i in range(20):
            prompt = (parent.sequence if parent else first) + [5000 + i]
            parent = Interaction(f"c{i}", prompt, [7, i], [-0.5, -0.25], [0, 0], "stop", parent=parent and parent.id)
            store.begin("hash-a", [])
            store.record(a, [parent])

    asyncio.run(run())
    size = path.stat().st_size
    turns = list(store.sessions[next(iter(store.sessions))].trajectory.interactions.values())
    shared = sum(len(earlier.sequence) for earlier in turns[:-1])  # each turn's prompt starts with the last's
    needed = size * REPLAY_EXPANSION + SLOT_BYTES * shared
    assert needed > 2 * size * REPLAY_EXPANSION  # the prompts' slots are most of it
    short = manager(SessionJournal(path), [])
    assert short.restore(available_memory=needed - 1) == 0  # read up to the line that would pass it, then refused
    assert not short.sessions and "too big to read back" in short.refusing and "long sessions" in short.refusing
    assert path.stat().st_size == size
    enough = manager(SessionJournal(path), [])  # (restored, it compacts the file)
    assert enough.restore(available_memory=needed) == 1


def test_a_line_it_cannot_apply_costs_that_line_only(tmp_path, caplog):
    path = tmp_path / "journal.jsonl"
    store = manager(SessionJournal(path), [])

    async def run():
        a = await store.start("task", "hash-a")
        store.begin("hash-a", [])
        store.record(a, [turn(0)])
        return a

    a = asyncio.run(run())
    with open(path, "a") as handle:  # damaged lines in the middle: not JSON, and an entry that does not apply
        handle.write('{"op": "record", "id": "\n')
        handle.write(json.dumps({"op": "record", "id": a, "interactions": [{"unknown": 1}]}) + "\n")
        for damaged in (
            {"op": "rewards", "id": a, "rewards": [1]},  # not a mapping
            {"op": "record", "id": a, "prompts": [[1]], "interactions": [{"prompt_ids": 5}]},  # no such prompt
            {"op": "end", "id": "sess-x", "key_hash": "hash-x", "at": "x"},  # not a time
            {"op": "open", "id": "sess-z", "task_id": "t", "key_hash": "hash-z", "created_at": 1.0},  # fields missing
        ):
            handle.write(json.dumps(damaged) + "\n")
    b = asyncio.run(store.start("task", "hash-b"))  # written after them
    restored = manager(SessionJournal(path), [])
    with caplog.at_level(logging.WARNING):
        assert restored.restore() == 2
    assert set(restored.sessions) == {a, b} and list(restored.sessions[a].trajectory.interactions) == ["c0"]
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) >= 6, caplog.text  # one per line
