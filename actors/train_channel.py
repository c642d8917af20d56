"""TrainChannel: the driver's commands to the Ray Train workers, and their results.

Created by ``train_driver.py`` (a named actor per run). Ray Train's
``fit()`` blocks, so the driver runs it in a thread and keeps the algorithm
loop itself: it ``submit``s numbered commands (a training step, a checkpoint,
stop) and waits for ``results``; every worker ``fetch``es command after
command and reports ``done``. Workers restarted by Ray Train after a failure
resume fetching after the step in their checkpoint, so a command already
applied before the checkpoint is never applied twice.
Owns: the command list and each command's per-rank results (in memory).
"""

from __future__ import annotations

import asyncio

import ray


@ray.remote(num_cpus=0)
class TrainChannel:
    def __init__(self, first_index: int = 0) -> None:
        # A resumed run continues the numbering its checkpoint recorded.
        self.next_index = first_index
        self.floor = first_index  # commands below it are covered by a finished checkpoint
        self.commands: dict[int, dict] = {}
        self.results: dict[int, dict[int, dict]] = {}
        self._changed = asyncio.Condition()
        self.stepped = False  # a command other than stop was sent

    async def submit(self, command: dict) -> int:
        async with self._changed:
            index, self.next_index = self.next_index, self.next_index + 1
            self.commands[index] = command
            self.stepped |= command["op"] != "stop"
            self._changed.notify_all()
            return index

    async def fetch(self, index: int) -> dict:
        """Command ``index``, once the driver has submitted it."""
        async with self._changed:
            await self._changed.wait_for(lambda: index in self.commands)
            return self.commands[index]

    async def done(self, index: int, rank: int, result: dict) -> None:
        async with self._changed:
            self.results.setdefault(index, {})[rank] = result
            self._changed.notify_all()

    async def done_at_checkpoint(self, index: int, rank: int, result: dict) -> None:
        """A restarted worker's word for command ``index``, which its checkpoint covers:
        taken only while the driver still waits for it (the worker that ran it died after
        saving the checkpoint, before its ``done``), never over a result already in."""
        async with self._changed:
            if index in self.commands and rank not in self.results.get(index, {}):
                self.results.setdefault(index, {})[rank] = result
                self._changed.notify_all()

    async def forget_below(self, index: int) -> None:
        """Drop commands (and their batches) and results before ``index``: a
        checkpoint covers them, and a restarted worker resumes after it."""
        async with self._changed:
            self.floor = max(self.floor, index)
            for table in (self.commands, self.results):
                for old in [i for i in table if i < index]:
                    del table[old]

    async def stopped_before_any_step(self) -> bool:
        """Whether the driver sent stop before any step: a worker starting then has
        nothing to do. (Once a step was sent, every worker, restarted ones too,
        replays what it must and stops at the stop command, all ranks alike.)"""
        return not self.stepped and any(command["op"] == "stop" for command in self.commands.values())

    async def first_held(self) -> int:
        """The first command still held: a restarted worker must resume at or after it."""
        return self.floor

    async def wait(self, index: int, world: int, timeout_s: float) -> dict[int, dict] | None:
        """Every rank's result for command ``index``; None on timeout."""
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: len(self.results.get(index, {})) >= world), timeout_s
                )
            except TimeoutError:
                return None
            return self.results[index]
