"""The TrainChannel's rules without Ray (its class, as a worker and the driver see it)."""

from __future__ import annotations

from rlgate.actors.train_channel import TrainChannel

Channel = TrainChannel.__ray_actor_class__


async def test_a_worker_skips_its_start_only_when_stop_came_before_any_step():
    """Every rank must decide alike: once a step was sent, each replays it and stops at
    the stop command (a rank returning early would leave the others in a collective)."""
    fresh = Channel(first_index=7)  # a resumed run numbers on from its checkpoint
    assert not await fresh.stopped_before_any_step()
    await fresh.submit({"op": "stop"})
    assert await fresh.stopped_before_any_step()

    stepped = Channel()
    await stepped.submit({"op": "step"})
    assert not await stepped.stopped_before_any_step()
    await stepped.submit({"op": "stop"})
    await stepped.forget_below(1)  # a checkpoint covered the step: it is still a step that was sent
    assert not await stepped.stopped_before_any_step()
    assert (await stepped.fetch(1))["op"] == "stop"
