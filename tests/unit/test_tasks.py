"""The agent loop that plays episodes through the gateway (``tasks.play``),
against a small fake of the gateway's session routes on a loopback port."""

from __future__ import annotations

import itertools
import random
import threading

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rlgate.training.tasks import EpisodeStats, get_task, play
from tests.support import serve_asgi


def gateway(refusals: int = 0) -> tuple[FastAPI, list[tuple]]:
    """The session routes, recording every call; the first ``refusals`` starts answer 429."""
    app, calls, keys = FastAPI(), [], itertools.count(1)
    refused = [refusals]

    @app.post("/rl/start_session")
    async def start(request: Request):
        body = await request.json()
        calls.append(("start", body["task_id"], request.headers["authorization"]))
        if refused[0]:
            refused[0] -= 1
            return JSONResponse({"error": {"message": "no capacity"}}, status_code=429, headers={"Retry-After": "1"})
        return {"api_key": f"key-{next(keys)}", "session_id": "s", "inference_url": "unused"}

    @app.post("/rl/set_reward")
    async def reward(request: Request):
        calls.append(("reward", request.headers["authorization"], (await request.json())["reward"]))
        return {}

    @app.post("/rl/end_session")
    async def end(request: Request):
        body = await request.body()
        calls.append(("end", request.headers["authorization"], b'"failed":true' in body.replace(b" ", b"")))
        return {}

    return app, calls


async def test_each_problem_is_a_group_of_sessions_rewarded_and_ended_and_a_failure_costs_one_episode():
    app, calls = gateway(refusals=1)
    stop, stats = threading.Event(), EpisodeStats()
    problems = iter([("t1", "p1"), ("t2", "p2"), ("t3", "p3")] + [("more", "p")] * 100)

    async def run(session: dict, problem: str) -> float:
        if session["api_key"] == "key-2":
            raise RuntimeError("the simulator fell over at /s/rlg-secret/v1")
        if stats.played + stats.failed >= 5:
            stop.set()
        return 1.0 if problem == "p1" else (0.5, [0.25, 0.25])

    with serve_asgi(app) as url:
        await play(url, "admin", problems, run, group_size=2, concurrency=2, stop=stop, stats=stats)
    starts = [c for c in calls if c[0] == "start"]
    assert [t for _, t, _ in starts[:5]] == ["t1", "t1", "t1", "t2", "t2"]  # a group per problem; a 429 is asked again
    assert all(who == "Bearer admin" for _, _, who in starts)
    ended = {who: failed for kind, who, failed in calls if kind == "end"}
    rewarded = {who: reward for kind, who, reward in calls if kind == "reward"}
    assert ended["Bearer key-2"] is True and "Bearer key-2" not in rewarded  # ended as failed, never rewarded
    assert all(not failed for who, failed in ended.items() if who != "Bearer key-2")
    assert set(rewarded) == set(ended) - {"Bearer key-2"}  # every other episode rewarded, then ended
    assert stats.failed == 1 and stats.played == len(rewarded) and stats.fatal is None
    assert "rlg-secret" not in stats.last_error and "/s/<session key>" in stats.last_error  # keys are redacted


async def test_a_player_whose_every_episode_fails_says_the_environment_is_down_and_stops():
    app, calls = gateway()
    stats = EpisodeStats()

    async def run(session: dict, problem) -> float:
        raise ConnectionError("database unreachable")

    task = get_task("vowels")
    problems = ((f"t{i}", task.problem(random.Random(i))) for i in itertools.count())
    with serve_asgi(app) as url:
        await play(url, "admin", problems, run, 2, 2, threading.Event(), stats, down_after_s=0.0)
    assert stats.fatal.startswith("every episode for") and "ConnectionError: database unreachable" in stats.fatal
    assert stats.played == 0 and stats.failed >= 3
    assert all(failed for kind, _, failed in calls if kind == "end")


def test_task_app_groups_skip_held_out_seeds_and_never_share_a_task_id():
    """Training played the seeds [evaluation] holds out (0, 1, ... are both), and a
    seed played again (task seeds cycle; a resumed run) joined the earlier group."""
    import itertools

    from rlgate.config import parse_config
    from rlgate.training.tasks import task_app_episodes

    config = parse_config({"evaluation": {"every_n_iters": 2, "seeds": [0, 1, 3]}})
    groups, _ = task_app_episodes(None, config, "m", "run")
    played = list(itertools.islice(groups, 4))
    assert [seed for _, seed in played] == [2, 4, 5, 6]
    assert len({task_id for task_id, _ in played}) == 4 and played[0][0].startswith("task-seed-2.")
    resumed, _ = task_app_episodes(None, config, "m", "run", skip=16)  # its steps trained 16 groups
    assert next(resumed)[1] == 19  # 2, 4, 5, ..., 18 were those: the held-out seeds are not counted
    evaluating, _ = task_app_episodes(None, config, "m", "run", mode="eval")
    assert next(evaluating)[1] == 0  # held out of training, not of evaluation

    cycling = parse_config({"task": {"seeds": [7, 8], "seed_start": 0}})
    groups, _ = task_app_episodes(None, cycling, "m", "run")
    again = list(itertools.islice(groups, 4))
    assert [seed for _, seed in again] == [7, 8, 7, 8] and len({task_id for task_id, _ in again}) == 4
    groups, _ = task_app_episodes(None, cycling, "m", "run", skip=3)
    assert next(groups)[1] == 8  # the fourth group's seed
    from rlgate.config import ConfigError

    with pytest.raises(ConfigError, match="every \\[task\\] seed is one of the \\[evaluation\\] seeds"):
        parse_config({"task": {"seeds": [0, 1]}, "evaluation": {"every_n_iters": 1, "seeds": [0, 1, 2]}})


def test_the_builtin_agent_asks_with_each_sessions_key_over_one_connection_per_event_loop():
    """Each episode's chat turn carries its own session key; the episodes of one
    event loop share a connection (a client of their own would each make one), and
    an episode played in another loop (an evaluation's) makes its own."""
    import asyncio

    from rlgate.training.tasks import builtin_episodes

    app, seen = FastAPI(), []

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        seen.append((request.headers["authorization"], request.client.port, (await request.json())["max_tokens"]))
        message = {"role": "assistant", "content": "aeiou"}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        return {"id": "c", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice]}

    with serve_asgi(app) as url:
        groups, run = builtin_episodes(get_task("vowels"), url, max_tokens=5)
        _, problem = next(groups)

        async def episodes(keys: list[str]) -> list[float]:
            return [await run({"api_key": key}, problem) for key in keys]

        played = asyncio.run(episodes(["key-1", "key-2", "key-3"]))
        elsewhere = asyncio.run(episodes(["key-4"]))
    assert played == [1.0, 1.0, 1.0] and elsewhere == [1.0]  # all vowels
    assert [who for who, _, _ in seen] == [f"Bearer key-{n}" for n in (1, 2, 3, 4)]
    assert {tokens for _, _, tokens in seen} == {5}
    assert len({port for _, port, _ in seen[:3]}) == 1  # one connection for the loop's episodes
    assert seen[3][1] != seen[0][1]  # the other loop's own
