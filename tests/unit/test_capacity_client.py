"""CapacityClient, a holder's side of the CapacityActor, against a fake actor (no
Ray): what it counts as held when it recounts after the actor's restart, and
slots whose callers left."""

from __future__ import annotations

import asyncio

import pytest


class Method:
    """An actor method's ``.remote``: a future of the call, as Ray's."""

    def __init__(self, call) -> None:
        self.call = call

    def remote(self, *args):
        return asyncio.ensure_future(self.call(*args))


def fake_actor(**methods):
    return type("Actor", (), {name: Method(call) for name, call in methods.items()})()


async def test_a_session_that_ends_while_its_holder_recounts_is_taken_off_once():
    """A call that meets the actor's restart makes the holder recount what it
    holds, asking again while the actor is still restarting. A session that ends
    meanwhile has left the count before its release is sent: the recount must
    include it (its release is still to come), or the release takes it off a
    second time and the actor admits one session past the bound."""
    from ray.exceptions import ActorUnavailableError, RayActorError

    from rlgate.actors.capacity import CapacityClient

    state = {"held": 2}
    refusals = {"acquire": 1, "reconcile": 1}  # the acquire meets the death; the first recount the restart

    async def lease(timeout_s, task_id, group_size, holder, up_to):
        if refusals["acquire"]:
            refusals["acquire"] -= 1
            raise RayActorError()
        state["held"] += 1
        return 1, False  # one slot, nothing leased (a trainer attached)

    async def reconcile(running: int, holder: str, spares: int = 0) -> None:
        if refusals["reconcile"]:
            refusals["reconcile"] -= 1
            raise ActorUnavailableError("restarting", None)
        state["held"] = running

    async def release(accepted: bool, holder: str) -> None:
        state["held"] -= 1

    actor = fake_actor(lease=lease, reconcile=reconcile, release=release)
    held = ["a", "b"]
    client = CapacityClient(actor, "store", count=lambda: len(held))
    acquiring = asyncio.ensure_future(client.acquire())
    await asyncio.sleep(0.03)  # the acquire failed, the first recount was refused: the client waits to ask again
    assert refusals == {"acquire": 0, "reconcile": 0} and not acquiring.done()
    held.remove("b")  # session b ends: out of the count, its release on its way
    await asyncio.gather(acquiring, client.release(accepted=True))
    held.append("c")  # the acquire's session
    assert state["held"] == len(held) == 2


async def test_a_slot_granted_after_its_caller_hung_up_is_given_back():
    """A start that waits for capacity is cancelled when its client hangs up, but
    the actor's wait goes on and may grant a slot no session will hold: the
    client gives it back."""
    from rlgate.actors.capacity import CapacityClient

    state, freed = {"held": 0, "released": []}, asyncio.Event()

    async def lease(timeout_s, task_id, group_size, holder, up_to):
        await freed.wait()  # a slot comes free after the caller left
        state["held"] += 1
        return 1, False

    async def release(accepted: bool, holder: str) -> None:
        state["held"] -= 1
        state["released"].append(accepted)

    actor = fake_actor(lease=lease, release=release)
    client = CapacityClient(actor, "store")
    waiting = asyncio.ensure_future(client.acquire(30.0))
    await asyncio.sleep(0.01)
    waiting.cancel()
    freed.set()
    for _ in range(100):
        if state["released"]:
            break
        await asyncio.sleep(0.005)
    assert waiting.cancelled() and state == {"held": 0, "released": [False]}


async def test_a_slot_granted_while_its_holder_recounts_is_counted_once():
    """A grant that comes back as another call meets the actor's restart: the
    recount runs before the grant's caller has opened its session (it is not in
    ``count()`` yet), so the grant must be counted as held, or the session's
    release later takes it off a second time and one session passes the bound."""
    from ray.exceptions import RayActorError

    from rlgate.actors.capacity import CapacityClient

    state = {"held": 1}
    granting = asyncio.Event()

    async def lease(timeout_s, task_id, group_size, holder, up_to):
        await granting.wait()
        state["held"] += 1
        return 1, False

    async def release(accepted: bool, holder: str) -> None:
        await granting.wait()  # answered with the grant: the actor died under it
        raise RayActorError()

    async def reconcile(running: int, holder: str, spares: int = 0) -> None:
        state["held"] = running

    held = ["a"]
    actor = fake_actor(lease=lease, release=release, reconcile=reconcile)
    client = CapacityClient(actor, "store", lambda: len(held))
    acquiring = asyncio.ensure_future(client.acquire())
    held.remove("a")  # session a ends
    releasing = asyncio.ensure_future(client.release(accepted=False))
    await asyncio.sleep(0.01)
    granting.set()
    assert await acquiring
    held.append("b")  # the grant's caller opens its session
    await releasing
    assert state["held"] == len(held) == 1


class LeasingActor:
    """The CapacityActor's counts for its holders: ``max_concurrent`` alone
    (slots leased), or with a trainer attached (one slot a call)."""

    def __init__(self, max_concurrent: int, trainer: bool = False) -> None:
        self.max_concurrent, self.trainer = max_concurrent, trainer
        self.held, self.accepted, self.calls, self.started = 0, 0, [], []
        self.most_held = 0

    def methods(self):
        return fake_actor(lease=self.lease, settle=self.settle, release=self.release, reconcile=self.reconcile)

    async def lease(self, timeout_s, task_id, group_size, holder, up_to):
        self.calls.append(("lease", up_to))
        free = self.max_concurrent - self.held
        taken = 0 if free <= 0 else 1 + (0 if self.trainer else min(up_to - 1, free - 1))
        self.held += taken
        self.most_held = max(self.most_held, self.held)
        return taken, not self.trainer

    async def settle(self, ended, accepted, holder, started, unused):
        self.calls.append(("settle", ended + unused))
        assert ended + unused <= self.held
        self.held, self.accepted = self.held - ended - unused, self.accepted + accepted
        self.started += started
        return not self.trainer

    async def release(self, accepted, holder):
        self.calls.append(("release", 1))
        assert self.held >= 1
        self.held, self.accepted = self.held - 1, self.accepted + accepted

    async def reconcile(self, running, holder, spares=0):
        self.calls.append(("reconcile", running))
        self.held = running


async def eventually(condition, timeout_s: float = 10.0) -> None:
    """Wait (polling) until ``condition()`` holds; fail after ``timeout_s``."""
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


@pytest.fixture
def quick_lease(monkeypatch):
    """Leased slots and ended sessions' slots go back after 50 ms, not 0.5 s and 0.2 s."""
    from rlgate.actors import capacity

    monkeypatch.setattr(capacity, "LINGER_S", 0.05)
    monkeypatch.setattr(capacity, "SPARE_IDLE_S", 0.05)


async def test_sessions_that_start_in_quick_succession_open_in_leased_slots_without_a_call():
    """Sessions asking one after another take more slots per call (the third
    opens in the second's spare, without a call); their ends go back in one
    call; the actor counted every session."""
    from rlgate.actors.capacity import CapacityClient

    actor = LeasingActor(max_concurrent=100)
    sessions: list[str] = []
    client = CapacityClient(actor.methods(), "replica", count=lambda: len(sessions), block=8)
    assert await client.acquire(task_id="t0")  # alone so far: one slot
    sessions.append("t0")
    assert actor.calls == [("lease", 1)]
    assert await client.acquire(task_id="t1")  # a second within SPARE_IDLE_S: two slots, one spare
    sessions.append("t1")
    for n in range(2, 3):
        assert await client.acquire(task_id=f"t{n}")  # the spare: no call
        sessions.append(f"t{n}")
    assert actor.calls == [("lease", 1), ("lease", 2)] and actor.held == 3
    for _ in range(3):
        sessions.pop()
        await client.release(accepted=True)  # gathered, not sent yet
    assert actor.held == 3
    await client.flush()
    assert actor.calls[-1] == ("settle", 3) and (actor.held, actor.accepted) == (0, 3)
    assert actor.started == ["t2"]  # the session opened in a spare is named to the actor


async def test_the_holders_together_never_hold_more_than_max_concurrent():
    """Two holders leasing from one actor of 6 slots: however the slots are
    leased, spared and given back, the actor never counts more than 6 held, and
    a session is refused only when all 6 are taken by open sessions or spares."""
    from rlgate.actors.capacity import CapacityClient

    actor = LeasingActor(max_concurrent=6)
    open_a, open_b = [], []
    a = CapacityClient(actor.methods(), "a", count=lambda: len(open_a), block=8)
    b = CapacityClient(actor.methods(), "b", count=lambda: len(open_b), block=8)
    for _ in range(4):  # a leases blocks as its sessions come quickly
        assert await a.acquire()
        open_a.append(1)
    assert actor.held <= 6
    granted_b = 0
    for _ in range(6):
        if await b.acquire():
            granted_b += 1
            open_b.append(1)
    assert actor.most_held <= 6 and len(open_a) + granted_b <= 6
    await a.flush()  # a's spares back: b may take them now
    assert actor.held == len(open_a) + len(open_b) + b._spares
    while await b.acquire():
        open_b.append(1)
    assert len(open_a) + len(open_b) == 6 and actor.most_held <= 6


async def test_spares_no_session_takes_and_ended_sessions_slots_go_back_on_their_own(quick_lease):
    from rlgate.actors.capacity import CapacityClient

    actor = LeasingActor(max_concurrent=100)
    sessions: list[int] = []
    client = CapacityClient(actor.methods(), "replica", count=lambda: len(sessions), block=8)
    for _ in range(4):
        assert await client.acquire()
        sessions.append(1)
    assert actor.held > len(sessions)  # spares leased
    sessions.clear()
    for _ in range(4):
        await client.release(accepted=False)
    await eventually(lambda: actor.held == 0)  # the ended sessions' slots and the idle spares, unasked
    assert client._spares == 0 and actor.accepted == 0


async def test_with_a_trainer_attached_every_session_takes_and_returns_its_own_slot(quick_lease):
    """The staleness rule and whole-group admission are the actor's: a holder
    leases nothing, and sends each release at once; spares leased before the
    trainer attached are not used and go back."""
    from rlgate.actors.capacity import CapacityClient

    actor = LeasingActor(max_concurrent=100)
    sessions: list[int] = []
    client = CapacityClient(actor.methods(), "replica", count=lambda: len(sessions), block=8)
    for _ in range(4):  # lease(1), lease(2), the spare, lease(4)
        assert await client.acquire()
        sessions.append(1)
    assert client._spares == 3
    actor.trainer = True  # attaches; the holder learns it from the next answer
    await client.flush()
    assert client._spares == 0 and actor.held == 4
    before = len(actor.calls)
    assert await client.acquire() and await client.acquire()
    sessions += [1, 1]
    assert [call for call, _ in actor.calls[before:]] == ["lease", "lease"] and client._spares == 0
    assert actor.held == 6  # one slot each
    sessions.pop()
    await client.release(accepted=True)
    assert actor.calls[-1] == ("release", 1) and (actor.held, actor.accepted) == (5, 1)  # sent at once


async def test_a_recount_after_the_actors_restart_counts_gathered_releases_and_lands_exact():
    """The actor dies under a session's call for a slot while another session's
    end is gathered, its slot not sent yet: the recount counts that slot as held
    (it is sent after), so once everything is back the actor counts exactly the
    open sessions."""
    from ray.exceptions import RayActorError

    from rlgate.actors.capacity import CapacityClient

    actor = LeasingActor(max_concurrent=100)
    sessions: list[str] = []
    methods = actor.methods()
    client = CapacityClient(methods, "replica", count=lambda: len(sessions), block=8)
    for name in ("a", "b"):  # lease(1), then lease(2): one spare
        assert await client.acquire()
        sessions.append(name)
    assert await client.acquire()  # the spare
    sessions.append("c")
    lease, dying = methods.lease, asyncio.Event()

    class DiesUnderIt:
        def remote(self, *args):
            async def call():
                await dying.wait()
                actor.held = 99  # what the restarted actor thinks: unknown until the holder recounts
                raise RayActorError()

            methods.lease = lease  # once
            return asyncio.ensure_future(call())

    methods.lease = DiesUnderIt()
    asking = asyncio.ensure_future(client.acquire())
    await asyncio.sleep(0.01)
    sessions.remove("a")
    await client.release(accepted=True)  # gathered: a's slot is still to be sent
    dying.set()
    assert await asking
    sessions.append("d")
    assert ("reconcile", 3) in actor.calls  # b and c open + a's slot still to come
    await client.flush()
    assert actor.held == len(sessions) == 3 and actor.accepted == 1


async def test_an_ended_sessions_slot_opens_the_holders_next_session_without_a_call():
    """An agent that ends its session and starts the next (the usual loop) makes
    no capacity call: the slot passes from one session to the next, and the
    actor hears of the accepted session (and the task started) later, in one call."""
    from rlgate.actors.capacity import CapacityClient

    actor = LeasingActor(max_concurrent=1)
    sessions: list[str] = []
    client = CapacityClient(actor.methods(), "replica", count=lambda: len(sessions), block=8)
    assert await client.acquire(task_id="first")
    sessions.append("first")
    calls = len(actor.calls)
    for n in range(5):
        sessions.pop()
        await client.release(accepted=True)
        assert await client.acquire(task_id=f"next{n}")
        sessions.append(f"next{n}")
    assert len(actor.calls) == calls and actor.held == 1  # never more than max_concurrent, no call
    await client.flush()
    assert (actor.held, actor.accepted, actor.started) == (1, 5, [f"next{n}" for n in range(5)])


async def test_a_burst_of_sessions_asking_at_once_takes_one_slot_each():
    """Sessions that ask together, before any lease has answered, each take one
    slot: none of them counts the others' asks as demand for spares."""
    from rlgate.actors.capacity import CapacityClient

    actor = LeasingActor(max_concurrent=64)
    client = CapacityClient(actor.methods(), "replica", block=8)
    assert all(await asyncio.gather(*[client.acquire() for _ in range(8)]))
    assert actor.held == 8 and client._spares == 0
