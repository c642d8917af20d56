"""CapacityClient, a holder's side of the CapacityActor, against a fake actor (no
Ray): what it counts as held when it recounts after the actor's restart, and
slots whose callers left."""

from __future__ import annotations

import asyncio


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

    async def acquire(timeout_s, task_id, group_size, holder) -> bool:
        if refusals["acquire"]:
            refusals["acquire"] -= 1
            raise RayActorError()
        state["held"] += 1
        return True

    async def reconcile(running: int, holder: str) -> None:
        if refusals["reconcile"]:
            refusals["reconcile"] -= 1
            raise ActorUnavailableError("restarting", None)
        state["held"] = running

    async def release(accepted: bool, holder: str) -> None:
        state["held"] -= 1

    actor = fake_actor(acquire=acquire, reconcile=reconcile, release=release)
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

    async def acquire(timeout_s, task_id, group_size, holder) -> bool:
        await freed.wait()  # a slot comes free after the caller left
        state["held"] += 1
        return True

    async def release(accepted: bool, holder: str) -> None:
        state["held"] -= 1
        state["released"].append(accepted)

    actor = fake_actor(acquire=acquire, release=release)
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

    async def acquire(timeout_s, task_id, group_size, holder) -> bool:
        await granting.wait()
        state["held"] += 1
        return True

    async def release(accepted: bool, holder: str) -> None:
        await granting.wait()  # answered with the grant: the actor died under it
        raise RayActorError()

    async def reconcile(running: int, holder: str) -> None:
        state["held"] = running

    held = ["a"]
    actor = fake_actor(acquire=acquire, release=release, reconcile=reconcile)
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
