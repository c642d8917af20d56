"""The driver's calls to actors that restart in place (no Ray: the call is faked)."""

from __future__ import annotations

import pytest
import ray.exceptions

from rlgate import loop


def test_a_call_that_meets_a_restart_is_made_again(monkeypatch):
    monkeypatch.setattr(loop.ray, "get", lambda value: value)
    monkeypatch.setattr(loop.time, "sleep", lambda s: None)
    answers = iter([ray.exceptions.ActorUnavailableError("restarting", None), ray.exceptions.RayActorError(), 7])

    def call():
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert loop.surviving(call, "a read") == 7


def test_an_actor_that_never_comes_back_is_an_error_in_the_end(monkeypatch):
    monkeypatch.setattr(loop.ray, "get", lambda value: value)
    monkeypatch.setattr(loop.time, "sleep", lambda s: None)

    def call():
        raise ray.exceptions.RayActorError()

    with pytest.raises(ray.exceptions.RayActorError):
        loop.surviving(call, "a read", within_s=0.0)
