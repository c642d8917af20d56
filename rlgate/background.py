"""Work that must finish even when whoever started it is gone.

A request's handler is cancelled when its client hangs up (Serve does so on
disconnect); some of what it started must go on regardless (a session's save,
a slot's release, an engine's tenant and follower added together).
:func:`to_its_end` awaits such work without cancelling it; :func:`keep` starts
work nobody awaits. Either keeps the task referenced until it is done (the
event loop holds tasks only weakly) and logs a failure no caller hears.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")

_RUNNING: set[asyncio.Future] = set()  # work nobody awaits, until it is done


def keep(work: Awaitable, what: str) -> asyncio.Future:
    """Run ``work`` to its end in the background; a failure is logged as ``what``."""
    task = asyncio.ensure_future(work)
    _RUNNING.add(task)
    task.add_done_callback(_RUNNING.discard)
    task.add_done_callback(lambda done: _log_failure(done, what))
    return task


async def to_its_end(work: Awaitable[T], what: str, if_left: Callable[[asyncio.Future], None] | None = None) -> T:
    """Await ``work``, which goes on to its end if this caller is cancelled (then
    kept as :func:`keep` does; ``if_left`` is called with it once it is done)."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        _RUNNING.add(task)
        task.add_done_callback(_RUNNING.discard)
        task.add_done_callback(lambda done: _log_failure(done, what))
        if if_left is not None:
            task.add_done_callback(if_left)
        raise


def _log_failure(task: asyncio.Future, what: str) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("%s, finished after its caller left, failed: %s", what, task.exception())
