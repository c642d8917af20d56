"""How an engine's refusals reach callers, without starting an engine."""

from __future__ import annotations

import pytest

from rlgate.rollout.engines import SamplingParams
from rlgate.rollout.engines.base import EngineInputError


async def test_a_request_vllm_refuses_as_the_clients_fault_is_bad_input_not_an_engine_failure(tiny_path):
    """vLLM refuses some requests at its front end as the client's fault (a JSON
    schema its grammar backend cannot compile, a parameter out of range): that is
    EngineInputError, which the gateway answers 400, not an engine failure (503,
    which tells the client to retry the same request). Other errors pass as they are."""
    from vllm.exceptions import VLLMValidationError

    from rlgate.rollout.engines.vllm import VLLMEngine

    class Refusing:  # vLLM's engine, refusing at the first step of the request
        def __init__(self, error: Exception) -> None:
            self.error = error

        def generate(self, *args, **kwargs):
            async def outputs():
                raise self.error
                yield  # an async generator, as vLLM's

            return outputs()

        async def abort(self, request_id) -> None:
            pass

    engine = VLLMEngine(tiny_path)
    for error, expected in (
        (VLLMValidationError("the JSON schema cannot be compiled"), EngineInputError),
        (RuntimeError("the engine core died"), RuntimeError),
    ):
        engine._llm = Refusing(error)
        with pytest.raises(expected) as raised:
            async for _ in engine.generate([1, 2, 3], SamplingParams(max_tokens=2)):
                pass
        assert str(error) in str(raised.value)
    engine._llm = None


async def test_two_updates_queued_behind_each_other_never_take_the_version_back(tiny_path):
    """The follower's update of v5 and a direct update of v3 both arrive while the
    engine is on v2: the older one, applied second, is refused, not loaded over v5."""
    import asyncio

    from rlgate.rollout.engines.base import Engine

    class Slow(Engine):
        def generate(self, prompt_ids, params, request_id=None, whole=False):
            raise NotImplementedError

        async def _load_weights(self, weights) -> int:
            await asyncio.sleep(0.01)
            self.loaded = weights
            return 1

        async def _set_paused(self, paused: bool) -> None:
            pass

        def running_requests(self) -> int:
            return 0

    engine = Slow(tiny_path, 64, initial_version=2)
    newer, older = await asyncio.gather(
        engine.update_weights({"v": 5}, 5), engine.update_weights({"v": 3}, 3), return_exceptions=True
    )
    assert newer.version == 5 and isinstance(older, ValueError) and "older than the served version 5" in str(older)
    assert engine.version == 5 and engine.loaded == {"v": 5} and engine._pause_depth == 0


async def test_a_request_vllm_refuses_its_sampling_for_counts_no_user_of_its_adapter(tiny_path):
    """vLLM bounds some sampling settings tighter than rlgate's (a temperature past
    2, an empty stop string): such a request is bad input (400), and the adapter
    it would have run on is not left counted as in use (never unloaded)."""
    from types import SimpleNamespace

    from rlgate.rollout.engines.vllm import VLLMEngine

    engine = VLLMEngine(tiny_path, lora_rank=4)
    engine._llm = object()  # never reached
    engine._newest[None] = SimpleNamespace(lora_int_id=1, lora_name="v1")
    engine._lora_users[1] = 0
    with pytest.raises(EngineInputError, match="temperature"):
        async for _ in engine.generate([1, 2, 3], SamplingParams(max_tokens=2, temperature=5.0)):
            pass
    assert engine._lora_users == {1: 0}
    engine._llm = None
    await engine.shutdown()


async def test_an_adapter_vllm_fails_to_unload_is_kept_and_unloaded_next_time(tiny_path, tmp_path):
    """An unload that vLLM refused forgot the adapter (still loaded, never retried),
    skipped the adapters after it, and failed the finished request that triggered it."""
    from types import SimpleNamespace

    from rlgate.rollout.engines.vllm import VLLMEngine

    class Flaky:  # vLLM's engine: the first removal fails
        def __init__(self) -> None:
            self.removed, self.failures = [], 1

        async def remove_lora(self, lora_id) -> bool:
            if self.failures:
                self.failures -= 1
                raise RuntimeError("the engine core is busy")
            self.removed.append(lora_id)
            return True

    engine = VLLMEngine(tiny_path, lora_rank=4)
    engine._llm, engine._lora_dir = Flaky(), tmp_path
    for lora_id in (1, 2, 3):
        (tmp_path / f"v{lora_id}").mkdir()
        engine._loras[lora_id] = SimpleNamespace(
            lora_int_id=lora_id, lora_name=f"v{lora_id}", lora_path=str(tmp_path / f"v{lora_id}")
        )
        engine._lora_users[lora_id] = 0
    engine._newest[None] = engine._loras[3]
    await engine._unload_unused()  # 1 fails (kept), 2 goes
    assert engine._llm.removed == [2] and sorted(engine._loras) == [1, 3] and (tmp_path / "v1").is_dir()
    await engine._unload_unused()
    assert engine._llm.removed == [2, 1] and sorted(engine._loras) == [3] and not (tmp_path / "v1").exists()
    engine._llm = None
    await engine.shutdown()


class _Gated:
    """An engine whose pause and resume take until ``gate`` is set; ``changes`` lists them."""

    @staticmethod
    def make(tiny_path):
        import asyncio

        from rlgate.rollout.engines.base import Engine

        class Gated(Engine):
            def generate(self, prompt_ids, params, request_id=None, whole=False):
                raise NotImplementedError

            async def _load_weights(self, weights) -> int:
                return 1

            async def _set_paused(self, paused: bool) -> None:
                self.changes.append(("start", paused))
                await self.gate.wait()
                self.changes.append(("done", paused))

            def running_requests(self) -> int:
                return 0

        engine = Gated(tiny_path, 64)
        engine.gate, engine.changes = asyncio.Event(), []
        return engine


async def test_a_second_pause_returns_only_once_the_engine_is_paused(tiny_path):
    """A pause nested in one still stopping the engine (the HF engine waits for
    its step in flight) used to return at once, before the engine had stopped."""
    import asyncio

    engine = _Gated.make(tiny_path)
    first = asyncio.create_task(engine.pause())
    await asyncio.sleep(0)
    second = asyncio.create_task(engine.pause())
    await asyncio.sleep(0.01)
    assert not second.done() and engine.changes == [("start", True)]
    engine.gate.set()
    await asyncio.gather(first, second)
    assert engine.changes == [("start", True), ("done", True)] and (await engine.health()).paused
    await engine.resume()
    assert engine.changes[-1] == ("done", True)  # one pause is still held
    await engine.resume()
    assert engine.changes[-2:] == [("start", False), ("done", False)] and not (await engine.health()).paused


async def _cancelled_mid_change(engine, work) -> None:
    """Start ``work``, cancel it while the engine's pause or resume is under way, let the change finish."""
    import asyncio

    task = asyncio.create_task(work)
    await asyncio.sleep(0.01)
    task.cancel()
    engine.gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task


async def _until(condition) -> None:
    import asyncio

    for _ in range(100):
        if condition():
            return
        await asyncio.sleep(0.01)


async def test_a_cancelled_pause_does_not_count_and_a_cancelled_resume_still_resumes(tiny_path):
    """A pause cancelled while the engine stops (Serve cancels a handler whose caller
    left) stayed counted with nobody to resume it: the engine stayed stopped. Now
    the cancelled pause is undone, and a cancelled resume finishes."""
    engine = _Gated.make(tiny_path)
    await _cancelled_mid_change(engine, engine.pause())
    await _until(lambda: engine.changes[-1:] == [("done", False)])
    assert engine.changes == [("start", True), ("done", True), ("start", False), ("done", False)]
    assert engine._pause_depth == 0

    await engine.pause()
    engine.gate.clear()
    await _cancelled_mid_change(engine, engine.resume())
    await _until(lambda: not engine._stopped)
    assert engine.changes[-1] == ("done", False) and engine._pause_depth == 0


async def test_a_weight_update_whose_caller_is_cancelled_still_finishes_with_its_version(tiny_path):
    """Cut short mid-load (a follower stopped, a handler whose caller left), an update
    left the engine on the new weights labelled with the old version."""
    engine = _Gated.make(tiny_path)
    await _cancelled_mid_change(engine, engine.update_weights({"w": 1}, 1))
    await _until(lambda: engine.version == 1 and not engine._stopped)
    assert engine.version == 1 and engine._pause_depth == 0 and engine.changes[-1] == ("done", False)


async def test_a_replica_whose_engine_died_ends_its_process_unless_serve_is_stopping_it(monkeypatch):
    """The liveness probe: a live engine passes; a dead one, while Serve stops the
    replica, fails the probe as it is; otherwise the engine is shut down (its files
    go) and the process ends, so Serve replaces the replica at once."""
    from rlgate.rollout.engines import base

    class Probed:
        def __init__(self) -> None:
            self.dead, self.shut = False, False

        async def check_alive(self) -> None:
            if self.dead:
                raise RuntimeError("the engine core died")

        async def shutdown(self) -> None:
            self.shut = True

    ended = []
    monkeypatch.setattr(base.os, "_exit", ended.append)
    engine = Probed()
    await base.liveness_probe(engine)
    assert ended == [] and not engine.shut
    engine.dead = True
    with pytest.raises(RuntimeError, match="the engine core died"):
        await base.liveness_probe(engine, stopping=True)
    assert ended == [] and not engine.shut
    await base.liveness_probe(engine)
    assert ended == [1] and engine.shut
