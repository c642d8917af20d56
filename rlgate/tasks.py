"""Built-in tasks and the small agent loop that plays them through the gateway.

A task hands out problems (chat messages) and scores a reply in [0, 1]. The
agent loop is an ordinary OpenAI-SDK agent: for each problem it starts
``group_size`` sessions (one GRPO group), asks, scores, sets the reward and
ends the session, exactly as an external agent would.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import threading
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass
class Problem:
    id: str
    messages: list[dict]
    answer: str = ""


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


async def play(
    url: str,
    admin_key: str,
    task,
    group_size: int,
    concurrency: int,
    stop: threading.Event,
    max_tokens: int = 32,
    temperature: float = 1.0,
    seed: int = 0,
    env_delay_s: float = 0.0,
) -> None:
    """Play episodes until ``stop`` is set: groups of ``group_size`` sessions per problem.
    ``env_delay_s`` > 0 makes the environment slow: each turn then takes a
    uniformly random 0 to 2 × ``env_delay_s`` seconds before it is scored."""
    import httpx
    import openai

    rng = random.Random(seed)
    slots = asyncio.Semaphore(concurrency)
    admin = {"Authorization": f"Bearer {admin_key}"}

    async def episode(http: httpx.AsyncClient, problem: Problem) -> None:
        async with slots:
            while not stop.is_set():  # a long poll: the staleness bound admits us when the policy moves on
                body = {"task_id": problem.id, "wait_s": 10.0}
                started = await http.post(f"{url}/rl/start_session", json=body, headers=admin)
                if started.status_code != 429:
                    break
            else:
                return
            started.raise_for_status()
            key = started.json()["api_key"]
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=2)
            reply = await client.chat.completions.create(
                model="default", messages=problem.messages, max_tokens=max_tokens, temperature=temperature
            )
            if env_delay_s > 0:  # the environment's own time (tools, a simulator, a judge)
                await asyncio.sleep(rng.uniform(0, 2 * env_delay_s))
            reward = task.reward(problem, reply.choices[0].message.content or "")
            session = {"Authorization": f"Bearer {key}"}
            await http.post(f"{url}/rl/set_reward", json={"reward": reward}, headers=session)
            await http.post(f"{url}/rl/end_session", headers=session)
            await client.close()

    async with httpx.AsyncClient(timeout=600) as http:
        running: set[asyncio.Task] = set()
        while not stop.is_set():
            for finished in [t for t in running if t.done()]:
                running.discard(finished)
                if finished.exception() is not None:  # a failed episode costs that episode only
                    logger.warning("episode failed: %s", finished.exception())
            if len(running) >= 2 * concurrency:
                await asyncio.sleep(0.05)
                continue
            problem = task.problem(rng)
            running.update(asyncio.create_task(episode(http, problem)) for _ in range(group_size))
        await asyncio.gather(*running, return_exceptions=True)


def play_in_background(*args, **kwargs) -> tuple[threading.Thread, threading.Event]:
    """Run :func:`play` in a thread of its own; set the returned event to stop it."""
    stop = threading.Event()
    thread = threading.Thread(target=lambda: asyncio.run(play(*args, stop=stop, **kwargs)), daemon=True)
    thread.start()
    return thread, stop
