"""The vLLM plugin that makes an engine's processes wait without spinning (on CPU)."""

from __future__ import annotations

import importlib.metadata

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
    monkeypatch.setattr(spin, "wait", lambda self, timeout_ms=None: seen.append(self.busy_loop_s))
    monkeypatch.setattr(spin, "_rlgate_quiet", False, raising=False)
    monkeypatch.setenv(quiet_waits.QUIET_ENV, "1")
    quiet_waits.register()
    reader = object.__new__(spin)
    reader.busy_loop_s = 1.0  # vLLM's: spin for a second after each read
    reader.wait(5)
    assert seen == [0.0] and spin._rlgate_quiet
