"""The driver's loop, without Ray: calls to actors that restart in place, reads and
discards (faked), advantages and the loss normaliser."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import ray.exceptions

from rlgate.training import loop


def test_a_call_that_meets_a_restart_is_made_again(monkeypatch):
    monkeypatch.setattr(loop.ray, "get", lambda value: value)
    monkeypatch.setattr(loop.time, "sleep", lambda s: None)
    answers = iter([ray.exceptions.ActorUnavailableError("restarting", None), ray.exceptions.RayActorError(), 7])

    def call():
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert loop.surviving(call, "a read") == 7


def test_an_actor_that_never_comes_back_is_an_error_in_the_end(monkeypatch):
    monkeypatch.setattr(loop.ray, "get", lambda value: value)
    monkeypatch.setattr(loop.time, "sleep", lambda s: None)

    def call():
        raise ray.exceptions.RayActorError()

    with pytest.raises(ray.exceptions.RayActorError):
        loop.surviving(call, "a read", within_s=0.0)


def record(session: str, reward: float, tokens: int, versions: list[int] | None = None) -> dict:
    """A saved trajectory record: a prompt token then ``tokens`` sampled ones."""
    return {
        "session_id": session,
        "reward": reward,
        "input_ids": list(range(tokens + 1)),
        "loss_mask": [0] + [1] * tokens,
        "versions": [0] + (versions or [0] * tokens),
    }


def test_score_compares_within_whole_groups_and_over_the_batch_for_partial_ones():
    from rlgate.training.batching import Batch, Group

    whole = Group("t", 2, sessions={"a": [record("a", 1.0, 2)], "b": [record("b", 0.0, 2)]})
    short = Group("u", 2, sessions={"c": [record("c", 1.0, 2)]})  # timed out with one of two
    records, advantages = loop.score(Batch([whole], [short]), "grpo")
    by_session = dict(zip([r["session_id"] for r in records], advantages))
    assert by_session["a"] > 0 > by_session["b"]
    assert by_session["a"] == pytest.approx(-by_session["b"], abs=1e-9)  # within its group: symmetric
    assert by_session["c"] > 0  # over the batch: above the batch mean of 2/3


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_the_drivers_normaliser_is_the_trainers_denominator_over_the_whole_batch(aggregation):
    """The driver computes it once for every worker's share: it must equal what the
    trainer computes over the whole batch's mask, with stale tokens dropped."""
    import torch

    from rlgate.training.grpo import denominator

    records = [record("a", 1.0, 3, [4, 4, 5]), record("b", 0.0, 5, [5] * 5)]  # version 4 is stale at 6, S=1
    width = max(len(r["input_ids"]) for r in records) - 1
    mask = torch.zeros(len(records), width)
    for row, r in enumerate(records):
        for column, (m, v) in enumerate(zip(r["loss_mask"][1:], r["versions"][1:])):
            mask[row, column] = float(m and v >= 5)
    expected = denominator(aggregation, mask.shape[0], float(mask.sum()), mask.shape[1])
    assert loop.normaliser(records, version=6, max_staleness=1, aggregation=aggregation) == expected
    assert {"token_mean": 6.0, "seq_mean_token_mean": 2.0, "seq_mean_token_sum_norm": 10.0}[aggregation] == expected


class Reads:
    """A TrajectoryStore's ``read``, faked: each call hands out the next list of
    records newer than the seq asked from (then nothing)."""

    def __init__(self, *reads: list[dict]) -> None:
        self.reads, self.asked_after = list(reads), []
        self.read = SimpleNamespace(remote=self._read)

    def _read(self, after: int, limit: int) -> list[dict]:
        self.asked_after.append(after)
        return [r for r in self.reads.pop(0) if r["seq"] > after][:limit] if self.reads else []


class Discards:
    """A CapacityActor's ``discard`` and ``note_accepted``, faked: the counts each was given."""

    def __init__(self) -> None:
        self.given: list[int] = []
        self.carried: list[int] = []
        self.discard = SimpleNamespace(remote=self.given.append)
        self.note_accepted = SimpleNamespace(remote=self.carried.append)


def saved(seq: int, task: str, session: str, reward: float, version: int = 0) -> dict:
    return {**record(session, reward, 2, [version] * 2), "seq": seq, "task_id": task}


def test_collect_waits_for_whole_groups_and_hands_dropped_sessions_back_to_capacity(monkeypatch):
    from rlgate.training.batching import GroupBuffer

    monkeypatch.setattr(loop.ray, "get", lambda value: value)
    buffer = GroupBuffer(batch_size=4, group_size=2, drop_equal_reward_groups=True)
    store = Reads(
        [saved(1, "a", "s1", 1.0), saved(2, "b", "s2", 0.5)],  # two groups begun: no batch yet
        [saved(3, "b", "s3", 0.5), saved(4, "a", "s4", 0.0)],  # b's rewards are equal: dropped
        [saved(5, "c", "s5", 0.0), saved(6, "c", "s6", 1.0)],
    )
    capacity = Discards()
    batch = loop.collect(buffer, store, capacity, threading.Event(), version=0, max_staleness=0, poll_s=0)
    assert [sorted(g.sessions) for g in batch.groups] == [["s1", "s4"], ["s5", "s6"]] and batch.partial == []
    assert store.asked_after == [0, 2, 4]  # each read goes on from the last record read
    assert capacity.given == [2]  # group b's two sessions, handed back as soon as they were dropped


def test_collect_drops_groups_the_version_may_not_train_and_stops_when_told(monkeypatch):
    from rlgate.training.batching import GroupBuffer

    monkeypatch.setattr(loop.ray, "get", lambda value: value)
    buffer, capacity, stop = GroupBuffer(batch_size=2, group_size=2), Discards(), threading.Event()
    store = Reads([saved(1, "old", "s1", 1.0, version=1), saved(2, "old", "s2", 0.0, version=1)])
    monkeypatch.setattr(stop, "wait", lambda s: stop.set())  # the first idle wait ends the loop
    assert loop.collect(buffer, store, capacity, stop, version=3, max_staleness=1, poll_s=0) is None
    assert capacity.given == [2] and buffer.counters.dropped_stale == 2  # version 1 < 3 - 1: too old to train


def test_a_resumed_run_hands_back_only_the_sessions_its_capacity_actor_counted(monkeypatch):
    """Resumed, a run reads again what was saved after its checkpoint (up to
    ``backlog_end`` when it started) and drops what it cannot train. Those
    sessions were admitted by the stopped run's CapacityActor, not the one the
    resumed run reports to: discarding them uncounted would let as many sessions
    past its staleness bound. A whole group of them is counted (carried) first,
    then handed back; sessions saved since the resume are handed back as before."""
    from rlgate.training.batching import GroupBuffer

    monkeypatch.setattr(loop.ray, "get", lambda value: value)
    state = {"watermark": 0, "done_above": []}
    buffer = GroupBuffer.restore(state, backlog_end=2, resumed_version=3, batch_size=2, group_size=2)
    store = Reads(
        [saved(1, "old", "s1", 1.0, version=0), saved(2, "old", "s2", 0.0, version=0)],  # the backlog: too stale
        [saved(3, "new", "s3", 1.0, version=0), saved(4, "new", "s4", 0.0, version=0)],  # since: too stale too
        [saved(5, "ok", "s5", 1.0, version=3), saved(6, "ok", "s6", 0.0, version=3)],
    )
    capacity = Discards()
    batch = loop.collect(buffer, store, capacity, threading.Event(), version=3, max_staleness=1, poll_s=0)
    assert [sorted(g.sessions) for g in batch.groups] == [["s5", "s6"]]
    assert buffer.counters.dropped_stale == 4 and capacity.carried == [2] and capacity.given == [2, 2]


def test_a_resumed_run_counts_the_stopped_runs_groups_it_trains_before_its_episodes_start(monkeypatch):
    """Stopped at version 2 with a whole group saved after its last batch and one
    member of another: the resumed run's CapacityActor did not admit them, yet
    the batch at version 2 trains them. The backlog is read before the trainer
    attaches (the whole group counted then, through ``grant``), nothing past it;
    when the other group fills (its last member, open at the stop, ended by the
    resumed run's store), its backlog member is counted too."""
    from rlgate.training.batching import GroupBuffer

    monkeypatch.setattr(loop.ray, "get", lambda value: value)
    state = {"watermark": 0, "done_above": []}
    buffer = GroupBuffer.restore(state, backlog_end=3, resumed_version=2, batch_size=4, group_size=2)
    since = saved(4, "half", "s4", 0.0, 2) | {"end_reason": "restart"}
    store = Reads(
        [saved(1, "whole", "s1", 1.0, 2), saved(2, "whole", "s2", 0.0, 2), saved(3, "half", "s3", 1.0, 2), since],
        [since, saved(5, "new", "s5", 1.0, 2)],
    )
    loop.read_backlog(buffer, store)
    assert buffer.counters.carried == 2 and buffer.last_read == 3  # the whole group; s4 is left to the loop
    capacity = Discards()
    batch = loop.collect(buffer, store, capacity, threading.Event(), version=2, max_staleness=0, poll_s=0)
    assert [g.task_id for g in batch.groups] == ["whole", "half"] and store.asked_after == [0, 3]
    assert capacity.carried == [1] and capacity.given == []  # s3 once its group filled; s4 was this run's own


def test_a_steps_staleness_is_over_the_tokens_it_trained_on():
    """A session spanning more versions than the bound keeps its newer tokens; its
    older ones are dropped by the trainer, and staleness_max counted them anyway
    (above max_staleness, which the operating guide says it never is)."""
    from types import SimpleNamespace

    from rlgate.training.driver import batch_line, trained_line

    record = {"loss_mask": [0, 1, 1, 1], "versions": [-1, 2, 5, 6], "reward": 1.0, "session_id": "s"}
    metrics = {"stale_tokens_dropped": 1, "trained_tokens": 2}
    buffer = SimpleNamespace(counters=SimpleNamespace(dropped=0, failed=0))
    # trained as version 7, bound 2: version 2 is stale
    line = batch_line([record], 8, 2, buffer) | trained_line(metrics)
    assert line["staleness_max"] == 2 and line["staleness"] == 1.5 and line["stale_tokens_dropped"] == 1
