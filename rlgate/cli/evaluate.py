"""``rlgate eval``: a model's held-out episodes through a gateway, as mean reward
and pass@k per seed (a table, and JSON).

    rlgate eval --config C [--model NAME_FOLDER_OR_RUN] [--task NAME | --dataset F --reward M:F | --task-app URL]
                [--seeds 0-31 | --seeds 1 5 9] [--n K] [--threshold X] [--json OUT] [--backend URL]

The episodes are the config's (``[task]``, ``[services] task_url``) or the
flags', played as the training run plays them, in sessions that are never
trained on; the seeds are ``[evaluation] seeds`` unless given. Without
``--backend`` (or ``$RLGATE_URL``) the model is served here, on local Ray, by
a gateway of its own; ``--model`` may name a run folder, whose latest
checkpoint is served (its model, or the base model with its LoRA adapter).
The code is the training loop's own evaluation
(:mod:`rlgate.training.evaluation`).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import sys
import tempfile
import tomllib
from pathlib import Path

from rlgate.config import RLGateConfig


def seeds_of(values: list[str]) -> list[int]:
    """``["0-3", "9"]`` -> ``[0, 1, 2, 3, 9]``."""
    seeds: list[int] = []
    for value in values:
        first, dash, last = value.partition("-")
        try:
            seeds += list(range(int(first), int(last) + 1)) if dash else [int(value)]
        except ValueError:
            raise ValueError(f"--seeds takes numbers and ranges like 0-31, not {value!r}") from None
    return seeds


def serve_model_of(config: RLGateConfig, model: str) -> str:
    """Point ``config`` at ``model``: a model name or folder, or a run folder (its
    latest checkpoint: the model, or the run's base model with the adapter).
    Returns what is served, in words."""
    from rlgate.cli.export_model import checkpoint_at
    from rlgate.run import ADAPTER, MODEL, checkpoints_dir

    path = Path(model)
    if not checkpoints_dir(path).is_dir():
        config.model.name = model
        return model
    folder, step, _ = checkpoint_at(path)
    if (folder / ADAPTER).is_dir():
        run_config = tomllib.loads((path / "config.toml").read_text()) if (path / "config.toml").is_file() else {}
        config.model.name = run_config.get("model", {}).get("name", config.model.name)
        config.model.adapter = str(folder / ADAPTER)
        return f"{path} step {step}: {config.model.name} with its LoRA adapter"
    config.model.name = str(folder / MODEL)
    return f"{path} step {step}"


def configured(args) -> RLGateConfig:
    from rlgate.config import load_config, with_changes

    # evaluating, not training: the checks of what training may play (held-out seeds) do not apply
    config = with_changes(load_config(args.config), {"evaluation": {"every_n_iters": 0}}, args.config)
    # one task source replaces another: the others' keys go with it
    other_sources = {"builtin": None, "dataset": None, "reward": None}
    if args.task is not None:
        changed = {"task": {**other_sources, "builtin": args.task}, "services": {"task_url": None}}
        config = with_changes(config, changed, "--task")
    if args.dataset is not None:
        if args.reward is None:
            raise ValueError("--dataset needs --reward MODULE:FUNCTION (or FILE.py:FUNCTION)")
        changed = {
            "task": {**other_sources, "dataset": args.dataset, "reward": args.reward},
            "services": {"task_url": None},
        }
        config = with_changes(config, changed, "--dataset")
    if args.task_app is not None:
        config = with_changes(config, {"task": other_sources, "services": {"task_url": args.task_app}}, "--task-app")
    seeds = seeds_of(args.seeds) if args.seeds else None
    for flag, key, value in (
        ("--seeds", "seeds", seeds),
        ("--n", "n", args.n),
        ("--threshold", "pass_threshold", args.threshold),
    ):
        if value is not None:
            config = with_changes(config, {"evaluation": {key: value}}, flag)
    if not config.evaluation.seeds:
        raise ValueError("no seeds to evaluate: give --seeds (e.g. 0-31) or [evaluation] seeds")
    return config


def run_eval(args) -> int:
    import os

    from rich.console import Console

    from rlgate.run import NAMESPACE
    from rlgate.sdk.taskapp import environment_key
    from rlgate.serving.app import end_served, start_serve
    from rlgate.training import driver
    from rlgate.training.evaluation import evaluate

    config = configured(args)
    if args.backend is not None and args.model is not None:
        raise ValueError("--model is served here; a gateway at --backend serves its own model: give one of them")
    served = serve_model_of(config, args.model) if args.model else config.model.name
    dataset = driver.load_dataset_task(config, training=False)  # every row may be evaluated
    url = args.backend
    local = url is None
    import ray

    if local:
        # a run, route and port of its own: beside the config's run, which may still be training on this cluster
        config.gateway.run_name = f"{config.gateway.run_name[:52]}-eval-{secrets.token_hex(3)}"
        config.gateway.route_prefix, config.gateway.direct_port = f"/{config.gateway.run_name}", None
        config.gateway.run_dir = tempfile.mkdtemp(prefix="rlgate-eval-")  # its sessions are not kept
        key = driver.gateway_key(config, private=True)
        ray.init(address=os.environ.get("RAY_ADDRESS"), namespace=NAMESPACE)
        serving = start_serve(config)
        admin = key.value
    else:
        admin = args.api_key
        if not admin:
            raise ValueError("a gateway at --backend needs its admin key: --api-key or $RLGATE_ADMIN_KEY")
    try:
        if local:  # a deploy that fails is ended below too
            url = driver.deploy_gateway(config, serving, 0, key)
        task_app = driver.check_task_app(config, environment_key())
        episodes = driver.evaluation_episodes(config, url, task_app, dataset)
        if episodes is None:
            raise ValueError("nothing to play: set [task] builtin or dataset, or a task app ([services] task_url)")
        items, play = episodes
        settings = config.evaluation
        report = asyncio.run(
            evaluate(url, admin, play, items, settings.n, config.task.max_concurrent, settings.pass_threshold)
        )
    finally:
        if local:  # nothing of the evaluation's own gateway is kept: its app, its run's actors, its folder
            end_served(config, serving.started)
            shutil.rmtree(config.gateway.run_dir, ignore_errors=True)
    result = {"model": served, **report.as_dict()}
    Console(width=120, stderr=args.json is None).print(report.table())
    if args.json is not None:
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"rlgate: {report.episodes} episodes ({report.failed} failed); JSON in {args.json}")
    else:
        json.dump(result, sys.stdout, indent=2)
        print()
    if report.episodes == 0:  # nothing was scored: an unreachable gateway or task app, a wrong key
        print(f"rlgate: error: every one of {report.failed} episodes failed; the log says why", file=sys.stderr)
        return 1
    return 0
