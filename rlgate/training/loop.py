"""The pieces of the training loop that ``train_driver.py`` strings together.

* :func:`collect`: read saved trajectories and wait for a batch of whole groups.
* :func:`score`: group-relative advantages (partial groups over the batch).
* :func:`normaliser`: the loss denominator over the whole batch, for every worker.

The Ray Train workers that take the batches are ``rlgate.actors.trainer.TrainerWorkers``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import ray
import torch

from rlgate.sessions.trajectory import TrajectoryRecord
from rlgate.training.batching import Batch, GroupBuffer
from rlgate.training.grpo import denominator, group_advantages

logger = logging.getLogger(__name__)


def surviving(call, what: str, within_s: float = 300.0):
    """``ray.get(call())``, made again while the actor behind it restarts: a run's
    stores, CapacityActor and PolicyStore come back in place after a crash, and a
    call that met the crash fails. Only for calls that may be made twice."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return ray.get(call())
        except ray.exceptions.RayActorError as err:
            if time.monotonic() > deadline:
                raise
            logger.warning("%s: the actor is restarting (%s); trying again", what, err.__class__.__name__)
            time.sleep(1.0)


def collect(
    buffer: GroupBuffer,
    trajectories,
    capacity,
    stop: threading.Event,
    version: int,
    max_staleness: int,
    poll_s: float = 0.5,
) -> Batch | None:
    """Block until the buffer can hand out a batch trainable at ``version``
    (None once ``stop`` is set). Sessions the buffer drops are handed back to
    the CapacityActor at once, so new ones can start in their place."""
    dropped_before, warned = buffer.counters.dropped, False
    while not stop.is_set():
        records = surviving(lambda: trajectories.read.remote(buffer.last_read, 1000), "reading trajectories")
        with counting(buffer, capacity):
            buffer.add(records)
            batch = buffer.take(version, max_staleness)
        if not warned and buffer.counters.dropped - dropped_before >= 10 * buffer.batch_size:
            warned = True  # e.g. dynamic sampling on a policy that answers every problem the same way
            logger.warning(
                "%d sessions dropped (equal rewards %d, partial %d, stale %d, all-failed groups %d) while "
                "waiting for one batch at version %d; no step can be taken from groups like these",
                buffer.counters.dropped - dropped_before,
                buffer.counters.dropped_equal_reward,
                buffer.counters.dropped_partial,
                buffer.counters.dropped_stale,
                buffer.counters.dropped_failed,
                version,
            )
        if batch is not None:
            return batch
        if len(records) < 1000:
            stop.wait(poll_s)
    return None


@contextlib.contextmanager
def counting(buffer: GroupBuffer, capacity):
    """Tell the CapacityActor what the buffer's work inside the block changed: the
    stopped run's sessions it now counts (carried) and the counted ones it dropped
    (discarded), so new sessions start in the place of the dropped. Each told once:
    a discard counted twice would admit more than the staleness bound."""
    carried, discardable = buffer.counters.carried, buffer.counters.discardable
    yield
    for told, before, now, what in (
        (capacity.note_accepted, carried, buffer.counters.carried, "carried"),
        (capacity.discard, discardable, buffer.counters.discardable, "discarded"),
    ):
        if now > before:
            try:
                ray.get(told.remote(now - before))
            except ray.exceptions.RayActorError:  # a restart loses the call: fewer admitted, or more
                logger.warning("the CapacityActor restarted while told of %d %s sessions", now - before, what)


def read_backlog(buffer: GroupBuffer, trajectories) -> None:
    """Before the trainer attaches: read what was saved before the run (re)started
    (up to ``buffer.backlog_end``), so the CapacityActor counts the stopped run's
    groups this run will train from the start (``grant``'s ``carried``)."""
    while buffer.last_read < buffer.backlog_end:
        records = surviving(lambda: trajectories.read.remote(buffer.last_read, 1000), "reading trajectories")
        backlog = [record for record in records if record["seq"] <= buffer.backlog_end]
        if not backlog:
            return
        buffer.add(backlog)


def score(batch: Batch, estimator: str) -> tuple[list[dict], list[float]]:
    """Records and their advantages: within each whole group, and over the
    whole batch for partial groups (which have no group to compare with)."""
    records = batch.records
    rewards = torch.tensor([r["reward"] for r in records], dtype=torch.float64)
    group_of = {id(r): i for i, g in enumerate(batch.groups) for r in g.records}
    partial = torch.tensor([id(r) not in group_of for r in records])
    within = group_advantages(rewards, torch.tensor([group_of.get(id(r), -1) for r in records]), estimator)
    over_batch = group_advantages(rewards, torch.zeros(len(records), dtype=torch.long), estimator)
    return records, torch.where(partial, over_batch, within).tolist()


def normaliser(records: list[TrajectoryRecord], version: int, max_staleness: int, aggregation: str) -> float:
    """:func:`rlgate.training.grpo.denominator` over the whole batch, stale tokens dropped,
    for every worker's share of it."""
    oldest = version - max_staleness
    fresh = sum(m and v >= oldest for r in records for m, v in zip(r["loss_mask"][1:], r["versions"][1:]))
    return denominator(aggregation, len(records), fresh, max(len(r["input_ids"]) for r in records) - 1)
