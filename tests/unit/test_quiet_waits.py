"""The vLLM plugin that makes an engine's processes wait without spinning (on CPU)."""

from __future__ import annotations

import importlib.metadata
import time

import pytest

from rlgate.rollout.engines import quiet_waits


def test_the_plugin_is_registered_with_vllm():
    plugins = {entry.name: entry.value for entry in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert plugins.get("rlgate_quiet_waits") == "rlgate.rollout.engines.quiet_waits:register"


def test_readers_wait_on_the_notification_only_where_rlgate_asked(monkeypatch):
    shm_broadcast = pytest.importorskip("vllm.distributed.device_communicators.shm_broadcast")
    spin = shm_broadcast.SpinCondition
    monkeypatch.setattr(spin, "wait", spin.wait)  # undone after the test
    monkeypatch.delenv(quiet_waits.QUIET_ENV, raising=False)
    quiet_waits.register()
    assert not getattr(spin, "_rlgate_quiet", False)  # someone else's vllm serve: left as it is

    seen = []
    monkeypatch.setattr(spin, "wait", lambda self, timeout_ms=None: seen.append((self.busy_loop_s, timeout_ms)))
    monkeypatch.setattr(spin, "_rlgate_quiet", False, raising=False)
    monkeypatch.setenv(quiet_waits.QUIET_ENV, "1")
    quiet_waits.register()
    reader = object.__new__(spin)
    reader.busy_loop_s = 1.0  # vLLM's: spin for a second after each read
    reader.last_read = time.monotonic() - 60
    reader.wait(5)  # vLLM's own timeout, shorter than the bound
    reader.wait(None)  # an indefinite wait looks at the queue again after 100 ms at most
    assert seen == [(0.0, 5), (0.0, 100)] and spin._rlgate_quiet


@pytest.mark.parametrize(
    "idle_s, timeout_ms, expected",
    [(0.0, None, 1), (0.0004, 5000, 1), (0.02, None, 20), (0.02, 7, 7), (3.0, None, 100), (3.0, 5000, 100)],
)
def test_a_wait_is_bounded_by_the_readers_idle_time(idle_s, timeout_ms, expected):
    """A lost zmq wake-up costs at most as long again as the reader had waited (1 to 100 ms)."""
    assert quiet_waits.recheck_after_ms(idle_s, timeout_ms) == expected
