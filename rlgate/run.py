"""A run's identity in the Ray cluster, in one place: the namespace its actors
live in, their names, its Serve application's name, how to find and end them,
and where its checkpoints are. Everything else asks here instead of spelling
a name.

A run is named by ``[gateway] run_name`` (an RL job's run is its job id). Its
detached actors are ``rlgate-<run>-<role>`` in the ``rlgate`` namespace:

=============== ===================================================== ==========
role            what                                                  made by
=============== ===================================================== ==========
``sessions``    SessionStore: open sessions (split gateway shape)     Gateway
``trajectories`` TrajectoryStore: saved trajectories                  Gateway
``capacity``    CapacityActor: admission and staleness                Gateway
``policy``      PolicyStore: the published weights and version        Gateway, RolloutServer
``train``       TrainChannel: the driver's commands to its trainers,  the process
                and the run's claim (not detached: it ends with the   serving the
                process; ``rlgate.serving.app.claim_run``)            run
``jobs``        JobManager: the RL jobs a gateway application takes   Gateway (on first use)
=============== ===================================================== ==========

Its files are under ``<run_dir>/<run>/``: ``trajectories/``, ``sessions/``,
``capacity.jsonl``, ``policy.json``, ``metrics.jsonl`` and the trainer's
checkpoints in ``trainer/step-<step>/`` (each with its ``trainer_state.json``
and the ``model/`` a job's results point at).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

NAMESPACE = "rlgate"
ROLES = ("sessions", "trajectories", "capacity", "policy", "train")  # what a finished run leaves to clean up
# What a fresh run must not inherit from an earlier run of its name: published
# weights, session counts, open sessions. (Its TrajectoryStore only appends to the
# run's files, which stay; the channel belongs to a driver that has ended.)
INHERITED_STATE = ("policy", "capacity", "sessions")
CHECKPOINTS = "trainer"  # <run folder>/trainer/step-000020/ (runs before step names: checkpoint_<time>/)
STATE_FILE = "trainer_state.json"
# In a checkpoint beside STATE_FILE: model/ (full fine-tuning: the whole model), or with LoRA
# adapter/ (the adapter in PEFT format) and, with [training.lora] save_merged, merged/ (base + adapter).
MODEL, ADAPTER, MERGED = "model", "adapter", "merged"


def checkpoint_weights(folder: Path) -> Path:
    """A checkpoint's trained weights: its ``adapter/`` (LoRA), else its ``model/``."""
    return folder / ADAPTER if (folder / ADAPTER).is_dir() else folder / MODEL


def actor_name(run: str, role: str) -> str:
    """``rlgate-<run>-<role>``: the name of one of a run's actors."""
    return f"rlgate-{run}-{role}"


def run_of(name: str, role: str) -> str:
    """The run an actor's name belongs to (its metrics are labelled by it)."""
    return name.removeprefix("rlgate-").removesuffix(f"-{role}")


def app_name(run: str, route_prefix: str = "/") -> str:
    """The run's Serve application: ``rlgate`` at the root, else named for the run."""
    return "rlgate" if route_prefix == "/" else f"rlgate-{run}"


def get_actor(run: str, role: str):
    """A handle to one of the run's actors (ValueError when it does not exist)."""
    import ray

    return ray.get_actor(actor_name(run, role), namespace=NAMESPACE)


def is_alive(run: str, role: str) -> bool:
    try:
        get_actor(run, role)
        return True
    except ValueError:
        return False


def answers(run: str, role: str, timeout_s: float = 5.0) -> bool:
    """Whether the run's actor in ``role`` is there and answers within ``timeout_s``
    (a name can outlive its process for a while: a lost node's, until Ray sees it go)."""
    import ray

    try:
        ray.get(get_actor(run, role).__ray_ready__.remote(), timeout=timeout_s)
        return True
    except (ValueError, ray.exceptions.RayError):
        return False


def end_actors(run: str, roles: tuple[str, ...] = ROLES, wait_s: float = 60.0) -> None:
    """Kill the run's actors in ``roles`` and wait (up to ``wait_s``) until their
    names are free: ``ray.kill`` returns before an actor is gone, and until then a
    get-or-create of the same name would find the dying actor."""
    import ray

    for role in roles:
        try:
            ray.kill(get_actor(run, role))
        except ValueError:
            pass  # never made, or gone already
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(is_alive(run, role) for role in roles):
        time.sleep(0.1)


def checkpoints_dir(run_dir: str | Path) -> Path:
    """Where the run's trainer keeps its checkpoints (``run_dir`` is the run's own folder)."""
    return Path(run_dir) / CHECKPOINTS


def checkpoint_states(checkpoints: str | Path) -> dict[Path, dict]:
    """Each checkpoint folder the trainer saved under ``checkpoints`` (a run's
    :func:`checkpoints_dir`), with its trainer state."""
    found = [*Path(checkpoints).glob(f"step-*/{STATE_FILE}"), *Path(checkpoints).glob(f"checkpoint_*/{STATE_FILE}")]
    return {p.parent: json.loads(p.read_text()) for p in found}


def checkpoint_name(step: int) -> str:
    """A checkpoint's folder under :func:`checkpoints_dir`: named by its step."""
    return f"step-{step:06d}"
