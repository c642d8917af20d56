"""Built-in tasks and the small agent loop that plays them through the gateway.

A task hands out problems (chat messages) and scores a reply in [0, 1]. The
agent loop (:func:`play`) is what an external agent would do: for each problem
it starts ``group_size`` sessions (one GRPO group), plays each episode, sets
the reward and ends the session. An episode is either a built-in task played
by an ordinary OpenAI-SDK agent (:func:`builtin_episodes`) or one rollout of
a task app (:func:`task_app_episodes`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import re
import secrets
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from rlgate.sessions.manager import redact

logger = logging.getLogger(__name__)


@dataclass
class Problem:
    id: str
    messages: list[dict]
    answer: str = ""
    row: dict | None = None  # a dataset task's row, for its reward function


class Vowels:
    """Reply with as many vowels as possible: a reward any model can climb
    quickly (the fraction of letters in the reply that are vowels)."""

    name = "vowels"

    def problem(self, rng: random.Random) -> Problem:
        topic = rng.choice(["the sea", "a cat", "music", "rain", "a garden", "the moon"])
        return Problem(f"vowels-{topic}", [{"role": "user", "content": f"Say something about {topic}."}])

    def reward(self, problem: Problem, reply: str) -> float:
        letters = [c for c in reply.lower() if c.isalpha()]
        return sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0


class Arithmetic:
    """Small sums; reward 1 when the first number in the reply is the answer."""

    name = "arithmetic"

    def problem(self, rng: random.Random) -> Problem:
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        question = f"What is {a} + {b}? Answer with the number only."
        return Problem(f"add-{a}-{b}", [{"role": "user", "content": question}], str(a + b))

    def reward(self, problem: Problem, reply: str) -> float:
        found = re.search(r"-?\d+", reply)
        return float(found is not None and found.group() == problem.answer)


TASKS = {"vowels": Vowels, "arithmetic": Arithmetic}


def get_task(name: str):
    if name not in TASKS:
        raise ValueError(f"unknown built-in task {name!r}; known: {', '.join(TASKS)}")
    return TASKS[name]()


@dataclass
class EpisodeStats:
    """What the player has done so far; read by the driver for its metrics."""

    played: int = 0  # episodes rewarded and ended
    failed: int = 0  # episodes ended as failed (their environment or the policy call errored)
    last_error: str | None = None
    fatal: str | None = None  # why the player gave up (the environment stayed down); it stops then
    last_success: float = field(default_factory=time.monotonic)
    failed_since_success: int = 0


async def play(
    url: str,
    admin_key: str,
    groups: Iterator[tuple[str, Any]],
    run: Callable[[dict, Any], Awaitable[float | tuple[float, list[float]]]],
    group_size: int,
    concurrency: int,
    stop: threading.Event,
    stats: EpisodeStats | None = None,
    down_after_s: float = 60.0,
) -> None:
    """Play episodes until ``stop`` is set, a group of ``group_size`` sessions per
    item of ``groups`` (``(task_id, problem)``). Each episode: start a session
    (long-polling for capacity), ``reward = await run(session, problem)`` with the
    ``start_session`` answer (a reward, or ``(reward, turn_rewards)``), set it, end the session. An episode that
    raises is ended as failed and costs that episode only; when every episode
    for ``down_after_s`` seconds has failed, the player sets ``stats.fatal`` and stops."""
    import httpx

    stats = stats if stats is not None else EpisodeStats()
    slots = asyncio.Semaphore(concurrency)
    admin = {"Authorization": f"Bearer {admin_key}"}

    async def episode(http: httpx.AsyncClient, task_id: str, problem: Any) -> None:
        async with slots:
            while not stop.is_set():  # a long poll: the staleness bound admits us when the policy moves on
                started = await http.post(
                    f"{url}/rl/start_session", json={"task_id": task_id, "wait_s": 10.0}, headers=admin
                )
                if started.status_code != 429:
                    break
            else:
                return
            started.raise_for_status()
            session = started.json()
            auth = {"Authorization": f"Bearer {session['api_key']}"}
            try:
                reward = await run(session, problem)
                body = (
                    {"reward": reward[0], "turn_rewards": reward[1]}
                    if isinstance(reward, tuple)
                    else {"reward": reward}
                )
                answer = await http.post(f"{url}/rl/set_reward", json=body, headers=auth)
                if answer.status_code != 200:  # its status only: errors end up in the job's record
                    raise RuntimeError(f"set_reward: {answer.status_code} {answer.reason_phrase}")
            except Exception as err:
                await http.post(f"{url}/rl/end_session", json={"failed": True}, headers=auth)
                failed(f"{err.__class__.__name__}: {err}")
                return
            (await http.post(f"{url}/rl/end_session", headers=auth)).raise_for_status()
            stats.played += 1
            stats.last_success, stats.failed_since_success = time.monotonic(), 0

    def failed(error: str) -> None:
        error = redact(error)
        stats.failed += 1
        stats.failed_since_success += 1
        if stats.last_error != error:
            logger.warning("episode failed: %s", error)
        stats.last_error = error
        quiet_s = time.monotonic() - stats.last_success
        if stats.fatal is None and stats.failed_since_success >= 3 and quiet_s >= down_after_s:
            stats.fatal = f"every episode for {quiet_s:.0f} s failed; the last: {error}"
            stop.set()

    async with httpx.AsyncClient(timeout=600) as http:
        running: set[asyncio.Task] = set()
        while not stop.is_set():
            for finished in [t for t in running if t.done()]:
                running.discard(finished)
                if finished.exception() is not None:  # the gateway refused the session itself
                    failed(f"{finished.exception()}")
            if len(running) >= 2 * concurrency:
                await asyncio.sleep(0.05)
                continue
            task_id, problem = next(groups)
            running.update(asyncio.create_task(episode(http, task_id, problem)) for _ in range(group_size))
        await asyncio.gather(*running, return_exceptions=True)


def builtin_episodes(
    task, url: str, max_tokens: int = 32, temperature: float = 1.0, seed: int = 0, env_delay_s: float = 0.0
) -> tuple[Iterator[tuple[str, Problem]], Callable[[dict, Problem], Awaitable[float]]]:
    """``(groups, run)`` for :func:`play` on a built-in task, played by an ordinary
    OpenAI-SDK agent with its session key. ``env_delay_s`` > 0 makes the
    environment slow: each turn then takes a uniformly random 0 to 2 ×
    ``env_delay_s`` seconds before it is scored."""
    import openai

    rng = random.Random(seed)

    player = secrets.token_hex(4)  # this driver's: a resumed run's groups never join the earlier run's

    def groups() -> Iterator[tuple[str, Problem]]:
        for number in itertools.count():
            problem = task.problem(rng)
            # each group its own task id: two groups of one problem in flight at once never mix
            yield f"{problem.id}.{player}-{number}", problem

    # One connection pool for every episode's agent, per event loop that plays them: a client of its own per
    # episode costs ~18 ms of CPU to make (its SSL context) and a new connection to the gateway each time
    # (the SDK's own client class, with the SDK's defaults: timeout, connection limits, redirects)
    pools: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    async def run(session: dict, problem: Problem) -> float:
        loop = asyncio.get_running_loop()
        if (pool := pools.get(loop)) is None:
            pool = pools[loop] = openai.DefaultAsyncHttpxClient()
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=session["api_key"], max_retries=2, http_client=pool)
        reply = await client.chat.completions.create(
            model="default", messages=problem.messages, max_tokens=max_tokens, temperature=temperature
        )
        if env_delay_s > 0:  # the environment's own time (tools, a simulator, a judge)
            await asyncio.sleep(rng.uniform(0, 2 * env_delay_s))
        # in a thread: a slow scorer (a judge, a verifier) holds up no other episode
        return await asyncio.to_thread(task.reward, problem, reply.choices[0].message.content or "")

    return groups(), run


def task_app_episodes(
    app, config, model: str, run_id: str, mode: str = "rl", skip: int = 0
) -> tuple[Iterator[tuple[str, int]], Callable[[dict, int], Awaitable[float | tuple[float, list[float]]]]]:
    """``(groups, run)`` for :func:`play` against a task app (``rlgate.sdk.taskapp.TaskAppClient``):
    a group per seed (``[task] seeds`` in turn, or ``[task] seed_start``, + 1, ...),
    training skipping the seeds ``[evaluation]`` holds out, after the first ``skip``
    groups (a resumed run's: those its steps trained on); each episode is one
    ``POST /rollout`` whose policy is the session's scoped inference URL. Its
    ``metrics.outcome_reward`` is the reward; ``metrics.event_rewards``, when
    given, are per-turn rewards on the session's completions in order."""
    from rlgate.sdk.taskapp import EnvSpec, PolicySpec, RolloutRequest, TaskAppError

    task = config.task
    name = task.env_name or "task"
    env_config = {**task.env_config, **(config.evaluation.env_config if mode == "eval" else {})}

    held_out = set(config.evaluation.seeds) if mode == "rl" and config.evaluation.every_n_iters else set()
    player = secrets.token_hex(4)  # this driver's: a resumed run's groups never join the earlier run's

    def groups() -> Iterator[tuple[str, int]]:
        seeds = itertools.cycle(task.seeds) if task.seeds else itertools.count(task.seed_start)
        played = itertools.islice((seed for seed in seeds if seed not in held_out), skip, None)
        # each group its own task id: a seed played again (task seeds cycle) is a group of its own
        for number, seed in enumerate(played):
            yield f"{name}-seed-{seed}.{player}-{number}", seed

    async def run(session: dict, seed: int) -> float:
        policy = {**task.policy_config, "model": model, "inference_url": session["inference_url"]}
        request = RolloutRequest(
            run_id=f"{run_id}-{session['session_id']}",
            env=EnvSpec(env_name=task.env_name, config={"max_turns": task.max_turns, **env_config}, seed=seed),
            policy=PolicySpec(policy_name=task.policy_name, config=policy),
            mode=mode,
            ops=task.ops,
            record={"trajectories": True},
            training_session_id=session["session_id"],
        )
        response = await app.rollout(request)
        reward = response.metrics.reward()
        if reward is None:
            raise TaskAppError("POST /rollout: metrics carry no outcome_reward")
        events = response.metrics.event_rewards
        return (reward, events) if events else reward

    return groups(), run


class Episodes:
    """:func:`play` in a thread of its own, with its :class:`EpisodeStats`."""

    def __init__(self, stats: EpisodeStats, stop: threading.Event, thread: threading.Thread) -> None:
        self.stats, self._stop, self.thread = stats, stop, thread

    @classmethod
    def start(
        cls,
        url: str,
        admin_key: str,
        groups: Iterator[tuple[str, Any]],
        run: Callable[[dict, Any], Awaitable[float]],
        group_size: int,
        concurrency: int,
        down_after_s: float = 60.0,
        on_fatal: threading.Event | None = None,
    ) -> Episodes:
        """Start playing; ``on_fatal`` is set too if the player gives up."""
        stats, stop = EpisodeStats(), threading.Event()

        def main() -> None:
            asyncio.run(play(url, admin_key, groups, run, group_size, concurrency, stop, stats, down_after_s))
            if stats.fatal is not None and on_fatal is not None:
                on_fatal.set()

        thread = threading.Thread(target=main, daemon=True, name="rlgate-episodes")
        thread.start()
        return cls(stats, stop, thread)

    def stop(self) -> None:
        self._stop.set()
