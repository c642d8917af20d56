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


class Ready(NeverReady):
    async def ready(self) -> None:
        pass


class StoreGone:
    """A PolicyFollower whose PolicyStore is gone: its start fails, and so does its stop."""

    def __init__(self, *args) -> None:
        pass

    async def start(self) -> None:
        raise RuntimeError("the policy store is gone")

    async def stop(self) -> None:
        raise RuntimeError("the policy store is gone")


CONTEXT = SimpleNamespace(rank=SimpleNamespace(rank=0), app_name="app", replica_id=SimpleNamespace(unique_id="r"))


def engines_started(monkeypatch, kind: type) -> list[NeverReady]:
    """The engines (of ``kind``) the replica under test starts."""
    engines = []

    def run_engine(*args):
        engines.append(kind())
        return engines[-1]

    monkeypatch.setattr(gateway_module, "run_engine", run_engine)
    monkeypatch.setattr(rollout_module, "run_engine", run_engine)
    return engines


@pytest.fixture
def started(monkeypatch) -> list[NeverReady]:
    """The engines the replica under test starts, each one's start failing."""
    return engines_started(monkeypatch, NeverReady)


@pytest.fixture
def started_storeless(monkeypatch) -> list[NeverReady]:
    """The engines the replica under test starts, ready, but the run's PolicyStore gone."""
    for module in (gateway_module, rollout_module):
        monkeypatch.setattr(module, "PolicyFollower", StoreGone)
        monkeypatch.setattr(module, "get_or_create_policy_store", lambda *args: None)
    monkeypatch.setattr(gateway_module.serve, "get_replica_context", lambda: CONTEXT)
    return engines_started(monkeypatch, Ready)


async def test_a_gateway_refused_before_it_starts_anything_ends_cleanly(monkeypatch, tmp_path):
    async def beyond_loopback() -> str:
        return "0.0.0.0"

    monkeypatch.setattr(gateway_module, "proxy_host", beyond_loopback)
    config = parse_config(SETTINGS | {"gateway": {"run_dir": str(tmp_path)}}).model_dump()
    replica, delete = unmade(gateway_module.Gateway)
    with pytest.raises(AdminKeyRefused):
        await replica.__init__(None, config, "model", "hash")
    await delete()  # nothing started: nothing to end, and no AttributeError


# (the engines the replica starts, what its constructor fails with, whether its __del__ fails too: Serve logs that)
FAILURES = {
    "engine start": ("started", "KV cache", False),
    "policy store gone": ("started_storeless", "policy store is gone", True),
}


async def constructed_then_deleted(request, failing: str, replica, delete, *args) -> list[NeverReady]:
    """Construct ``replica`` (failing as ``failing`` says), delete it as Serve would; the engines it started."""
    fixture, error, deleting_fails = FAILURES[failing]
    started = request.getfixturevalue(fixture)
    with pytest.raises(RuntimeError, match=error):
        await replica.__init__(*args)
    if deleting_fails:
        with pytest.raises(RuntimeError, match=error):  # the engine is ended all the same
            await delete()
    else:
        await delete()
    return started


@pytest.mark.parametrize("failing", FAILURES)
async def test_a_colocated_gateway_that_fails_to_start_ends_its_engine(monkeypatch, tmp_path, request, failing):
    async def loopback() -> str:
        return "127.0.0.1"

    monkeypatch.setattr(gateway_module, "proxy_host", loopback)
    monkeypatch.setattr(gateway_module, "run_stores", lambda gateway: (None, None))
    monkeypatch.setattr(gateway_module.serve, "get_replica_context", lambda: CONTEXT)
    config = parse_config(SETTINGS | {"gateway": {"run_dir": str(tmp_path), "colocate": True}}).model_dump()
    replica, delete = unmade(gateway_module.Gateway)
    started = await constructed_then_deleted(request, failing, replica, delete, None, config, "model", "hash")
    assert [engine.shut_down for engine in started] == [True]


@pytest.mark.parametrize("failing", FAILURES)
async def test_a_rollout_server_that_fails_to_start_ends_its_engine(tmp_path, request, failing):
    config = parse_config(SETTINGS | {"gateway": {"run_dir": str(tmp_path)}}).model_dump()
    replica, delete = unmade(rollout_module.RolloutServer)
    started = await constructed_then_deleted(request, failing, replica, delete, config, "model")
    assert [engine.shut_down for engine in started] == [True]
