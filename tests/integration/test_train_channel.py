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
