"""EngineSyncClient: vLLM's synchronous sender protocol driving an async engine.

The sender side (vLLM's trainer engine) runs in a worker thread and blocks on
each call; the engine's coroutines run on the event loop. A recording engine
stands in for VLLMEngine here (the real CUDA IPC path is in test_gpu.py).
"""

from __future__ import annotations

import asyncio

import pytest

from rlgate.rollout.weight_sync import EngineSyncClient


class RecordingEngine:
    def __init__(self):
        self.calls = []
        self.paused = False

    async def init_weight_transfer(self, info):
        self.calls.append(("init", info))

    async def start_weight_transfer(self):
        self.paused = True
        self.calls.append(("start", None))

    async def receive_weight_transfer(self, info):
        assert self.paused, "weights must arrive while the engine is paused"
        await asyncio.sleep(0.01)  # the loop stays free while the sender thread waits
        self.calls.append(("receive", info))

    async def finish_weight_transfer(self, version):
        self.paused = False
        self.calls.append(("finish", version))


async def test_the_four_protocol_calls_reach_the_engine_in_order():
    engine = RecordingEngine()
    client = EngineSyncClient(engine, asyncio.get_running_loop())

    def sender_round(version):  # what vLLM's trainer engine does, in its thread
        client.next_version = version
        client.start_weight_update()
        client.update_weights({"names": ["w"]})
        client.finish_weight_update()

    await asyncio.to_thread(client.init_weight_transfer_engine, {"packed": False})
    await asyncio.to_thread(sender_round, 7)
    assert engine.calls == [("init", {"packed": False}), ("start", None), ("receive", {"names": ["w"]}), ("finish", 7)]
    assert not engine.paused


async def test_finishing_without_a_version_is_refused():
    client = EngineSyncClient(RecordingEngine(), asyncio.get_running_loop())
    with pytest.raises(RuntimeError, match="set the version"):
        await asyncio.to_thread(client.finish_weight_update)
