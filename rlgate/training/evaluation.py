"""Held-out evaluation: ``n`` episodes per seed through a gateway, in sessions
that are never trained on, scored as mean reward and pass@k.

``rlgate eval`` runs it against a model (a local gateway it starts, or one at
``RLGATE_URL``); the training driver runs it every ``[evaluation]
every_n_iters`` steps beside the step loop (:class:`Evaluator`). A seed
names one problem: a task app's seed, a dataset's row, or a built-in task's
problem drawn with that seed. An episode passes when its reward reaches the
threshold; pass@k is the unbiased estimate from ``n`` episodes with ``c``
passes, ``1 - C(n - c, k) / C(n, k)``, averaged over the seeds (an episode
that failed, its environment erroring, counts as neither; ``n`` is then the
episodes that ran). During training an evaluation runs beside the steps, so
its episodes are sampled by the policy served when each starts: the version
of its step or a later one.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import sys
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rlgate.sessions.manager import redact

logger = logging.getLogger(__name__)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of ``k`` episodes drawn from ``n`` (``c`` of which pass) passes."""
    if not 0 < k <= n:
        raise ValueError(f"k must be in 1..{n} (got {k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class SeedResult:
    seed: int
    rewards: list[float] = field(default_factory=list)  # of the episodes that did not fail
    failed: int = 0

    def passes(self, threshold: float) -> int:
        return sum(reward >= threshold for reward in self.rewards)

    def pass_at(self, k: int, threshold: float) -> float | None:
        """pass@k from the episodes that ran (a failed one is neither a pass nor a miss);
        None when fewer than ``k`` ran."""
        ran = len(self.rewards)
        return pass_at_k(ran, self.passes(threshold), k) if k <= ran else None


@dataclass
class EvalReport:
    seeds: list[SeedResult]
    n: int
    threshold: float

    @property
    def episodes(self) -> int:
        return sum(len(s.rewards) for s in self.seeds)

    @property
    def failed(self) -> int:
        return sum(s.failed for s in self.seeds)

    @property
    def mean_reward(self) -> float | None:
        rewards = [r for s in self.seeds for r in s.rewards]
        return sum(rewards) / len(rewards) if rewards else None

    def pass_at(self, k: int) -> float | None:
        """pass@k averaged over the seeds where at least ``k`` episodes ran."""
        values = [v for s in self.seeds if (v := s.pass_at(k, self.threshold)) is not None]
        return sum(values) / len(values) if values else None

    def ks(self) -> list[int]:
        return sorted({1, self.n} | {k for k in (2, 4, 8, 16, 32, 64) if k < self.n})

    def as_dict(self) -> dict[str, Any]:
        return {
            "mean_reward": self.mean_reward,
            "pass_at": {str(k): self.pass_at(k) for k in self.ks()},
            "n": self.n,
            "threshold": self.threshold,
            "episodes": self.episodes,
            "failed": self.failed,
            "seeds": [
                {
                    "seed": s.seed,
                    "mean_reward": sum(s.rewards) / len(s.rewards) if s.rewards else None,
                    "passes": s.passes(self.threshold),
                    "failed": s.failed,
                    "pass_at": {str(k): s.pass_at(k, self.threshold) for k in self.ks()},
                    "rewards": s.rewards,
                }
                for s in self.seeds
            ],
        }

    def metrics(self) -> dict[str, Any]:
        """The figures a training step logs (``eval_*``)."""
        out = {"eval_reward_mean": self.mean_reward, "eval_episodes": self.episodes, "eval_failed": self.failed}
        out.update({f"eval_pass_at_{k}": self.pass_at(k) for k in self.ks()})
        return out

    def table(self):
        """A ``rich`` table: one row per seed, then the totals."""
        from rich.table import Table

        table = Table(title=f"{len(self.seeds)} seeds x {self.n} episodes, pass = reward >= {self.threshold:g}")
        table.add_column("seed", justify="right")
        table.add_column("mean reward", justify="right")
        table.add_column("passes", justify="right")
        for k in self.ks():
            table.add_column(f"pass@{k}", justify="right")
        show = lambda value: "-" if value is None else f"{value:.3f}"  # noqa: E731
        for row in self.as_dict()["seeds"]:
            cells = [show(row["pass_at"][str(k)]) for k in self.ks()]
            failed = f" ({row['failed']} failed)" if row["failed"] else ""
            table.add_row(str(row["seed"]), show(row["mean_reward"]), f"{row['passes']}/{self.n}{failed}", *cells)
        table.add_row("all", show(self.mean_reward), "", *[show(self.pass_at(k)) for k in self.ks()], style="bold")
        return table


async def evaluate(
    url: str,
    admin_key: str,
    run: Callable[[dict, Any], Awaitable[Any]],
    items: list[tuple[int, Any]],
    n: int = 1,
    concurrency: int = 8,
    threshold: float = 1.0,
    label: str = "eval",
) -> EvalReport:
    """``n`` episodes of each ``(seed, item)``, ``concurrency`` at a time, each in an
    evaluation session (``train: false``) started with ``admin_key`` and played by
    ``run(session, item)`` (its reward, or ``(reward, per-turn rewards)``). An
    episode that fails costs itself only: it is counted, not scored."""
    import httpx

    slots = asyncio.Semaphore(concurrency)
    admin = {"Authorization": f"Bearer {admin_key}"}
    results = {seed: SeedResult(seed) for seed, _ in items}  # a seed listed twice: 2n episodes, reported once

    async def one(http: httpx.AsyncClient, seed: int, item: Any, episode: int) -> None:
        async with slots:
            body, auth = {"task_id": f"{label}-seed-{seed}-{episode}", "train": False}, None
            try:
                started = await http.post(f"{url}/rl/start_session", json={**body, "wait_s": 60}, headers=admin)
                session = started.raise_for_status().json()
                auth = {"Authorization": f"Bearer {session['api_key']}"}
                reward = await run(session, item)
                results[seed].rewards.append(float(reward[0] if isinstance(reward, tuple) else reward))
            except Exception as err:
                logger.warning("evaluation episode (seed %d) failed: %s", seed, redact(str(err)))
                results[seed].failed += 1
            finally:
                if auth is not None:  # an end that fails costs nothing here: the gateway ends idle sessions
                    try:
                        await http.post(f"{url}/rl/end_session", headers=auth)
                    except Exception as err:
                        logger.warning("ending an evaluation session (seed %d) failed: %s", seed, redact(str(err)))

    async with httpx.AsyncClient(timeout=600) as http:
        await asyncio.gather(*(one(http, seed, item, e) for seed, item in items for e in range(n)))
    return EvalReport(list(results.values()), n, threshold)


def problems_for(task, seeds: list[int]) -> list[tuple[int, Any]]:
    """A built-in or dataset task's problem for each seed: a dataset's row ``seed``,
    a built-in task's problem drawn with ``random.Random(seed)``."""
    rows = getattr(task, "rows", None)
    if rows is not None:
        wrong = [seed for seed in seeds if not 0 <= seed < len(rows)]
        if wrong:
            raise ValueError(f"seeds name rows of the dataset: 0..{len(rows) - 1} (got {wrong[:3]})")
        return [(seed, task.problem_at(seed)) for seed in seeds]
    return [(seed, task.problem(random.Random(seed))) for seed in seeds]


class Evaluator:
    """The driver's evaluation, beside the step loop. :meth:`at` is called after
    each step: when ``due(step)`` and none is running, it starts one in a thread of
    its own (a step that comes while one runs neither waits for it nor starts
    another), and it hands back the figures of an evaluation that finished since,
    with the step it evaluated (``eval_step``)."""

    def __init__(self, start: Callable[[int], EvalReport | None], due: Callable[[int], bool]) -> None:
        self._start, self._due = start, due
        self._thread: threading.Thread | None = None
        self._done: dict | None = None
        self._lock = threading.Lock()

    def at(self, step: int) -> dict:
        if self._due(step):
            self.begin(step)
        return self.finished()

    def begin(self, step: int) -> None:
        if self._thread is not None and self._thread.is_alive():
            return

        def work() -> None:
            try:
                report = self._start(step)
                figures = report.metrics() if report is not None else None
            except Exception as err:  # an evaluation costs its figures, never the run
                print(f"rlgate: evaluation after step {step} failed: {err}", file=sys.stderr)
                figures = {"eval_reward_mean": None, "eval_episodes": 0}
            if figures is not None:
                with self._lock:
                    self._done = {**figures, "eval_step": step}

        self._thread = threading.Thread(target=work, name=f"rlgate-eval-{step}", daemon=True)
        self._thread.start()

    def finished(self) -> dict:
        with self._lock:
            done, self._done = self._done, None
        return done or {}

    def wait(self, timeout_s: float) -> dict:
        """At the end of a run: the running evaluation's figures, if it finishes in time."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self.finished()
