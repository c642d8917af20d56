"""vLLM's engine processes wait for each other without spinning, on CPU.

vLLM's engine core and its workers hand each step over through shared-memory
queues whose readers spin (``sched_yield`` in a loop) for a second after each
read, for latency on machines with cores to spare. On a small CPU machine the
spinning core competes with the worker it waits for and with the gateway in the
same replica: measured with ``bench/load.py --colocate --direct``, two thirds
of the engine core's samples were ``sched_yield``, and without the spin the
engine core's CPU per turn fell from 2.4 to 0.7 ms (bench/README.md, "Waiting
without spinning").

Without the spin every wait goes through the queue's notification: a zmq
PUB/SUB pair whose SUB side is CONFLATE. libzmq's conflating pipe can lose a
wake-up (the reader marks itself asleep after the writer has read it as awake),
and vLLM bounds that loss by re-reading the queue's flags every 5 s. Spinning
hides it; waiting on every step meets it often (a request paused and resumed
stalled 5 s a step). So a wait here is also bounded by how long the reader has
been idle, between :data:`RECHECK_MS`: a lost wake-up costs at most as long
again as the reader had already waited, and an idle engine looks at its queue
ten times a second.

:func:`register` is a vLLM general plugin (``pyproject.toml``, group
``vllm.general_plugins``; vLLM loads it in every process it starts). Where
``QUIET_ENV`` is ``1`` (``VLLMEngine`` sets it before it starts an engine on
CPU) every reader waits this way. Elsewhere (a GPU engine, someone else's
``vllm serve``) it does nothing.
"""

from __future__ import annotations

import logging
import os
import time

QUIET_ENV = "RLGATE_VLLM_QUIET_WAITS"
RECHECK_MS = (1, 100)  # a wait looks at the queue again after its idle time, within these bounds
logger = logging.getLogger(__name__)


def recheck_after_ms(idle_s: float, timeout_ms: int | None) -> int:
    """How long one wait may last: the reader's idle time so far, bounded, within the caller's timeout."""
    low, high = RECHECK_MS
    bound = int(min(max(idle_s * 1000, low), high))
    return bound if timeout_ms is None else min(bound, timeout_ms)


def register() -> None:
    if os.environ.get(QUIET_ENV) != "1":
        return
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:  # another vLLM: its waits are its own
        logger.debug("vLLM has no SpinCondition here; its waits are left as they are")
        return
    if getattr(SpinCondition, "_rlgate_quiet", False) or not hasattr(SpinCondition, "wait"):
        return
    spinning_wait = SpinCondition.wait

    def wait(self, timeout_ms=None):
        self.busy_loop_s = 0.0  # read by wait(): no spin after a read, straight to the notification
        return spinning_wait(self, recheck_after_ms(time.monotonic() - self.last_read, timeout_ms))

    SpinCondition.wait = wait
    SpinCondition._rlgate_quiet = True
