"""rlgate's RL loop as a Ray job: GRPO on Ray Train, fed by live sessions.

    python train_driver.py --config configs/demo.toml [--resume] [--run-name NAME] [--run-dir DIR]
    ray job submit --working-dir . -- python train_driver.py --config configs/demo.toml --run-dir /shared/runs
    python -m rlgate.training.driver ... / rlgate train ...   # the same, from an installed rlgate

Starts (or joins) Ray, serves the gateway and rollout engines throughout, and
trains: collect whole groups of finished episodes → group-relative advantages
→ optimizer step on the Ray Train workers → every engine serves the new
version → the capacity actor admits the next sessions → log. Episodes come
from a task app (``[services] task_url``), a built-in task (``[task] builtin``),
a dataset with a reward function (``[task] dataset``) or any external agent
using the gateway (online mode: with no sessions, it waits).

A composition module over :mod:`rlgate.actors` and the library; ``train_driver.py``
at the top of a checkout is its thin entry point.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import ray
from ray import serve

from rlgate.actors.trainer import TrainerWorkers
from rlgate.config import ConfigError, RLGateConfig, dump_config, load_config, with_changes
from rlgate.rollout.pool import pool_name
from rlgate.run import (
    ADAPTER,
    INHERITED_STATE,
    MODEL,
    NAMESPACE,
    actor_name,
    app_name,
    checkpoint_states,
    checkpoints_dir,
    end_actors,
    get_actor,
)
from rlgate.sdk.taskapp import KeyFileError, TaskAppClient, TaskAppError, environment_key
from rlgate.serving.app import (
    QUIET,
    AdminKey,
    AdminKeyRefused,
    Serving,
    Taken,
    admin_key,
    build_app,
    claim_run,
    end_served,
    policy_store,
    resolve_model,
    start_serve,
)
from rlgate.sessions.journal import open_session_ids
from rlgate.sessions.manager import hash_key, new_key
from rlgate.sessions.trajectory_files import last_seq
from rlgate.training.batching import Counters, GroupBuffer
from rlgate.training.dataset_task import DatasetError, DatasetTask, dataset_task
from rlgate.training.evaluation import EvalReport, Evaluator, evaluate, problems_for
from rlgate.training.loop import collect, normaliser, read_backlog, score, surviving
from rlgate.training.placement import cluster_nodes, plan, unplaceable, wait_for_room, worker_bundle
from rlgate.training.runlog import RunLog
from rlgate.training.tasks import Episodes, builtin_episodes, get_task, task_app_episodes
from rlgate.training.tracking import Tracking

if TYPE_CHECKING:
    from ray.actor import ActorHandle


def main() -> int:
    try:
        return run(parse_args())
    except KeyboardInterrupt:  # while the run started (the steps' loop has its own): what it started is ended
        print("rlgate: interrupted", file=sys.stderr)
        return 130


def run(args: argparse.Namespace) -> int:
    begin = prepare(args)
    take_the_cluster(begin, args)
    config, start, key = begin.config, begin.start, begin.key
    serving = start_serve(config, start.version)
    with ExitStack() as ending:  # however the run stops from here, while it starts too: undone in reverse
        ending.callback(end_served, config, serving.started)  # what it served, last
        # Ray Train's workers start while the engines do: nothing joins them before the first step
        trainer = start_trainer(config, begin.channel, begin.gpus, begin.run_dir, start)
        ending.callback(trainer.stop)
        url = deploy_gateway(config, serving, start.version, key)
        buffer = group_buffer(config, start.buffer, begin.backlog_end, start.version, begin.reopened)
        read_backlog(buffer, get_actor(config.gateway.run_name, "trajectories"))  # the stopped run's groups
        admit_under_the_rule(config, start.version, buffer.counters)  # before any episode starts
        stopping, stopped_by_hand = threading.Event(), False
        episodes = start_episodes(config, url, key.value, stopping, begin.task_app, begin.dataset, start.step)
        if episodes is not None:
            ending.callback(episodes.stop)
        log = open_log(begin, args.resume)  # now the run is under way: a resumption refused before keeps it whole
        progress = Progress(start.step, start.version)
        evaluator = held_out_evaluation(config, url, key.value, begin.task_app, begin.dataset, begin.run_dir)
        try:
            train(config, buffer, progress, trainer, stopping, log, evaluator.at)
        except KeyboardInterrupt:
            stopped_by_hand = True
            print("rlgate: interrupted; writing the reward curve", file=sys.stderr)
        finally:
            stopping.set()
            # the evaluation under way, if any, still reaches eval.jsonl (not waited for after Ctrl-C)
            evaluator.wait(0 if stopped_by_hand else EVAL_WAIT_S)
            finish(log, progress)
    if episodes is not None and episodes.stats.fatal is not None:
        print(f"rlgate: stopped: the environment is down: {episodes.stats.fatal}", file=sys.stderr)
        return 1
    return 0


@dataclass
class Beginning:
    """A run as it starts: what it knows and claims (:func:`prepare`), then what it
    holds on the cluster before anything is served (:func:`take_the_cluster`)."""

    config: RLGateConfig
    dataset: DatasetTask | None
    key: AdminKey
    run_dir: Path
    start: ResumePoint
    tracking: Tracking
    channel: ActorHandle  # the run's TrainChannel: its claim on the cluster
    task_app: TaskAppClient | None = None
    gpus: float = 0.0  # per trainer worker
    backlog_end: int = 0  # the last trajectory saved before this (re)start
    reopened: set[str] = field(default_factory=set)  # the open sessions its stores take back from their journal


def prepare(args: argparse.Namespace) -> Beginning:
    """The config, dataset, admin key and resume point (anything wrong with them fails
    the run before anything starts); Ray joined and the run claimed; then its folder
    and trackers."""
    config = configured(args)
    dataset = load_dataset_task(config)
    key = gateway_key(config, private=args.job_manager is not None)
    run_dir = Path(config.gateway.run_dir, config.gateway.run_name).resolve()
    start = resume_point(run_dir, args.resume)
    if start.adapter is not None and config.training.lora is None:
        raise SystemExit(f"rlgate: {run_dir}'s checkpoints hold a LoRA adapter: resume it with its [training.lora]")
    if start.weights is not None and config.training.lora is not None:
        raise SystemExit(f"rlgate: {run_dir} was fully fine-tuned: remove [training.lora] to resume it")
    ray.init(address=os.environ.get("RAY_ADDRESS"), namespace=NAMESPACE)
    try:  # before its folder and trackers are touched: refused while another process has the run
        channel = claim_run(config.gateway.run_name, start.first_command)
    except Taken as taken:
        raise SystemExit(f"rlgate: {taken}") from None
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_config(config, run_dir / "config.toml")  # the settings this run (or resumption) used
    if start.weights is not None:  # engines start on the checkpoint's weights
        config.model.name = str(start.weights)
    if start.adapter is not None:  # or on the base model with the checkpoint's adapter
        config.model.adapter = str(start.adapter)
    tracking = start_tracking(config, run_dir, start.step, args.resume)  # [logging]: fails the run here if it must
    return Beginning(config, dataset, key, run_dir, start, tracking, channel)


def take_the_cluster(begin: Beginning, args: argparse.Namespace) -> None:
    """Check the run's task app; wait for room; end what an earlier run of its name
    left; note where its trajectories stand."""
    config, run = begin.config, begin.config.gateway.run_name
    # before anything starts: a bad task app fails the run at once
    begin.task_app = check_task_app(config, task_app_key(args.job_manager, run))
    # after ray.init, which sets its own SIGTERM: `ray job stop` acts as Ctrl-C. SIGINT too, which a shell
    # without job control hands its background commands ignored: `python train_driver.py ... &` then stops on it
    signal.signal(signal.SIGINT, CTRL_C)
    signal.signal(signal.SIGTERM, interrupted)  # at once: `ray job stop` kills the driver 3 s later
    begin.gpus = trainer_gpus(config)
    wait_until_placeable(config, begin.gpus, begin.run_dir)
    clear_the_route(config)
    if not args.resume:
        forget_earlier_run(run, begin.run_dir)
    else:
        forget_stopped_run(run)
    # what was saved before this (re)start, the earlier run's stores gone (they saved until they went)
    begin.backlog_end = last_seq(begin.run_dir / "trajectories")
    # the sessions this run's stores take back (counted when they end); a fresh run reads nothing saved before it
    begin.reopened = open_session_ids(begin.run_dir / "sessions") if args.resume else set()
    if begin.start.buffer is None:  # a fresh run trains on episodes that finish from now on, the first included
        begin.start.buffer = {"watermark": begin.backlog_end, "done_above": []}


def open_log(begin: Beginning, resumed: bool) -> RunLog:
    """The run's log as of its checkpoint: a resumption drops the lines of steps after
    it (they are trained again) and writes those of a step saved but never logged."""
    step = begin.start.step
    if resumed and (again := RunLog.forget_after(begin.run_dir, step)):  # stopped between checkpoints
        print(f"rlgate: resuming after step {step}; steps {again[0]}-{again[-1]} are trained again", flush=True)
    log = RunLog(begin.run_dir, begin.config.training.total_steps, step, tracking=begin.tracking)
    if begin.start.lines is not None and (written := log.complete(step, *begin.start.lines)):
        print(f"rlgate: step {step}'s line in {' and '.join(written)} written from its checkpoint", flush=True)
    return log


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train a policy with GRPO from live sessions.")
    parser.add_argument("--config", required=True)
    parser.add_argument("--resume", action="store_true", help="continue the run from its latest checkpoint")
    parser.add_argument("--run-name", help="overrides [gateway] run_name (the run folder and actor names)")
    parser.add_argument("--run-dir", help="overrides [gateway] run_dir; give an absolute path under `ray job submit`")
    parser.add_argument("--task-app", help="overrides [services] task_url")
    parser.add_argument("--model", help="overrides [model] name")
    parser.add_argument(
        "--job-manager",
        help="run as an RL job of this JobManager actor (it sets this): take the task app's key from it, "
        "and keep the gateway's admin key to this process",
    )
    return parser.parse_args()


def configured(args: argparse.Namespace) -> RLGateConfig:
    """The run's config: the file, then the command line's overrides."""
    try:
        config = load_config(args.config)
        flags = {
            ("gateway", "run_name"): args.run_name,
            ("gateway", "run_dir"): args.run_dir,
            ("services", "task_url"): args.task_app,
            ("model", "name"): args.model,
        }
        changes: dict[str, dict] = {}
        for (section, key), value in flags.items():
            if value is not None:
                changes.setdefault(section, {})[key] = value
        if changes:  # validated like the TOML keys, the whole tree at once
            config = with_changes(config, changes, "the command line")
        if config.model.adapter is not None and config.training.lora is None:
            raise ConfigError(
                "[model] adapter: training goes on from an adapter with [training.lora]; without it the first "
                "full-weight push would replace the weights the adapter sits on"
            )
    except ConfigError as err:
        raise SystemExit(f"rlgate: {err}") from None
    return config


def wait_until_placeable(config: RLGateConfig, gpus: float, run_dir: Path) -> None:
    """Fail now if the cluster can never hold the run; while it is busy, wait,
    saying why (a job's status shows waiting.json)."""
    bundles = plan(config, gpus)
    problem = unplaceable(bundles, cluster_nodes(len(bundles)))
    if problem:
        raise SystemExit(f"rlgate: {problem}")
    if config.rollout.pool is not None and pool_running(config.rollout.pool):  # its engines are there already
        bundles = [bundle for bundle in bundles if bundle.role == "trainer"]
    try:
        wait_for_room(bundles, config.jobs.start_timeout_s, lambda reason: note_waiting(run_dir, reason))
    except RuntimeError as err:
        raise SystemExit(f"rlgate: {err}") from None


def pool_running(pool: str) -> bool:
    from ray.serve.context import _get_global_client

    running = _get_global_client(raise_if_no_controller_running=False)
    return running is not None and pool_name(pool) in serve.status().applications


def start_trainer(
    config: RLGateConfig, channel: ActorHandle, gpus: float, run_dir: Path, start: ResumePoint
) -> TrainerWorkers:
    """The run's Ray Train workers on its ``channel``, started in the background; its
    PolicyStore made first (the workers publish to it, the engines follow it)."""
    run = config.gateway.run_name
    policy_store(config, start.version)
    setup = {
        "settings": config.model_dump(),
        "model_path": resolve_model(config),
        "channel": actor_name(run, "train"),
        "policy": actor_name(run, "policy"),
    }
    return TrainerWorkers(
        setup,
        channel,
        config.compute.trainer_workers,
        worker_bundle(config, gpus).as_ray(),  # [compute] placement = "split" adds rlgate_trainer
        storage=run_dir,
        max_failures=config.training.max_failures,
    )


@dataclass
class Progress:
    step: int  # the last step trained
    version: int  # the policy version the engines serve


def group_buffer(config: RLGateConfig, state: dict, backlog_end: int, version: int, reopened: set[str]) -> GroupBuffer:
    """The trainer's GroupBuffer as a checkpoint left it (``state``), for a run (re)started
    at policy ``version``; ``backlog_end``: the last trajectory saved before it;
    ``reopened``: the sessions its stores take back from their journals."""
    training, algorithm = config.training, config.algorithm.resolved(config.training.max_staleness)
    return GroupBuffer.restore(
        state,
        backlog_end=backlog_end,
        resumed_version=version,
        reopened=reopened,
        batch_size=training.batch_size,
        group_size=training.group_size,
        group_timeout_s=training.group_timeout_s,
        partial_groups=training.partial_groups,
        drop_equal_reward_groups=algorithm.drop_equal_reward_groups,
    )


def train(
    config: RLGateConfig,
    buffer: GroupBuffer,
    progress: Progress,
    trainer,
    stopping,
    log: RunLog,
    evaluate_at,
):
    """The loop: whole groups of finished episodes → advantages → an optimizer
    step → every engine serves the new version → the CapacityActor admits the
    next sessions → a line in the log (and ``evaluate_at(step)``'s figures)."""
    training, algorithm = config.training, config.algorithm.resolved(config.training.max_staleness)
    run = config.gateway.run_name
    trajectories, capacity, policy = (get_actor(run, role) for role in ("trajectories", "capacity", "policy"))
    step, version = progress.step, progress.version
    while step < training.total_steps:
        waited = time.monotonic()
        # whole groups of finished episodes that the current policy may train on
        batch = collect(buffer, trajectories, capacity, stopping, version, training.max_staleness)
        if batch is None:  # the environment stayed down
            return
        records, advantages = score(batch, algorithm.advantage)  # group-relative advantages
        started = time.monotonic()
        step += 1
        # what the step's lines say of its batch, in its checkpoint too: a driver killed after the workers saved
        # the step and before it wrote them, resumed, writes them from there (a Ctrl-C waits for them instead)
        line = batch_line(records, version + 1, training.max_staleness, buffer) | {"collect_s": started - waited}
        seqs = [r["seq"] for r in records]
        with CTRL_C.held():  # a step saved is a step recorded
            metrics = trainer.step(  # optimizer step(s) on the Ray Train workers
                records,
                advantages,
                version,
                normaliser(records, version, training.max_staleness, algorithm.aggregation),
                save=save_due(step, training),
                driver_state={"step": step, "buffer": buffer.state(), "line": line, "seqs": seqs},
            )
            version += 1
            progress.step, progress.version = step, version  # trained (and perhaps saved), whatever comes next
            synced = time.monotonic()
            served(policy, version, config.rollout.replicas)  # every engine serves v + 1
            surviving(lambda v=version: capacity.on_new_version.remote(v), "the new version")  # admit the next
            summary = line | trained_line(metrics, time.monotonic() - started, time.monotonic() - synced)
            log.log(step, summary | evaluate_at(step), records)  # held-out seeds, every [evaluation] every_n_iters
            log.batch(step, seqs)


def start_tracking(config: RLGateConfig, run_dir: Path, first_step: int, resumed: bool) -> Tracking:
    """The trackers ``[logging]`` asks for (SystemExit, saying why, when one cannot start)."""
    try:
        return Tracking.start(
            config.logging,
            run_dir,
            config.gateway.run_name,
            config.model_dump(mode="json"),
            lambda: resolve_model(config),
            first_step,
            resumed,
        )
    except ImportError as err:
        raise SystemExit(f"rlgate: {err}") from None
    except Exception as err:  # e.g. wandb online without a key, or an entity it may not write to
        raise SystemExit(f"rlgate: [logging] a tracker could not start: {err.__class__.__name__}: {err}") from None


def admit_under_the_rule(config: RLGateConfig, version: int, backlog: Counters | None = None) -> None:
    """Tell the CapacityActor the policy version (a resumed run's own) and the
    trainer's rule (batch, staleness, groups), with the stopped run's sessions
    it trains (``backlog``: the GroupBuffer's counts once it read them), before
    any episode starts: a session admitted before would escape the staleness budget."""
    training = config.training
    capacity = get_actor(config.gateway.run_name, "capacity")
    surviving(lambda: capacity.on_new_version.remote(version), "the policy version")
    rule = (training.batch_size, training.max_staleness, training.group_size, training.group_timeout_s)
    counted = (backlog.carried, backlog.discardable) if backlog is not None else (0, 0)
    surviving(lambda: capacity.grant.remote(*rule, *counted), "the staleness rule")


def finish(log: RunLog, progress: Progress) -> None:
    """The log closed and the curve drawn (then :func:`run`'s ExitStack stops the episodes
    and the trainer and ends what the run served: :func:`end_served`)."""
    log.close()
    plot = log.plot()
    print(
        f"rlgate: {progress.step} steps, policy version {progress.version}; metrics in {log.path}"
        + (f", reward curve {plot}" if plot else "")
    )


def interrupted(*_) -> None:
    raise KeyboardInterrupt


class HeldCtrlC:
    """Ctrl-C as KeyboardInterrupt, held back while a step is trained and recorded
    (:meth:`held`): the workers may save the step's checkpoint however the driver
    stops, and a resumed run continues from it, so the step's lines must reach the
    run's log too. The first Ctrl-C there stops the run once the step is recorded;
    a second stops it at once."""

    def __init__(self) -> None:
        self.holding = self.pending = False

    def __call__(self, *_) -> None:
        if self.holding and not self.pending:
            self.pending = True
            print("rlgate: stopping once the step under way is recorded (Ctrl-C again: now)", file=sys.stderr)
            return
        raise KeyboardInterrupt

    @contextmanager
    def held(self) -> Iterator[None]:
        self.holding, self.pending = True, False
        try:
            yield
        finally:
            self.holding = False
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt


CTRL_C = HeldCtrlC()


def served(policy, version: int, replicas: int) -> None:
    """Wait until ``replicas`` engines serve ``version``, across a restart of the
    PolicyStore (a call in flight then fails; the replicas report again)."""
    while True:
        try:
            ray.get(policy.wait_served.remote(version, replicas))  # False after its timeout: go on regardless
            return
        except ray.exceptions.RayActorError:
            print("rlgate: the policy store restarted; waiting for the engines to report again", file=sys.stderr)
            time.sleep(1.0)


def gateway_key(config: RLGateConfig, private: bool) -> AdminKey:
    """The gateway's admin key: ``RLGATE_ADMIN_KEY`` (refused beyond loopback when
    weak), or one made here. ``private``: an RL job's gateway, whose key this
    process makes and shows to no one, so it may guard any port."""
    if private:
        return AdminKey(new_key("rlg-admin-"), False)
    try:
        return admin_key(config.gateway.host)
    except AdminKeyRefused as refused:
        raise SystemExit(str(refused)) from None


def deploy_gateway(config: RLGateConfig, serving: Serving, version: int, key: AdminKey) -> str:
    """The gateway and rollout engines on Serve's proxy (each Gateway replica checks
    ``key`` against the proxy's host); returns the URL agents use."""
    gateway = config.gateway
    prefix = gateway.route_prefix
    if "access_log" not in gateway.model_fields_set:
        gateway.access_log = False
    app = build_app(config, hash_key(key.value), initial_version=version, key_fit_for_public=key.fit_for_public)
    name = app_name(gateway.run_name, prefix)
    with said_while_slow("deploying the gateway", partial(app_state, name)):  # Serve's own logs are quiet
        serve.run(app, name=name, route_prefix=prefix, logging_config=QUIET)
    address = "127.0.0.1" if serving.host in ("0.0.0.0", "::") else serving.host
    url = f"http://{address}:{serving.port}{prefix.rstrip('/')}"
    print(f"rlgate: gateway at {url} (OpenAI base URL {url}/v1)", flush=True)
    if key.generated:
        print(f"rlgate: admin key (shown once; set RLGATE_ADMIN_KEY to choose it): {key.value}", flush=True)
    return direct_url(config, address) or url


@contextmanager
def said_while_slow(what: str, state: Callable[[], str], every_s: float = 30.0) -> Iterator[None]:
    """Run the body; each ``every_s`` seconds it has not finished, print how long
    it has taken and ``state()`` (a wait that never ends then shows where it stands)."""
    done, began = threading.Event(), time.monotonic()

    def watch() -> None:
        while not done.wait(every_s):
            try:
                now = state()
            except Exception as err:  # asking may be what is slow or broken: say so, and keep waiting
                now = f"its state unknown ({err.__class__.__name__}: {err})"
            print(f"rlgate: still {what} after {time.monotonic() - began:.0f} s: {now}", flush=True)

    watcher = threading.Thread(target=watch, name="rlgate-said-while-slow", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join(timeout=5.0)  # a line being written lands before what follows (a state() call may hang)


def app_state(name: str) -> str:
    """A Serve application's state in a line: its status, then each deployment's
    status, replica states and message."""

    def word(value) -> str:  # Serve's states are str enums
        return str(getattr(value, "value", value))

    app = serve.status().applications.get(name)
    if app is None:
        return "the application is not there yet"
    parts = [word(app.status)]
    for deployment, status in app.deployments.items():
        replicas = ", ".join(f"{n} {word(state)}" for state, n in status.replica_states.items()) or "no replicas"
        said = f": {status.message}" if status.message else ""
        parts.append(f"{deployment} {word(status.status)} ({replicas}){said}")
    return "; ".join(parts)


def direct_url(config: RLGateConfig, address: str) -> str | None:
    """The gateway replica's own port ([gateway] direct_port) when it answers on
    this host: the run's episodes then skip Serve's proxy hop. None with several
    colocated replicas (each serves only its own sessions: the proxy routes them)."""
    gateway = config.gateway
    if gateway.direct_port is None or (gateway.colocate and gateway.replicas > 1):
        return None
    url = f"http://{address}:{gateway.direct_port}"
    try:
        answer = httpx.get(f"{url}/health", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return None
    if not isinstance(answer, dict) or "policy_version" not in answer:
        return None
    print(f"rlgate: episodes use the gateway replica's own port, {url}", flush=True)
    return url


def task_app_key(job_manager: str | None, job_id: str) -> str | None:
    """The task app's key: an RL job's JobManager holds it in memory and hands it
    over once (a file or an environment variable would show it); a run started
    by hand reads ``$ENVIRONMENT_API_KEY`` or the file ``$ENVIRONMENT_API_KEY_FILE``."""
    if job_manager is None:
        try:
            return environment_key()
        except KeyFileError as err:
            raise SystemExit(f"rlgate: failed to start: {err}") from None
    try:
        return ray.get(ray.get_actor(job_manager, namespace=NAMESPACE).take_task_app_key.remote(job_id))
    except ValueError:  # no such actor: it died, and the key with it
        raise SystemExit(
            f"rlgate: failed to start: the JobManager {job_manager} that started this job is gone, and with it "
            "the task app's key (kept in its memory only); submit the job again"
        ) from None
    except ray.exceptions.RayTaskError as err:
        raise SystemExit(f"rlgate: failed to start: {err.cause}") from None


def check_task_app(config: RLGateConfig, key: str | None) -> TaskAppClient | None:
    """The configured task app, once its /health and /task_info answer. Every call
    to it is checked against ``[jobs] task_app_hosts`` as it connects."""
    if config.services.task_url is None:
        return None
    app = TaskAppClient(config.services.task_url, key, config.task.rollout_timeout_s, config.jobs.allowlist())
    try:
        info = asyncio.run(app.check())
    except TaskAppError as err:
        raise SystemExit(f"rlgate: task app check failed: {err}") from None
    print(f"rlgate: task app {app.base_url} ({info.task.get('name', 'unnamed')}) is healthy", flush=True)
    return app


def load_dataset_task(config: RLGateConfig, training: bool = True) -> DatasetTask | None:
    """``[task] dataset`` with its reward function, loaded and checked; None without one.
    ``training``: the rows ``[evaluation]`` evaluates are held out of it."""
    task = config.task
    if task.dataset is None:
        return None
    try:
        loaded = dataset_task(task.dataset, task.dataset_split, task.prompt_column, task.reward)
    except DatasetError as err:
        raise SystemExit(f"rlgate: [task] dataset: {err}") from None
    evaluation = config.evaluation
    if training and evaluation.every_n_iters and evaluation.seeds:
        try:
            loaded.hold_out(evaluation.seeds)
        except DatasetError as err:
            raise SystemExit(f"rlgate: [task] dataset: {err}") from None
    held = f" ({len(loaded.held_out)} held out for evaluation)" if loaded.held_out else ""
    print(f"rlgate: dataset {task.dataset}: {len(loaded.rows)} prompts{held}, reward {task.reward}", flush=True)
    return loaded


def start_episodes(
    config: RLGateConfig,
    url: str,
    key: str,
    stopping: threading.Event,
    task_app: TaskAppClient | None,
    dataset: DatasetTask | None = None,
    first_step: int = 0,
) -> Episodes | None:
    """Play the task app, the dataset or the built-in task, if one is configured;
    else wait for external agents (online mode). Sets ``stopping`` if the
    environment stays down. A resumed run (``first_step`` > 0) draws its problems
    in an order of its own, not the stopped run's again."""
    task = config.task
    if task_app is not None:
        # a resumed run starts past the groups its steps trained on (not the stopped run's first seeds again)
        trained = first_step * (config.training.batch_size // config.training.group_size)
        groups, run = task_app_episodes(
            task_app, config, config.served_model_name, config.gateway.run_name, skip=trained
        )
    elif dataset is not None or task.builtin is not None:
        groups, run = builtin_episodes(
            dataset or get_task(task.builtin),
            url,
            task.max_tokens,
            task.temperature,
            config.training.seed + first_step,
            task.env_delay_s,
        )
    else:
        print("rlgate: online mode: training on sessions that agents run through the gateway", flush=True)
        return None
    return Episodes.start(
        url, key, groups, run, config.training.group_size, task.max_concurrent, task.down_after_s, stopping
    )


EVAL_WAIT_S = 300.0  # how long the end of a run waits for the evaluation under way


def evaluation_episodes(
    config: RLGateConfig, url: str, task_app: TaskAppClient | None, dataset: DatasetTask | None
) -> tuple[list, Callable] | None:
    """``(items, run)`` for :func:`rlgate.training.evaluation.evaluate` over ``[evaluation]
    seeds``: a task app's seeds, a dataset's rows or a built-in task's problems (None: no task)."""
    seeds, task = config.evaluation.seeds, config.task
    if task_app is not None:
        app = task_app.copy()  # its own connections, in the evaluating thread's event loop
        _, run = task_app_episodes(app, config, config.served_model_name, f"{config.gateway.run_name}-eval", "eval")
        return [(seed, seed) for seed in seeds], run
    if dataset is None and task.builtin is None:
        return None
    played = dataset or get_task(task.builtin)
    _, run = builtin_episodes(played, url, task.max_tokens, task.temperature, config.training.seed)
    return problems_for(played, seeds), run


def held_out_evaluation(
    config: RLGateConfig, url: str, key: str, task_app: TaskAppClient | None, dataset: DatasetTask | None, run_dir: Path
) -> Evaluator:
    """Every ``[evaluation] every_n_iters`` steps, ``n`` episodes of each held-out seed
    beside the step loop; each evaluation is a line of ``eval.jsonl`` and its
    figures join the first step line logged after it finished (with ``eval_step``)."""
    settings = config.evaluation

    def run(step: int) -> EvalReport | None:
        episodes = evaluation_episodes(config, url, task_app, dataset)
        if episodes is None:
            return None
        items, play = episodes
        report = asyncio.run(
            evaluate(url, key, play, items, settings.n, config.task.max_concurrent, settings.pass_threshold)
        )
        with (run_dir / "eval.jsonl").open("a") as log:
            whole = report.as_dict()
            log.write(json.dumps({"step": step, **report.metrics(), "n": report.n, "seeds": whole["seeds"]}) + "\n")
        return report

    due = lambda step: bool(settings.every_n_iters and settings.seeds and step % settings.every_n_iters == 0)  # noqa: E731
    return Evaluator(run, due)


@dataclass
class ResumePoint:
    """Where a run starts: the latest checkpoint's step, policy version, GroupBuffer
    state, model folder and next trainer command, or a fresh start."""

    step: int = 0
    version: int = 0
    buffer: dict | None = None
    weights: Path | None = None
    first_command: int = 0
    adapter: Path | None = None
    lines: tuple[dict, list[int]] | None = None  # the checkpoint's step's lines (:func:`saved_lines`)


def resume_point(run_dir: Path, resume: bool) -> ResumePoint:
    found = checkpoint_states(checkpoints_dir(run_dir))
    if not resume:
        if found:
            raise SystemExit(
                f"rlgate: {run_dir} already has checkpoints; pass --resume to continue it, "
                "or set another [gateway] run_name"
            )
        return ResumePoint()
    if not found:
        raise SystemExit(f"rlgate: --resume, but {run_dir} has no checkpoint")
    folder, state = max(found.items(), key=lambda item: item[1]["next_command"])
    driver = state["driver"]
    point = ResumePoint(driver["step"], state["version"], driver["buffer"], first_command=state["next_command"])
    point.lines = saved_lines(state)
    if (folder / ADAPTER).is_dir():  # LoRA: the engines serve the base model with the checkpoint's adapter
        point.adapter = folder / ADAPTER
    else:
        point.weights = folder / MODEL
    return point


def clear_the_route(config: RLGateConfig) -> None:
    """The run's route on Serve's proxy is its own. An application that a run of this
    name left there (its driver died: killed, its node lost) is deleted: its replicas
    would go on saving sessions into the run's trajectories after this run's backlog
    mark, sampled by weights this run does not continue from. An application of
    another run, or any other, is never taken over (``serve.run`` would replace it)."""
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        return
    run, prefix = config.gateway.run_name, config.gateway.route_prefix
    name = app_name(run, prefix)
    apps = client.get_serve_details()["applications"]
    holder = next((app for app, details in apps.items() if details.get("route_prefix") == prefix and app != name), None)
    owner = serving_run(name) if name in apps else None
    # at the root every run's application is named rlgate: one that does not say whose it is (deploying, or too
    # busy to answer in time) is left alone unless it is down for good
    unknown = owner is None and prefix == "/" and name in apps and apps[name]["status"] not in DOWN
    if holder is not None or owner not in (None, run) or unknown:
        what = f"application '{holder}'" if holder is not None else f"run '{owner}'" if owner else f"'{name}'"
        raise SystemExit(
            f"rlgate: route '{prefix}' is served by {what} on this cluster: give this run a [gateway] route_prefix "
            f"of its own, or end that one first (`serve delete {holder or name}` if what served it is gone)"
        )
    if name in apps:
        print(f"rlgate: an earlier run's application {name} is still deployed; deleting it first", flush=True)
        serve.delete(name)


DOWN = ("DEPLOY_FAILED", "UNHEALTHY")  # Serve's states of an application that serves nothing


def serving_run(app: str) -> str | None:
    """The run whose gateway application ``app`` is, as a replica of it says (None when none answers)."""
    try:
        return serve.get_app_handle(app).replica_status.remote().result(timeout_s=10).get("run")
    except Exception:  # not a gateway, or no replica up: nothing there serves a run
        return None


def forget_earlier_run(run: str, run_dir: Path) -> None:
    """A fresh run must not inherit published weights, sessions or capacity
    counts left in the cluster by an earlier run of the same name, nor take
    over its open sessions from their journal (kept aside, not deleted)."""
    end_actors(run, INHERITED_STATE)  # and waits until their names are free for this run's
    journal = run_dir / "sessions" / "journal.jsonl"
    if journal.exists() and journal.stat().st_size:
        aside = journal.with_name(f"journal-{time.strftime('%Y%m%d-%H%M%S')}.set-aside.jsonl")
        journal.rename(aside)
        print(f"rlgate: an earlier run's open sessions are not taken over; their journal is at {aside}", flush=True)


def forget_stopped_run(run: str) -> None:
    """A resumed run starts from its checkpoint, so on a cluster that kept running it
    must not find the stopped run's PolicyStore and CapacityActor at the later
    versions it reached (stopped between checkpoints; a version cannot go back),
    nor its SessionStore holding sessions whose agents are gone: they end, and the
    resumed run's own take their names (the journal stays: its sessions are saved)."""
    end_actors(run, INHERITED_STATE)


def note_waiting(run_dir: Path, reason: str | None) -> None:
    """Why the run waits for resources (``<run>/waiting.json``, read by the JobManager), or no longer."""
    path = run_dir / "waiting.json"
    if reason is None:
        path.unlink(missing_ok=True)
        print("rlgate: the resources are free; starting", flush=True)
        return
    path.write_text(json.dumps({"reason": reason, "at": time.time()}))
    print(f"rlgate: {reason}", flush=True)


def trainer_gpus(config: RLGateConfig) -> float:
    """GPUs per trainer worker: as configured, or 1 when the cluster has one for
    every worker beyond what the rollout replicas take (else CPU bundles)."""
    compute = config.compute
    if compute.gpus_per_worker is not None:
        return compute.gpus_per_worker
    spare = ray.cluster_resources().get("GPU", 0) - config.rollout.replicas * config.rollout.num_gpus
    gpus = 1.0 if spare >= compute.trainer_workers else 0.0
    print(f"rlgate: trainer workers on {'GPU' if gpus else 'CPU'} bundles ({spare:g} GPUs spare)", flush=True)
    return gpus


def save_due(step: int, training) -> bool:
    return step == training.total_steps or bool(training.save_every and step % training.save_every == 0)


def batch_line(records: list[dict], version: int, max_staleness: int, buffer: GroupBuffer) -> dict:
    """What a step's line in metrics.jsonl says of its batch; ``version`` is the one the step
    makes. Staleness is over the tokens trained on: those past ``max_staleness`` the trainer
    drops (:func:`trained_line`'s stale_tokens_dropped)."""
    lags = ((version - 1) - v for r in records for m, v in zip(r["loss_mask"], r["versions"]) if m)
    sampled = [lag for lag in lags if lag <= max_staleness]
    return {
        "version": version,
        "reward_mean": sum(r["reward"] for r in records) / len(records),
        "samples": len({r["session_id"] for r in records}),  # episodes (sessions) trained on
        "records": len(records),  # their training sequences (a turn each with "individual" export)
        "dropped": buffer.counters.dropped,  # episodes dropped so far: equal rewards, partial, stale, failed groups
        "failed": buffer.counters.failed,  # episodes whose environment errored, so far
        "staleness": sum(sampled) / max(1, len(sampled)),  # versions behind, mean and max over sampled tokens
        "staleness_max": max(sampled, default=0),
    }


def trained_line(metrics: dict, step_s: float | None = None, sync_s: float | None = None) -> dict:
    """What a step's line in metrics.jsonl says of its training: the workers' ``metrics``,
    and, when known, the step's time (from its batch to every engine serving the new
    version) and the weight sync's part of it."""
    line = {"stale_tokens_dropped": metrics["stale_tokens_dropped"]}
    if step_s is not None:
        line |= {"tokens_per_s": metrics["trained_tokens"] / max(step_s, 1e-9), "step_s": step_s, "sync_s": sync_s}
    return line | {f"train_{k}": v for k, v in metrics.items()}


def saved_lines(state: dict) -> tuple[dict, list[int]] | None:
    """A checkpoint's step's lines in metrics.jsonl and batches.jsonl, from what the
    checkpoint keeps: its batch's line and the workers' figures (rank 0's: the whole
    batch's with one worker), marked ``recovered``, with no timings or held-out figures.
    None for a checkpoint that keeps no line."""
    driver = state.get("driver") or {}
    if "line" not in driver or state.get("metrics") is None:
        return None
    return driver["line"] | trained_line(state["metrics"]) | {"recovered": True}, driver["seqs"]


if __name__ == "__main__":
    sys.exit(main())
