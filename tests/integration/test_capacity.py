"""Session admission: the staleness rule by hand and by property, and CapacityActor on a real local Ray."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlgate.sessions.capacity import CapacityRule, GroupReservations, free_slots

pytestmark = pytest.mark.long  # one to two minutes: `make test` hands this module out early, not last

NAMESPACE = "rlgate-test-capacity"


@pytest.mark.parametrize(
    ("rule", "running", "accepted", "version", "expected"),
    [
        # no trainer: 4 - 0
        (CapacityRule(4), 0, 0, 0, 4),
        # no trainer ignores accepted: 4 - 3
        (CapacityRule(4), 3, 100, 0, 1),
        # no trainer, running at max_concurrent: 4 - 4
        (CapacityRule(4), 4, 0, 0, 0),
        # S=0: min(10 - 0, (0+0+1)*2 - 0 - 0) = 2, exactly B per version
        (CapacityRule(10, batch_size=2), 0, 0, 0, 2),
        # S=0, a batch accepted at v0: (0+0+1)*2 - 2 - 0 = 0
        (CapacityRule(10, batch_size=2), 0, 2, 0, 0),
        # S=0, version advanced to 1: (0+1+1)*2 - 2 - 0 = 2
        (CapacityRule(10, batch_size=2), 0, 2, 1, 2),
        # S=1: (1+0+1)*2 - 0 - 0 = 4
        (CapacityRule(10, batch_size=2, max_staleness=1), 0, 0, 0, 4),
        # S=1, some accepted and running: (1+0+1)*2 - 2 - 1 = 1
        (CapacityRule(10, batch_size=2, max_staleness=1), 1, 2, 0, 1),
        # S=2: (2+0+1)*3 - 0 - 0 = 9
        (CapacityRule(100, batch_size=3, max_staleness=2), 0, 0, 0, 9),
        # S=2 at v2: (2+2+1)*3 - 10 - 3 = 2
        (CapacityRule(100, batch_size=3, max_staleness=2), 3, 10, 2, 2),
        # version advancing, S=1 at v1: (1+1+1)*4 - 8 - 0 = 4
        (CapacityRule(100, batch_size=4, max_staleness=1), 0, 8, 1, 4),
        # trainer, but running at max_concurrent: min(4 - 4, 16 - 0 - 4) = 0
        (CapacityRule(4, batch_size=8, max_staleness=1), 4, 0, 0, 0),
        # max_concurrent binds under a trainer: min(5 - 2, 24 - 0 - 2) = 3
        (CapacityRule(5, batch_size=8, max_staleness=2), 2, 0, 0, 3),
        # accepted far over the budget: (0+3+1)*4 - 100 - 0 < 0, clamped to 0
        (CapacityRule(8, batch_size=4), 0, 100, 3, 0),
    ],
)
def test_free_slots_by_hand(rule, running, accepted, version, expected):
    assert free_slots(rule, running, accepted, version) == expected


def _allowed(rule: CapacityRule, running: int, accepted: int, version: int) -> bool:
    """The admission rule as stated, independent of free_slots."""
    if running >= rule.max_concurrent:
        return False
    if rule.batch_size is None:
        return True
    return accepted + running < (rule.max_staleness + version + 1) * rule.batch_size


@given(
    max_concurrent=st.integers(1, 40),
    batch_size=st.none() | st.integers(1, 16),
    max_staleness=st.integers(0, 4),
    running=st.integers(0, 50),
    accepted=st.integers(0, 200),
    version=st.integers(0, 12),
)
def test_free_slots_is_exactly_the_sessions_the_rule_admits(
    max_concurrent, batch_size, max_staleness, running, accepted, version
):
    rule = CapacityRule(max_concurrent, batch_size, max_staleness)
    free = free_slots(rule, running, accepted, version)
    assert free >= 0
    # Starting them one by one: each start is admitted, and the one after them is not.
    for started in range(free):
        assert _allowed(rule, running + started, accepted, version)
    assert not _allowed(rule, running + free, accepted, version)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_concurrent": 0}, "max_concurrent"),
        ({"max_concurrent": 1, "batch_size": 0}, "batch_size"),
        ({"max_concurrent": 1, "batch_size": 2, "max_staleness": -1}, "max_staleness"),
    ],
)
def test_invalid_rule_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        CapacityRule(**kwargs)


@pytest.mark.parametrize("field", ["running", "accepted", "version"])
def test_negative_counts_name_the_field(field):
    counts = {"running": 0, "accepted": 0, "version": 0, field: -1}
    with pytest.raises(ValueError, match=field):
        free_slots(CapacityRule(2), **counts)


# --- CapacityActor on a real local Ray ---------------------------------------------------


@pytest.fixture
def make_capacity(ray_session):
    """Creates named detached CapacityActors (unique names) and kills them after the test."""
    from rlgate.actors.capacity import get_or_create_capacity

    made = []

    def make(max_concurrent: int, name: str | None = None):
        handle = get_or_create_capacity(name or f"capacity-{uuid.uuid4().hex}", NAMESPACE, max_concurrent)
        made.append(handle)
        return handle

    yield make
    for handle in made:
        ray_session.kill(handle)


async def test_acquire_up_to_max_concurrent_then_release_frees_one(make_capacity):
    capacity = make_capacity(3)
    assert [await capacity.acquire.remote() for _ in range(4)] == [True, True, True, False]
    await capacity.release.remote(accepted=False)
    assert await capacity.acquire.remote() is True
    assert await capacity.acquire.remote() is False


async def test_acquire_waits_for_a_release(make_capacity, ray_session):
    capacity = make_capacity(1)
    assert await capacity.acquire.remote()
    waiting = capacity.acquire.remote(timeout_s=30.0)
    ready, _ = ray_session.wait([waiting], timeout=0.5)
    assert not ready  # it waits instead of answering at once
    await capacity.release.remote(accepted=True)
    assert await waiting is True
    assert (await capacity.stats.remote())["running"] == 1


async def test_acquire_times_out_and_counts_a_rejection(make_capacity):
    capacity = make_capacity(1)
    assert await capacity.acquire.remote()
    started = time.monotonic()
    assert await capacity.acquire.remote(timeout_s=0.3) is False
    assert time.monotonic() - started >= 0.3
    assert (await capacity.stats.remote())["rejected"] == 1


async def test_grant_applies_the_staleness_rule_per_version(make_capacity):
    capacity = make_capacity(10)
    await capacity.grant.remote(batch_size=2, max_staleness=0)
    # S=0: two sessions at version 0, however many max_concurrent allows.
    assert [await capacity.acquire.remote() for _ in range(3)] == [True, True, False]
    await capacity.release.remote(accepted=True)
    await capacity.release.remote(accepted=True)
    assert await capacity.acquire.remote() is False  # the batch for version 0 is complete
    await capacity.on_new_version.remote(1)
    assert [await capacity.acquire.remote() for _ in range(3)] == [True, True, False]


async def test_discarded_sessions_make_room_for_new_ones(make_capacity):
    capacity = make_capacity(10)
    await capacity.grant.remote(batch_size=4, max_staleness=0)
    for _ in range(4):
        assert await capacity.acquire.remote()
        await capacity.release.remote(accepted=True)
    assert await capacity.acquire.remote() is False  # the batch for version 0 is complete ...
    waiting = asyncio.ensure_future(capacity.acquire.remote(timeout_s=30.0))
    await capacity.discard.remote(2)  # ... until the trainer drops a group of two (e.g. equal rewards)
    assert await asyncio.wait_for(waiting, 10) is True
    assert [await capacity.acquire.remote() for _ in range(2)] == [True, False]
    with pytest.raises(ValueError, match="sessions must be >= 0"):
        await capacity.discard.remote(-1)


def test_group_reservations_hold_join_and_lapse():
    held = GroupReservations()
    held.open("t", 4, now=0.0)  # the first of four sessions started: three slots held
    held.open("u", 1, now=0.0)  # a group of one holds nothing
    assert held.held() == 3 and held.joins("t") and not held.joins("u") and not held.joins(None)
    held.join("t")
    held.join("t")
    assert held.held() == 1
    held.open("v", 3, now=5.0)
    assert held.expire(now=9.0, timeout_s=10.0) == 0
    assert held.expire(now=10.0, timeout_s=10.0) == 1  # "t" lapses; "v" is younger
    assert held.held() == 2 and not held.joins("t")
    held.join("v")
    held.join("v")
    assert held.held() == 0 and not held.joins("v")


def test_free_slots_count_reserved_ones():
    # S=0, B=8: (0+0+1)*8 - 0 - 1 running - 3 reserved = 4
    assert free_slots(CapacityRule(64, batch_size=8), 1, 0, 0, reserved=3) == 4
    assert free_slots(CapacityRule(64), 1, 0, 0, reserved=3) == 63  # no trainer: nothing is reserved
    with pytest.raises(ValueError, match="reserved"):
        free_slots(CapacityRule(4), 0, 0, 0, reserved=-1)
    assert CapacityRule(64, batch_size=8, group_size=4).group_slots(None) == 4
    assert CapacityRule(64, batch_size=8, group_size=4).group_slots(16) == 8  # never more than a batch


async def test_whole_groups_are_admitted_so_a_synchronous_run_cannot_deadlock(make_capacity):
    capacity = make_capacity(64)
    await capacity.grant.remote(batch_size=8, max_staleness=0, group_size=4)
    # Ten sessions of three tasks arrive interleaved, as from agents running in parallel.
    # Admitted one by one, the budget of 8 would go to the first members of several
    # groups and the last members could never start at this version.
    arrivals = ["a", "b", "a", "c", "b", "a", "c", "b", "a", "b"]
    admitted = [t for t in arrivals if await capacity.acquire.remote(0.0, t)]
    assert admitted == ["a", "b", "a", "b", "a", "b", "a", "b"]  # groups a and b, whole; c waits
    stats = await capacity.stats.remote()
    assert (stats["running"], stats["reserved"], stats["free"]) == (8, 0, 0)
    for _ in admitted:
        await capacity.release.remote(accepted=True)
    assert await capacity.acquire.remote(0.0, "c") is False
    await capacity.on_new_version.remote(1)
    assert [await capacity.acquire.remote(0.0, "c") for _ in range(4)] == [True] * 4
    assert (await capacity.stats.remote())["reserved"] == 0


async def test_a_session_sets_its_own_group_size_and_reservations_lapse(make_capacity):
    capacity = make_capacity(64)
    await capacity.grant.remote(batch_size=4, max_staleness=0, group_size=2, group_timeout_s=0.5)
    assert await capacity.acquire.remote(0.0, "big", 3)  # holds two more slots
    assert await capacity.acquire.remote(0.0, "other") is False  # 4 - 1 running - 2 held < 2
    # The rest of "big" never comes: after the group timeout its slots are free again.
    assert await capacity.acquire.remote(5.0, "other") is True
    assert (await capacity.stats.remote())["reserved"] == 1  # the new group's second slot


async def test_a_new_version_wakes_a_waiter(make_capacity):
    capacity = make_capacity(10)
    await capacity.grant.remote(batch_size=1, max_staleness=0)
    assert await capacity.acquire.remote()
    await capacity.release.remote(accepted=True)
    waiting = asyncio.ensure_future(capacity.acquire.remote(timeout_s=30.0))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    await capacity.on_new_version.remote(1)
    assert await asyncio.wait_for(waiting, 10) is True


async def test_detach_returns_to_max_concurrent_only(make_capacity):
    capacity = make_capacity(3)
    await capacity.grant.remote(batch_size=1, max_staleness=0)
    assert [await capacity.acquire.remote() for _ in range(2)] == [True, False]
    await capacity.detach.remote()
    assert [await capacity.acquire.remote() for _ in range(3)] == [True, True, False]


async def test_set_max_concurrent(make_capacity):
    capacity = make_capacity(1)
    assert await capacity.acquire.remote()
    await capacity.set_max_concurrent.remote(2)
    assert [await capacity.acquire.remote() for _ in range(2)] == [True, False]
    with pytest.raises(ValueError, match="max_concurrent"):
        await capacity.set_max_concurrent.remote(0)


async def test_versions_never_go_backwards(make_capacity):
    capacity = make_capacity(1)
    await capacity.on_new_version.remote(3)
    await capacity.on_new_version.remote(3)  # republishing the same version is harmless
    with pytest.raises(ValueError, match=r"3 -> 2"):
        await capacity.on_new_version.remote(2)
    assert (await capacity.stats.remote())["version"] == 3


async def test_release_without_a_running_session_raises(make_capacity):
    capacity = make_capacity(2)
    with pytest.raises(ValueError, match="holds none"):
        await capacity.release.remote(accepted=True)
    assert (await capacity.stats.remote())["accepted"] == 0


async def test_stats_report_the_counts(make_capacity):
    capacity = make_capacity(5)
    await capacity.grant.remote(batch_size=2, max_staleness=1)
    await capacity.on_new_version.remote(1)
    for _ in range(4):
        assert await capacity.acquire.remote()
    await capacity.release.remote(accepted=True)
    await capacity.release.remote(accepted=False)
    await capacity.set_max_concurrent.remote(2)
    assert await capacity.acquire.remote() is False  # running 2 = max_concurrent 2
    # free: min(2 - 2, (1+1+1)*2 - 1 - 2) = 0
    assert await capacity.stats.remote() == {
        "running": 2,
        "accepted": 1,
        "discarded": 0,
        "rejected": 1,
        "version": 1,
        "max_concurrent": 2,
        "batch_size": 2,
        "max_staleness": 1,
        "group_size": 1,
        "reserved": 0,
        "free": 0,
    }


async def test_the_named_actor_is_shared(make_capacity, ray_session):
    name = f"capacity-{uuid.uuid4().hex}"
    first = make_capacity(4, name)
    assert await first.acquire.remote()
    # get_if_exists: the same actor, its settings and counters kept.
    again = make_capacity(9, name)
    stats = await again.stats.remote()
    assert (stats["running"], stats["max_concurrent"]) == (1, 4)
    assert (await ray_session.get_actor(name, namespace=NAMESPACE).stats.remote())["running"] == 1


async def test_a_trainer_counts_sessions_and_versions_from_when_it_attaches(make_capacity):
    capacity = make_capacity(10)
    for _ in range(5):  # sessions served before any trainer attached
        assert await capacity.acquire.remote()
        await capacity.release.remote(accepted=True)
    await capacity.on_new_version.remote(7)
    await capacity.grant.remote(batch_size=2, max_staleness=0)
    # from the trainer's point of view: version 0, nothing accepted yet -> one batch of 2
    assert [await capacity.acquire.remote() for _ in range(3)] == [True, True, False]
    await capacity.grant.remote(batch_size=3, max_staleness=0)  # new settings keep the same starting point
    assert await capacity.acquire.remote() is True


async def test_a_resumed_trainer_attaches_with_the_stopped_runs_sessions_it_trains_already_counted(make_capacity):
    """Resumed at version 3 with a whole group of 4 saved by the stopped run (of
    which it dropped none), batch 8: one new group may start at version 3, not two
    (the second would run on past version 4). A grant made again (its answer lost
    to a restart) counts them once; a later one dropped is handed back as usual."""
    capacity = make_capacity(64)
    await capacity.on_new_version.remote(3)
    await capacity.grant.remote(8, 0, 4, 600.0, 6, 2)  # carried 6, 2 of them dropped: 4 count
    await capacity.grant.remote(8, 0, 4, 600.0, 6, 2)
    assert (await capacity.stats.remote())["free"] == 4
    assert [await capacity.acquire.remote(0.0, "new") for _ in range(4)] == [True] * 4
    assert await capacity.acquire.remote(0.0, "other") is False  # a second group would need 4 more
    await capacity.discard.remote(4)
    assert await capacity.acquire.remote(0.0, "other") is True
    with pytest.raises(ValueError, match="carried and discarded"):
        await capacity.grant.remote(8, 0, 4, 600.0, -1)


async def test_a_group_begun_before_the_trainer_attached_reserves_only_its_other_members(make_capacity):
    # The two-node cluster run's race: the trainer attached while a group's first session was open.
    capacity = make_capacity(10)
    assert await capacity.acquire.remote(0.0, "g0")  # no trainer yet: no reservation
    await capacity.grant.remote(batch_size=4, max_staleness=0, group_size=2)
    await capacity.release.remote(accepted=True)
    assert await capacity.acquire.remote(0.0, "g0")  # completes g0: nothing left to hold
    assert (await capacity.stats.remote())["reserved"] == 0
    await capacity.release.remote(accepted=True)
    # budget 4 - 1 accepted since attaching: the next whole group fits at once
    assert await capacity.acquire.remote(0.0, "g1")
    assert await capacity.acquire.remote(0.0, "g1")


def test_early_starts_count_towards_their_group_and_are_forgotten_oldest_first():
    held = GroupReservations(early_limit=2)
    for task in ("a", "b", "b", "b", "c"):
        held.started_early(task)
    assert held.early == {"b": 3, "c": 1}  # "a" forgotten
    assert [held.needed(t, 2) for t in ("a", "b", "c", None)] == [2, 1, 1, 2]
    held.open("b", 4, now=0.0)  # three of four started early: this one completes the group
    assert held.pending == {} and "b" not in held.early
    held.open("c", 4, now=0.0)
    assert held.pending == {"c": (2, 0.0)}


async def test_a_wait_across_a_session_store_restart_takes_no_slot(make_capacity, ray_session):
    capacity = make_capacity(1)
    assert await capacity.acquire.remote()
    waiting = capacity.acquire.remote(30.0)  # made by a SessionStore that then dies
    ready, _ = ray_session.wait([waiting], timeout=0.5)
    assert not ready
    await capacity.reconcile.remote(0)  # the restarted store holds no open session
    assert await waiting is False  # its caller is gone: the slot it would take is not counted
    assert (await capacity.stats.remote())["running"] == 0
    assert await capacity.acquire.remote()  # and the new store gets it


async def test_holders_are_counted_apart_and_a_restart_recounts_only_its_own(make_capacity, ray_session):
    capacity = make_capacity(2)
    assert await capacity.acquire.remote(holder="gateway-0")
    assert await capacity.acquire.remote(holder="gateway-1")
    waiting = capacity.acquire.remote(30.0, holder="gateway-0")
    assert await capacity.acquire.remote(holder="gateway-1") is False  # one bound over every holder
    ready, _ = ray_session.wait([waiting], timeout=0.5)
    assert not ready
    await capacity.reconcile.remote(0, holder="gateway-1")  # gateway-1 restarted holding none
    assert await waiting is True  # gateway-0 did not restart: its wait goes on and takes the freed slot
    assert (await capacity.stats.remote())["running"] == 2
    with pytest.raises(ValueError, match="'gateway-1'"):
        await capacity.release.remote(accepted=True, holder="gateway-1")
    await capacity.release.remote(accepted=True, holder="gateway-0")
    assert (await capacity.stats.remote())["running"] == 1


async def test_a_killed_capacity_actor_comes_back_with_its_state_and_holders_reconcile(tmp_path, ray_session):
    """SIGKILL the CapacityActor: Ray restarts it in place, it reads its state back
    (version, counts), refuses each holder until the holder has said how many
    sessions it holds, and CapacityClient does that on its own: a release lost in
    the crash leaves the count exact, and admission goes on up to the bound."""
    import os
    import signal

    from rlgate.actors.capacity import CapacityClient, HolderUnknown, get_or_create_capacity

    actor = get_or_create_capacity(f"capacity-{uuid.uuid4().hex}", NAMESPACE, 3, str(tmp_path / "capacity.jsonl"))
    sessions: list[int] = []  # the open sessions of holder "store"
    client = CapacityClient(actor, "store", count=lambda: len(sessions))
    for session in range(2):
        assert await client.acquire()
        sessions.append(session)
    assert await client.acquire()
    await client.release(accepted=True)  # a release counts its session accepted once
    assert (await actor.stats.remote())["accepted"] == 1
    assert await actor.acquire.remote(0.0, None, None, "gateway-1")  # another holder's session
    await actor.on_new_version.remote(4)

    os.kill(await actor.__ray_call__.remote(lambda self: os.getpid()), signal.SIGKILL)
    sessions.pop()  # a session of "store" ends while the actor is down: its release meets the restart
    await client.release(accepted=True)
    stats = await actor.stats.remote()
    assert (stats["running"], stats["version"], stats["accepted"]) == (2, 4, 2)
    with pytest.raises(HolderUnknown):  # "gateway-1" has not reconciled yet
        await actor.acquire.remote(0.0, None, None, "gateway-1")
    await actor.reconcile.remote(0, "gateway-1")  # its session ended meanwhile
    assert [await client.acquire() for _ in range(3)] == [True, True, False]  # 1 + 2: the bound of 3 holds
    ray_session.kill(actor)


async def test_a_restarted_capacity_actor_keeps_the_trainers_rule_and_its_group_reservations(tmp_path, ray_session):
    """The rule a trainer granted and the slots reserved for groups under way
    survive a SIGKILL: a group's later members still find their slots, and a
    new group still finds none."""
    import os
    import signal

    from rlgate.actors.capacity import CapacityClient, get_or_create_capacity

    actor = get_or_create_capacity(f"capacity-{uuid.uuid4().hex}", NAMESPACE, 8, str(tmp_path / "capacity.jsonl"))
    held: list[str] = []
    client = CapacityClient(actor, "store", count=lambda: len(held))
    await actor.grant.remote(batch_size=4, max_staleness=0, group_size=2)
    for task in ("g1", "g2"):  # each group's first session reserves the group's two slots
        assert await client.acquire(task_id=task)
        held.append(task)
    assert not await client.acquire(task_id="g3")  # four slots: two groups under way take them all
    before = await actor.stats.remote()
    assert (before["batch_size"], before["group_size"], before["reserved"]) == (4, 2, 2)

    os.kill(await actor.__ray_call__.remote(lambda self: os.getpid()), signal.SIGKILL)
    assert await client.acquire(task_id="g1")  # a group's second session takes its reserved slot
    held.append("g1")
    assert not await client.acquire(task_id="g3")
    assert await client.acquire(task_id="g2")
    held.append("g2")
    after = await actor.stats.remote()
    assert {k: after[k] for k in ("batch_size", "max_staleness", "group_size", "max_concurrent")} == {
        "batch_size": 4,
        "max_staleness": 0,
        "group_size": 2,
        "max_concurrent": 8,
    }
    assert (after["running"], after["reserved"], after["rejected"]) == (4, 0, before["rejected"] + 1)
    ray_session.kill(actor)


async def test_a_release_whose_answer_was_lost_counts_its_session_accepted_at_most_twice(make_capacity):
    """The client cannot tell whether a release that met a restart was applied;
    it recounts what it holds and notes the session accepted again: its slot is
    free exactly once, and the accepted count errs high (admitting fewer)."""
    from ray.exceptions import RayActorError

    from rlgate.actors.capacity import CapacityClient

    capacity = make_capacity(2)

    class AnswerLost:  # the release reaches the actor; its answer does not come back
        def __init__(self, actor) -> None:
            self.actor = actor

        def __getattr__(self, name: str):
            return getattr(self.actor, name)

        @property
        def release(self):
            actor = self.actor

            class Method:
                @staticmethod
                async def remote(*args):
                    await actor.release.remote(*args)
                    raise RayActorError()

            return Method

    held = ["one"]
    client = CapacityClient(AnswerLost(capacity), "store", count=lambda: len(held))
    assert await client.acquire()
    held.pop()
    await client.release(accepted=True)
    stats = await capacity.stats.remote()
    assert (stats["running"], stats["accepted"]) == (0, 2)  # the slot freed once; the session counted twice


async def test_a_holder_waits_for_a_restarting_actor_before_it_reconciles(make_capacity):
    """A call that met the actor's death is followed by a reconcile, which may
    itself find the actor still restarting (ActorUnavailableError): the client
    asks again until it answers, and the call that waited goes on (it failed the
    start with a 500 before)."""
    from ray.exceptions import ActorUnavailableError, RayActorError

    from rlgate.actors.capacity import CapacityClient

    capacity = make_capacity(2)
    refusals = {"lease": 1, "reconcile": 2}  # the acquire's call meets the death; two reconciles the restart

    class Restarting:
        def __init__(self, actor) -> None:
            self.actor = actor

        def __getattr__(self, name: str):
            method = getattr(self.actor, name)

            class Method:
                @staticmethod
                async def remote(*args):
                    if refusals.get(name, 0) > 0:
                        refusals[name] -= 1
                        raise RayActorError() if name == "lease" else ActorUnavailableError("restarting", None)
                    return await method.remote(*args)

            return Method

    held: list[str] = []
    client = CapacityClient(Restarting(capacity), "store", count=lambda: len(held))
    assert await client.acquire()
    assert refusals == {"lease": 0, "reconcile": 0}
    assert (await capacity.stats.remote())["running"] == 1  # counted once: reconciled to 0, then acquired


async def test_leasing_holders_count_exactly_and_a_free_slot_leased_elsewhere_still_comes(make_capacity):
    """Two holders lease slots from one actor of 6 while their sessions come and
    go at random (seeded): a session that asks while fewer than 6 are open gets
    a slot, even one leased to the other holder (it is given back); one that
    asks when 6 are open is refused; once the holders have said everything, the
    actor's counts are exactly the open sessions and the accepted ones."""
    import random

    from rlgate.actors.capacity import CapacityClient

    capacity = make_capacity(6)
    sessions: dict[str, list[int]] = {"a": [], "b": []}
    clients = {
        holder: CapacityClient(capacity, holder, count=lambda holder=holder: len(sessions[holder]), block=8)
        for holder in sessions
    }
    rng, accepted, most = random.Random(7), 0, 0
    for step in range(150):
        holder = rng.choice("ab")
        open_now = len(sessions["a"]) + len(sessions["b"])
        if sessions[holder] and (rng.random() < 0.4 or open_now == 6):
            sessions[holder].pop()
            accepted += (ended_accepted := rng.random() < 0.5)
            await clients[holder].release(accepted=ended_accepted)
        else:
            assert await clients[holder].acquire(timeout_s=60.0), f"step {step}: refused with {open_now} open"
            sessions[holder].append(step)
        most = max(most, (await capacity.stats.remote())["running"])
    while len(sessions["a"]) + len(sessions["b"]) < 6:
        assert await clients["a"].acquire(timeout_s=60.0)
        sessions["a"].append(0)
    assert not await clients["b"].acquire()  # full: refused (after waiting for spares there are none of)
    for client in clients.values():
        await client.flush()
    stats = await capacity.stats.remote()
    assert most <= 6 and (stats["running"], stats["accepted"]) == (6, accepted)


async def test_a_session_refused_while_another_holder_keeps_an_ended_sessions_slot_gets_that_slot(make_capacity):
    """Holder a fills all 6 slots and one of its sessions ends: a keeps that
    slot for its next session instead of giving it back at once. A session
    asking at holder b without waiting (wait_s 0) is not refused: the actor
    holds it while a hears that a session waits and gives the slot back."""
    from rlgate.actors.capacity import CapacityClient

    capacity = make_capacity(6)
    sessions = {"a": [], "b": []}
    a = CapacityClient(capacity, "a", count=lambda: len(sessions["a"]), block=8)
    b = CapacityClient(capacity, "b", count=lambda: len(sessions["b"]), block=8)
    while len(sessions["a"]) < 6:
        assert await a.acquire(timeout_s=60.0)
        sessions["a"].append(1)
    await a.flush()
    assert (await capacity.stats.remote())["running"] == 6
    sessions["a"].pop()
    await a.release(accepted=True)  # kept by a for a while
    assert (await capacity.stats.remote())["running"] == 6
    assert await b.acquire()  # no wait asked for, yet admitted: a gave its slot back
    sessions["b"].append(1)
    assert not await a.acquire()  # now all 6 are open: refused
    for client in (a, b):
        await client.flush()
    stats = await capacity.stats.remote()
    assert (stats["running"], stats["accepted"]) == (6, 1)


async def test_once_a_trainer_has_attached_no_session_opens_in_a_kept_slot(make_capacity):
    """A leasing holder keeps an ended session's slot for its next session; a
    trainer attaches with room for no more sessions. The attach waits until the
    holder's leave to open sessions without asking has run out, so the next
    session asks, and the staleness rule refuses it."""
    from rlgate.actors.capacity import CapacityClient

    capacity = make_capacity(8)
    sessions: list[int] = []
    client = CapacityClient(capacity, "a", count=lambda: len(sessions), block=8)
    for _ in range(2):
        assert await client.acquire()
        sessions.append(1)
    sessions.pop()
    await client.release(accepted=True)  # its slot kept for the next session
    await capacity.grant.remote(batch_size=1, max_staleness=0)  # room: 1 - 1 running = 0 (the kept slot counts)
    assert not await client.acquire()
    await client.flush()
    stats = await capacity.stats.remote()
    assert stats["running"] == len(sessions) == 1 and stats["free"] == 0


async def test_the_state_written_on_every_change_does_not_grow_with_the_sessions_seen(tmp_path, ray_session):
    """Each acquire and release appends the state: counts and the groups under way,
    not every task seen, so a write costs the same after many sessions; the log is
    rewritten to its last state when it passes its size, and read back after a kill."""
    import os
    import signal

    from rlgate.actors.capacity import get_or_create_capacity

    path = tmp_path / "capacity.jsonl"
    actor = get_or_create_capacity(f"capacity-{uuid.uuid4().hex}", NAMESPACE, 4, str(path))
    await actor.__ray_call__.remote(lambda self: setattr(self, "state_rewrite_bytes", 8192))
    lines = []
    for batch in range(2):
        for i in range(500):
            assert await actor.acquire.remote(0.0, f"task-{batch}-{i}")
            await actor.release.remote(True)
        lines.append(path.read_text().splitlines()[-1])
        assert path.stat().st_size <= 8192  # rewritten as it grew
    assert len(lines[1]) - len(lines[0]) <= 8 and len(lines[1]) < 2048, lines  # a digit more in a counter, no more
    os.kill(await actor.__ray_call__.remote(lambda self: os.getpid()), signal.SIGKILL)
    while True:
        try:
            stats = await actor.stats.remote()
            break
        except ray_session.exceptions.RayActorError:
            await asyncio.sleep(0.2)
    assert stats["accepted"] == 1000  # the last state, read back
    ray_session.kill(actor)


async def test_a_holders_calls_wait_until_its_start_count_is_applied():
    """A holder sends its count when it (re)starts, from its constructor; an acquire
    made next (from the event loop, another thread) must not reach the actor first,
    or the count would wipe the slot it took (seen once in a full test run)."""
    from rlgate.actors.capacity import CapacityClient

    order = []

    class Method:
        def __init__(self, call) -> None:
            self.call = call

        def remote(self, *args):
            return asyncio.ensure_future(self.call(*args))

    async def reconcile(running: int, holder: str, spares: int = 0) -> None:
        await asyncio.sleep(0.05)  # the count is slow to arrive
        order.append(("reconcile", running))

    async def lease(*args) -> tuple[int, bool]:
        order.append(("acquire",))
        return 1, False

    actor = type("Actor", (), {"reconcile": Method(reconcile), "lease": Method(lease)})()
    client = CapacityClient(actor, "store")
    client.reconcile(0)
    assert await client.acquire() and await client.acquire()
    assert order == [("reconcile", 0), ("acquire",), ("acquire",)]


def test_a_run_takes_back_its_route_from_a_dead_driver_of_its_name_and_never_from_another(ray_session, capsys):
    """A driver killed outright leaves its application up; its replicas would go on
    saving sessions of weights the next run (resumed or fresh) does not continue from:
    the next run of its name deletes it. An application of another run at the run's
    route (at '/', every run's application is named ``rlgate``), or any other
    application there, is left alone and the run refused: it would have replaced it."""
    from ray import serve

    from rlgate.config import parse_config
    from rlgate.run import app_name
    from rlgate.training.driver import clear_the_route

    def run_at(run: str, prefix: str):
        return parse_config({"gateway": {"run_name": run, "route_prefix": prefix}})

    @serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
    class Served:
        def __init__(self, run: str | None) -> None:
            self.run = run

        def replica_status(self) -> dict:  # as a Gateway replica answers
            if self.run is None:
                raise AttributeError("not a gateway")
            return {"run": self.run}

        def __call__(self, request) -> str:
            return "still here"

    dead = f"dead-{uuid.uuid4().hex[:8]}"
    serve.run(Served.bind(None), name=app_name(dead, "/left"), route_prefix="/left")
    clear_the_route(run_at(dead, "/left"))
    assert app_name(dead, "/left") not in serve.status().applications
    assert "still deployed; deleting it first" in capsys.readouterr().out
    clear_the_route(run_at(dead, "/left"))  # none left: nothing happens
    assert "deleting" not in capsys.readouterr().out

    serve.run(Served.bind("other-run"), name="rlgate", route_prefix="/")  # another run's, at the root
    try:
        with pytest.raises(SystemExit, match="route '/' is served by run 'other-run' on this cluster: give this run"):
            clear_the_route(run_at(dead, "/"))
        serve.run(Served.bind(None), name="rlgate", route_prefix="/")  # one that does not say whose it is
        with pytest.raises(SystemExit, match="route '/' is served by 'rlgate' on this cluster"):
            clear_the_route(run_at(dead, "/"))
        serve.run(Served.bind(dead), name="rlgate", route_prefix="/")  # this run's own, its driver dead
        clear_the_route(run_at(dead, "/"))
        assert "rlgate" not in serve.status().applications
    finally:
        serve.delete("rlgate")
    serve.run(Served.bind(None), name="not-a-run", route_prefix="/mine")  # any other application
    try:
        with pytest.raises(SystemExit, match="route '/mine' is served by application 'not-a-run' on this cluster"):
            clear_the_route(run_at(dead, "/mine"))
        assert "not-a-run" in serve.status().applications
    finally:
        serve.delete("not-a-run")


def test_a_resume_on_a_cluster_that_kept_running_starts_at_its_checkpoints_version(tmp_path, ray_session):
    """A run stopped between checkpoints (at version 15, its checkpoint at 10) on a
    cluster that kept running leaves its CapacityActor and PolicyStore at 15; a
    version cannot go back, so the resumed run failed to start. It ends them, and
    the actors its application makes again start at the checkpoint's version."""
    from rlgate.actors.capacity import get_or_create_capacity
    from rlgate.config import parse_config
    from rlgate.run import NAMESPACE as RUNS
    from rlgate.run import ROLES, actor_name, end_actors
    from rlgate.serving.app import policy_store
    from rlgate.training.driver import admit_under_the_rule, forget_stopped_run

    run = f"resumed-{uuid.uuid4().hex[:8]}"
    config = parse_config({"model": {"name": "tiny-random"}, "gateway": {"run_name": run, "run_dir": str(tmp_path)}})

    def made_by_the_application(version: int):
        return get_or_create_capacity(actor_name(run, "capacity"), RUNS, 8), policy_store(config, version)

    capacity, store = made_by_the_application(0)
    ray_session.get(capacity.on_new_version.remote(15))
    ray_session.get(store.publish.remote(15, [ray_session.put({"weights": 15})]))
    forget_stopped_run(run)  # what `rlgate train --resume` does first
    capacity, store = made_by_the_application(10)
    admit_under_the_rule(config, 10)  # raised: policy version cannot go backwards: 15 -> 10
    assert ray_session.get(capacity.stats.remote())["version"] == 10
    assert ray_session.get(store.status.remote())["version"] == 10
    end_actors(run, ROLES)
