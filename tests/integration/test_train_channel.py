"""TrainChannel: numbered commands from the driver, results from every rank, trimmed after checkpoints."""

from __future__ import annotations

from rlgate.actors.train_channel import TrainChannel


async def test_commands_results_and_trimming(ray_session):
    channel = TrainChannel.remote(first_index=5)  # a resumed run continues its numbering
    assert [await channel.submit.remote({"op": "step", "n": n}) for n in range(3)] == [5, 6, 7]
    assert (await channel.fetch.remote(6))["n"] == 1
    for index in (5, 6, 7):
        await channel.done.remote(index, 0, {"loss": float(index)})
    assert await channel.wait.remote(6, 1, 1.0) == {0: {"loss": 6.0}}
    assert await channel.wait.remote(7, 2, 0.1) is None  # rank 1 has not answered
    await channel.forget_below.remote(7)  # a checkpoint covers 5 and 6
    assert await channel.wait.remote(6, 1, 0.1) is None
    assert (await channel.fetch.remote(7))["n"] == 2 and await channel.wait.remote(7, 1, 1.0) == {0: {"loss": 7.0}}
    assert await channel.submit.remote({"op": "stop"}) == 8
    ray_session.kill(channel)


async def test_a_restarted_worker_answers_the_step_its_checkpoint_ended_with(ray_session):
    """A worker killed after reporting a step's checkpoint but before its ``done``
    restarts past that step: without its word the driver waited for it an hour."""
    channel = TrainChannel.remote()
    saving = await channel.submit.remote({"op": "step", "save": True})
    await channel.done.remote(saving, 1, {"loss": 0.5})  # rank 1 told the driver; rank 0 died first
    assert await channel.wait.remote(saving, 2, 0.1) is None
    await channel.done_at_checkpoint.remote(saving, 0, {"loss": 0.25})  # from rank 0's checkpoint, restarted
    await channel.done_at_checkpoint.remote(saving, 1, {"loss": 9.0})  # rank 1's own word stands
    assert await channel.wait.remote(saving, 2, 1.0) == {0: {"loss": 0.25}, 1: {"loss": 0.5}}
    await channel.forget_below.remote(saving + 1)
    await channel.done_at_checkpoint.remote(saving, 0, {"loss": 1.0})  # the driver has moved on: nothing kept
    assert await channel.wait.remote(saving, 1, 0.1) is None
    ray_session.kill(channel)
