"""vLLM's engine processes wait for each other without spinning, on CPU.

vLLM's engine core and its workers hand each step over through shared-memory
queues whose readers spin (``sched_yield`` in a loop) for a second after each
read, for latency on machines with cores to spare. On a small CPU machine the
spinning core competes with the worker it waits for and with the gateway in the
same replica: measured with ``bench/load.py --colocate --direct``, two thirds
of the engine core's samples were ``sched_yield``, and without the spin the
engine core's CPU per turn fell from 2.4 to 0.7 ms and rlgate's turns/s rose
by a tenth (bench/README.md, "Waiting without spinning").

:func:`register` is a vLLM general plugin (``pyproject.toml``, group
``vllm.general_plugins``; vLLM loads it in every process it starts). Where
``QUIET_ENV`` is ``1`` (``VLLMEngine`` sets it before it starts an engine on
CPU) every reader waits on the queue's notification instead. Elsewhere (a GPU
engine, someone else's ``vllm serve``) it does nothing.
"""

from __future__ import annotations

import logging
import os

QUIET_ENV = "RLGATE_VLLM_QUIET_WAITS"
logger = logging.getLogger(__name__)


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

    def wait(self, *args, **kwargs):
        self.busy_loop_s = 0.0  # read by wait(): no spin after a read, straight to the notification
        return spinning_wait(self, *args, **kwargs)

    SpinCondition.wait = wait
    SpinCondition._rlgate_quiet = True
