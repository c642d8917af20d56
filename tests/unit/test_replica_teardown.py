"""A Serve replica whose constructor fails is still ended by Serve (``__del__``):
it must end whatever it had started by then, and not fail on what it had not
(without Ray: the deployments' classes with their cluster calls replaced)."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest

from rlgate.actors import gateway as gateway_module
from rlgate.actors import rollout_server as rollout_module
from rlgate.config import parse_config
from rlgate.serving.auth import AdminKeyRefused

SETTINGS = {"model": {"name": "tiny-random"}, "rollout": {"engine": "hf"}}


def unmade(deployment):
    """An instance of the class under ``deployment`` (and under ``serve.ingress``'s wrapper,
    which subclasses it), not yet constructed, and its ``__del__``: Serve awaits that
    coroutine, the tests do too, and the garbage collector is left a plain one."""
    cls = next(c for c in deployment.func_or_class.__mro__ if c.__name__ == deployment.name)
    quiet = type(cls.__name__, (cls,), {"__del__": lambda self: None})
    replica = object.__new__(quiet)
    return replica, partial(cls.__del__, replica)


class NeverReady:
    """An engine whose start fails (out of memory for its KV cache, say)."""

    def __init__(self) -> None:
        self.shut_down = False

    async def ready(self) -> None:
        raise RuntimeError("not enough memory for the KV cache")

    async def shutdown(self) -> None:
        self.shut_down = True


@pytest.fixture
def started(monkeypatch) -> list[NeverReady]:
    """The engines the replica under test starts (each one's start fails)."""
    engines = []

    def run_engine(*args):
        engines.append(NeverReady())
        return engines[-1]

    monkeypatch.setattr(gateway_module, "run_engine", run_engine)
    monkeypatch.setattr(rollout_module, "run_engine", run_engine)
    return engines


async def test_a_gateway_refused_before_it_starts_anything_ends_cleanly(monkeypatch, tmp_path):
    async def beyond_loopback() -> str:
        return "0.0.0.0"

    monkeypatch.setattr(gateway_module, "proxy_host", beyond_loopback)
    config = parse_config(SETTINGS | {"gateway": {"run_dir": str(tmp_path)}}).model_dump()
    replica, delete = unmade(gateway_module.Gateway)
    with pytest.raises(AdminKeyRefused):
        await replica.__init__(None, config, "model", "hash")
    await delete()  # nothing started: nothing to end, and no AttributeError


async def test_a_colocated_gateway_whose_engine_fails_to_start_ends_that_engine(monkeypatch, tmp_path, started):
    async def loopback() -> str:
        return "127.0.0.1"

    context = SimpleNamespace(rank=SimpleNamespace(rank=0), app_name="app", replica_id=SimpleNamespace(unique_id="r"))
    monkeypatch.setattr(gateway_module, "proxy_host", loopback)
    monkeypatch.setattr(gateway_module, "run_stores", lambda gateway: (None, None))
    monkeypatch.setattr(gateway_module.serve, "get_replica_context", lambda: context)
    config = parse_config(SETTINGS | {"gateway": {"run_dir": str(tmp_path), "colocate": True}}).model_dump()
    replica, delete = unmade(gateway_module.Gateway)
    with pytest.raises(RuntimeError, match="KV cache"):
        await replica.__init__(None, config, "model", "hash")
    await delete()
    assert [engine.shut_down for engine in started] == [True]


async def test_a_rollout_server_whose_engine_fails_to_start_ends_that_engine(tmp_path, started):
    config = parse_config(SETTINGS | {"gateway": {"run_dir": str(tmp_path)}}).model_dump()
    replica, delete = unmade(rollout_module.RolloutServer)
    with pytest.raises(RuntimeError, match="KV cache"):
        await replica.__init__(config, "model")
    await delete()
    assert [engine.shut_down for engine in started] == [True]
