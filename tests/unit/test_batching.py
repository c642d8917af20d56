"""GroupBuffer: whole groups, whole batches, dropped groups, timeouts, exactly once across restarts."""

from __future__ import annotations

import random

import pytest

from rlgate.training.batching import GroupBuffer


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def records(spec):
    """spec: (task, session, reward) triples, in arrival order; seq numbers follow."""
    return [
        {"seq": i, "task_id": task, "session_id": session, "reward": reward}
        for i, (task, session, reward) in enumerate(spec, start=1)
    ]


def sessions_of(group):
    return sorted(group.sessions)


def test_interleaved_tasks_make_whole_groups_and_an_exact_batch():
    buffer = GroupBuffer(batch_size=4, group_size=2)
    buffer.add(records([("a", "s1", 1.0), ("b", "s2", 0.0), ("a", "s3", 0.0)]))
    assert buffer.take() is None  # one complete group (a) holds 2 of the 4 sessions
    buffer.add([{"seq": 4, "task_id": "b", "session_id": "s4", "reward": 1.0}])
    batch = buffer.take()
    assert [g.task_id for g in batch.groups] == ["a", "b"] and batch.partial == []
    assert [sessions_of(g) for g in batch.groups] == [["s1", "s3"], ["s2", "s4"]]
    assert batch.sessions == 4 and buffer.take() is None


def test_all_records_of_a_session_stay_in_its_group():
    buffer = GroupBuffer(batch_size=2, group_size=2)
    buffer.add(records([("t", "s1", 0.5), ("t", "s1", 1.0), ("t", "s2", 0.0)]))  # s1 exported two samples
    [group] = buffer.take().groups
    assert {s: len(r) for s, r in group.sessions.items()} == {"s1": 2, "s2": 1}


def test_a_full_group_makes_a_new_session_start_the_next_group():
    buffer = GroupBuffer(batch_size=2, group_size=2)
    buffer.add(records([("t", "s1", 1.0), ("t", "s2", 0.0), ("t", "s3", 1.0)]))
    assert sessions_of(buffer.take().groups[0]) == ["s1", "s2"]
    assert list(buffer.open["t"].sessions) == ["s3"]


def test_equal_reward_groups_are_dropped_only_when_asked():
    spec = [("t", "s1", 1.0), ("t", "s2", 1.0), ("u", "s3", 0.0), ("u", "s4", 1.0)]
    dropping = GroupBuffer(batch_size=2, group_size=2, drop_equal_reward_groups=True)
    dropping.add(records(spec))
    assert [g.task_id for g in dropping.take().groups] == ["u"]
    assert dropping.counters.dropped_equal_reward == 2
    keeping = GroupBuffer(batch_size=4, group_size=2)
    keeping.add(records(spec))
    assert [g.task_id for g in keeping.take().groups] == ["t", "u"]


def test_a_group_that_never_fills_joins_the_batch_after_the_timeout():
    clock = Clock()
    buffer = GroupBuffer(batch_size=4, group_size=2, group_timeout_s=60, clock=clock)
    buffer.add(records([("a", "s1", 1.0), ("b", "s2", 0.0), ("b", "s3", 1.0)]))
    clock.now = 59.0
    assert buffer.take() is None
    buffer.add([{"seq": 4, "task_id": "c", "session_id": "s4", "reward": 0.5}])
    clock.now = 61.0  # a (opened at 0) timed out; c (opened at 59) has not
    assert buffer.take() is None  # 2 complete + 1 partial session < 4
    clock.now = 200.0  # c times out too: 2 + 1 + 1 = 4 sessions
    batch = buffer.take()
    assert [g.task_id for g in batch.groups] == ["b"]
    assert [g.task_id for g in batch.partial] == ["a", "c"] and batch.sessions == 4


def test_partial_groups_can_be_dropped_instead():
    clock = Clock()
    buffer = GroupBuffer(batch_size=2, group_size=2, group_timeout_s=10, partial_groups="drop", clock=clock)
    buffer.add(records([("a", "s1", 1.0)]))
    clock.now = 11.0
    buffer.expire()
    assert buffer.counters.dropped_partial == 1 and buffer.flush() is None
    assert buffer.state() == {"watermark": 1, "done_above": []}  # a dropped record is done too


def test_a_group_completes_with_every_record_of_its_last_session():
    # "individual" export: a record per turn, two turns per session, saved together
    spec = [("t", "s1", 1.0), ("t", "s1", 1.0), ("t", "s2", 0.0), ("t", "s2", 0.0)]
    buffer = GroupBuffer(batch_size=2, group_size=2)
    buffer.add(records(spec))
    [group] = buffer.take().groups
    assert {s: [r["seq"] for r in rs] for s, rs in group.sessions.items()} == {"s1": [1, 2], "s2": [3, 4]}
    assert not buffer.open and buffer.state() == {"watermark": 4, "done_above": []}


def test_a_session_may_carry_its_own_group_size():
    buffer = GroupBuffer(batch_size=3, group_size=2)
    spec = [{"seq": i, "task_id": "t", "session_id": f"s{i}", "reward": float(i), "group_size": 3} for i in (1, 2, 3)]
    buffer.add(spec)
    [group] = buffer.take().groups
    assert group.size == 3 and len(group.sessions) == 3


def test_groups_the_trainer_may_not_train_on_are_dropped_and_counted():
    def sampled_by(seq, task, version):  # two prompt tokens, then two tokens sampled by ``version``
        record = {"seq": seq, "task_id": task, "session_id": f"s{seq}", "reward": float(seq % 2)}
        return record | {"loss_mask": [0, 0, 1, 1], "versions": [-1, -1, version, version]}

    buffer = GroupBuffer(batch_size=2, group_size=2)
    # at version 5 with S = 1: "old" was sampled by v3 (too stale), "future" by v6 (a policy
    # discarded by a crash), "mixed" has one session on v4: still trainable
    buffer.add([sampled_by(1, "old", 3), sampled_by(2, "old", 3)])
    buffer.add([sampled_by(3, "future", 6), sampled_by(4, "future", 5)])
    buffer.add([sampled_by(5, "mixed", 3), sampled_by(6, "mixed", 4)])
    batch = buffer.take(version=5, max_staleness=1)
    assert [g.task_id for g in batch.groups] == ["mixed"]
    assert buffer.counters.dropped_stale == 4 and buffer.counters.dropped == 4
    assert buffer.state() == {"watermark": 6, "done_above": []}  # dropped groups are done too


def test_flush_hands_out_what_is_left():
    clock = Clock()
    buffer = GroupBuffer(batch_size=8, group_size=2, group_timeout_s=5, clock=clock)
    buffer.add(records([("a", "s1", 1.0), ("a", "s2", 0.0), ("b", "s3", 1.0)]))
    clock.now = 6.0
    batch = buffer.flush()
    assert [g.task_id for g in batch.groups] == ["a"] and [g.task_id for g in batch.partial] == ["b"]
    assert buffer.flush() is None


def test_every_record_is_used_exactly_once_across_a_restart():
    rng = random.Random(3)
    spec = [(f"task{rng.randrange(5)}", f"s{i}", float(rng.random() < 0.5)) for i in range(60)]
    log = records(spec)
    settings = {"batch_size": 4, "group_size": 2}
    first = GroupBuffer(**settings)
    first.add(log[:35])
    before = [b for b in iter(first.take, None)]
    # The trainer checkpoints, dies, and restarts: it reads the log again from the watermark.
    state = first.state()
    assert len(state["done_above"]) < 35  # the state stays small
    second = GroupBuffer.restore(state, **settings)
    second.add([r for r in log if r["seq"] > state["watermark"]])
    after = [b for b in iter(second.take, None)]
    leftover = second.flush()
    used = [r["seq"] for b in before + after + ([leftover] if leftover else []) for r in b.records]
    unfinished = [r["seq"] for g in second.open.values() for r in g.records]
    assert sorted(used + unfinished) == list(range(1, 61))  # nothing lost ...
    assert len(set(used)) == len(used)  # ... nothing twice


def failed(seq, task, session):
    return {"seq": seq, "task_id": task, "session_id": session, "reward": 0.0, "failed": True}


def test_a_failed_session_completes_its_group_and_fills_its_batch_slot():
    buffer = GroupBuffer(batch_size=4, group_size=2)
    buffer.add(records([("a", "s1", 1.0), ("b", "s2", 0.0), ("b", "s3", 1.0)]))
    assert buffer.take() is None
    buffer.add([failed(4, "a", "s4")])  # a's second episode failed: the group does not wait for it
    batch = buffer.take()
    assert [(g.task_id, sessions_of(g), sorted(g.failed)) for g in batch.groups] == [
        ("b", ["s2", "s3"], []),
        ("a", ["s1"], ["s4"]),
    ]
    assert [r["seq"] for r in batch.records] == [2, 3, 1]  # the marker is never trained on
    assert (batch.sessions, batch.failed, buffer.counters.failed, buffer.counters.dropped) == (3, 1, 1, 0)
    assert buffer.state() == {"watermark": 4, "done_above": []}  # the marker is consumed with its group


def test_a_group_of_failures_hands_its_slots_back():
    buffer = GroupBuffer(batch_size=2, group_size=2)
    buffer.add([failed(1, "a", "s1"), failed(2, "a", "s2")])
    assert buffer.take() is None and buffer.counters.dropped_failed == 2 and buffer.counters.dropped == 2
    assert buffer.state() == {"watermark": 2, "done_above": []}
    clock = Clock()  # and one that times out short
    buffer = GroupBuffer(batch_size=2, group_size=3, group_timeout_s=10, clock=clock)
    buffer.add([failed(1, "a", "s1")])
    clock.now = 11
    assert buffer.take() is None and buffer.counters.dropped_failed == 1


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="at least 1"):
        GroupBuffer(batch_size=0, group_size=2)


def test_a_group_begun_before_a_resume_with_the_stopped_runs_later_policy_is_never_trained():
    """Stopped at version 7, resumed from its checkpoint at 5: a session the
    stopped run saved at version 7 (or had open, and the resumed run's store
    ended as "restart") was sampled from weights the resume abandoned. Its
    group, completed after the resume, is dropped whatever version the resumed
    run has reached by then (7 again: not the same 7)."""

    def sampled_by(seq, task, version):
        record = {"seq": seq, "task_id": task, "session_id": f"s{seq}", "reward": float(seq % 2)}
        return record | {"loss_mask": [0, 1, 1], "versions": [-1, version, version]}

    state = {"watermark": 0, "done_above": []}
    buffer = GroupBuffer.restore(state, backlog_end=2, resumed_version=5, batch_size=2, group_size=2)
    buffer.add([sampled_by(1, "kept", 5), sampled_by(2, "abandoned", 7)])  # the backlog
    assert buffer.take(version=5, max_staleness=2) is None  # both groups still open
    buffer.add([sampled_by(3, "kept", 6), sampled_by(4, "abandoned", 7)])  # saved after the resume
    # a session open when the run stopped, ended by the resumed run's store ("restart"): sampled before
    buffer.add([sampled_by(5, "orphaned", 7) | {"end_reason": "restart"}, sampled_by(6, "orphaned", 7)])
    batch = buffer.take(version=7, max_staleness=2)
    assert [g.task_id for g in batch.groups] == ["kept"]
    assert buffer.counters.dropped_stale == 4 and buffer.counters.discardable == 4  # s4, s5, s6: saved since,
    assert buffer.counters.carried == 2  # and s2: the backlog's s1 and s2 were counted when their groups filled


def test_a_resumed_runs_backlog_counts_each_member_once_its_group_leaves_filling():
    """The stopped run's sessions (``seq <= backlog_end``) were admitted by its own
    CapacityActor: the resumed run counts each once its group is whole or timed
    out (``carried``), never while it fills (its missing members may never
    come), and hands a counted member back when its group is dropped."""
    now = [0.0]
    state = {"watermark": 0, "done_above": []}
    settings = {"batch_size": 8, "group_size": 2, "drop_equal_reward_groups": True, "clock": lambda: now[0]}
    buffer = GroupBuffer.restore(state, backlog_end=6, resumed_version=2, group_timeout_s=10, **settings)

    def sampled(seq, task, reward=None):
        reward = float(seq % 2) if reward is None else reward
        record = {"seq": seq, "task_id": task, "session_id": f"s{seq}", "reward": reward}
        return record | {"loss_mask": [1], "versions": [2]}

    buffer.add([sampled(1, "whole"), sampled(2, "whole"), sampled(3, "equal", 1.0), sampled(4, "equal", 1.0)])
    buffer.add([sampled(5, "filling"), sampled(6, "alone")])
    assert buffer.counters.carried == 4  # whole and equal; equal's two dropped, and handed back as counted
    assert buffer.counters.dropped_equal_reward == 2 and buffer.counters.discardable == 2
    buffer.add([sampled(7, "filling", 0.0), sampled(8, "fresh"), sampled(9, "fresh")])
    assert buffer.counters.carried == 5  # s5 with its group; s7, s8 and s9 are this run's own
    now[0] = 10.0
    batch = buffer.flush()  # "alone" timed out: partial, and counted
    assert buffer.counters.carried == 6 and [g.task_id for g in batch.partial] == ["alone"]
    assert [g.task_id for g in batch.groups] == ["whole", "filling", "fresh"]


def test_a_session_the_resumed_runs_stores_take_back_is_never_carried_but_handed_back_when_dropped():
    """Open when the run stopped, its save perhaps on the disk already: the resumed
    run's store takes it back from the journal and the CapacityActor counts it when
    it ends. Carried as well, it would count twice (a synchronous run short of a
    group for good); dropped, it is handed back all the same."""
    state = {"watermark": 0, "done_above": []}
    settings = {"batch_size": 4, "group_size": 2, "drop_equal_reward_groups": True}
    buffer = GroupBuffer.restore(state, backlog_end=4, resumed_version=2, reopened=frozenset({"s2", "s4"}), **settings)

    def sampled(seq, task, reward):
        record = {"seq": seq, "task_id": task, "session_id": f"s{seq}", "reward": reward}
        return record | {"loss_mask": [1], "versions": [2]}

    buffer.add([sampled(1, "kept", 1.0), sampled(2, "kept", 0.0), sampled(3, "equal", 1.0), sampled(4, "equal", 1.0)])
    assert buffer.counters.carried == 2  # s1 and s3; s2 and s4 are counted by the actor when they end
    assert buffer.counters.dropped_equal_reward == 2 and buffer.counters.discardable == 2  # s3 and s4
