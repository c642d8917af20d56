"""vLLM's engine processes end with the process that owns the engine.

vLLM runs its engine core, and the core its workers where it has them (a
GPU or sharded engine; a one-shard CPU engine computes in the core), in
processes of their own. When the process that owns the engine is killed (a SIGKILLed replica,
``ray stop --force``) they are orphaned and keep their memory and cores: they
were still there minutes later. rlgate registers :func:`register` as a vLLM
general plugin (``pyproject.toml``, group ``vllm.general_plugins``), which
vLLM loads in every process it starts. In a process below an engine owner
(``OWNER_ENV`` holds the owner's pid, set by ``VLLMEngine`` before it starts
the engine) it starts a thread that kills the process once its parent is
gone: the core when the owner dies, each worker when the core does.
Elsewhere (the owner itself, a ``vllm serve`` of someone else's) it does nothing.
"""

from __future__ import annotations

import os
import signal
import threading
import time

OWNER_ENV = "RLGATE_ENGINE_OWNER"
CHECK_EVERY_S = 1.0
_watching = False


def register() -> None:
    global _watching
    owner = os.environ.get(OWNER_ENV)
    if owner is None or owner == str(os.getpid()) or _watching:
        return
    _watching = True
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:  # an orphan is adopted: its parent's pid changes
            time.sleep(CHECK_EVERY_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="rlgate-reaper", daemon=True).start()
