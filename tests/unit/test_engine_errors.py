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
