"""The ``rlgate`` command.

    rlgate model prepare NAME [--dtype float32|bfloat16]
    rlgate check-parity --model NAME [--engine auto|vllm|hf] [--lora [RANK]] [--tolerance X]
    rlgate chat [--config configs/chat.toml]
    rlgate serve [--config configs/serve.toml] [--host H] [--port P]
    rlgate train --config X [--task-app URL] [--resume]        train here (local Ray, started if none runs)
    rlgate train --config X --backend URL [--task-app URL] [--poll]   an RL job on a running gateway
    rlgate jobs list | status ID | events ID | cancel ID
    rlgate session start --task-id T | reward --key K R | end --key K [--failed]
    rlgate trajectories export RUN --out FILE [--format parquet|jsonl] [--model NAME]
    rlgate export RUN OUT [--step N] [--merged] [--push-to-hub REPO_ID [--public]]  a checkpoint as a model folder
    rlgate eval --config X [--model NAME_OR_RUN] [--seeds 0-31] [--n K] [--json OUT]  held-out mean reward, pass@k

The HTTP commands talk to ``--backend`` (default ``$RLGATE_URL``, else
http://127.0.0.1:8000; for ``train``, no gateway means training here) with
``--api-key`` (default ``$RLGATE_ADMIN_KEY``).
Exit codes: 0 success, 1 a check or job failed, 2 bad usage or input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from rlgate.models import BUILTIN_DTYPES, ModelNotFoundError, prepare_model
from rlgate.sdk.client import DEFAULT_URL


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlgate", description="RL for LLM agents from live sessions, on Ray.")
    commands = parser.add_subparsers(dest="command", required=True)

    model = commands.add_parser("model", help="model folders").add_subparsers(dest="action", required=True)
    prepare = model.add_parser("prepare", help="resolve (and build once) a model; print its local folder")
    prepare.add_argument("name", help="tiny-random, smollm2-135m-instruct, a local folder or a cached HF id")
    prepare.add_argument("--dtype", choices=BUILTIN_DTYPES, default="float32", help="storage dtype of built-ins")

    parity = commands.add_parser("check-parity", help="check engine logprobs and in-place weight updates")
    parity.add_argument("--model", required=True, help="model to check (as for `model prepare`)")
    parity.add_argument("--engine", choices=["auto", "vllm", "hf"], default="auto")
    parity.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parity.add_argument("--tolerance", type=float, default=None, help="pass mark for |Δ logprob|")
    parity.add_argument(
        "--learning-rate", type=float, default=None, help="size of the optimizer step pushed (1e-4; --lora 1e-2)"
    )
    parity.add_argument(
        "--lora", type=int, nargs="?", const=8, default=None, metavar="RANK", help="train and push a LoRA adapter"
    )
    parity.add_argument("--no-fresh-engine", action="store_true", help="skip the fresh-engine comparison")
    parity.add_argument(
        "--weight-sync", choices=["file", "ipc"], default="file", help="ipc: the CUDA IPC fast path (GPU only)"
    )

    chat = commands.add_parser("chat", help="serve the model on Ray, run a short scripted chat, save its trajectory")
    chat.add_argument("--config", default="configs/chat.toml")

    commands.add_parser("serve", help="run the gateway and rollout engines (as serve_app.py)", add_help=False)

    def http(command, default_backend: str | None = DEFAULT_URL):
        command.add_argument(
            "--backend", default=os.environ.get("RLGATE_URL", default_backend), help="default $RLGATE_URL"
        )
        command.add_argument("--api-key", default=os.environ.get("RLGATE_ADMIN_KEY"), help="default $RLGATE_ADMIN_KEY")
        return command

    train = http(
        commands.add_parser(
            "train",
            help="train with a config: here (local Ray) or, with --backend or $RLGATE_URL, as a job on that gateway",
        ),
        default_backend=None,
    )
    train.add_argument("--config", required=True, help="an RL TOML (rlgate's or synth-ai's shape)")
    train.add_argument("--task-app", help="the task app's base URL (overrides [services] task_url)")
    train.add_argument("--model", help="overrides [model] name")
    train.add_argument(
        "--task-app-key", default=os.environ.get("ENVIRONMENT_API_KEY"), help="default $ENVIRONMENT_API_KEY"
    )
    train.add_argument("--idempotency-key", help="on a gateway: resubmitting with the same key returns the same job")
    train.add_argument("--poll", action="store_true", help="on a gateway: follow the job with a live progress display")
    train.add_argument("--resume", action="store_true", help="here: continue the run from its latest checkpoint")
    train.add_argument("--run-dir", help="here: overrides [gateway] run_dir")

    jobs = commands.add_parser("jobs", help="RL jobs").add_subparsers(dest="action", required=True)
    http(jobs.add_parser("list", help="every job, newest first"))
    for action, text in (("status", "one job's status"), ("events", "one job's events"), ("cancel", "cancel a job")):
        http(jobs.add_parser(action, help=text)).add_argument("job_id")
    jobs.choices["events"].add_argument("--since", type=int, default=0, help="only events after this seq")

    session = commands.add_parser("session", help="gateway sessions").add_subparsers(dest="action", required=True)
    start = http(session.add_parser("start", help="start a session; prints its id, key and inference URL"))
    start.add_argument("--task-id", required=True)
    start.add_argument("--group-size", type=int)
    start.add_argument("--wait", type=float, default=0.0, help="wait up to this long for capacity")
    reward = http(session.add_parser("reward", help="set a reward on the session's latest (or given) completion"))
    reward.add_argument("--key", required=True, help="the session's api_key")
    reward.add_argument("reward", type=float)
    reward.add_argument("--interaction-id")
    end = http(session.add_parser("end", help="end a session (its trajectory is saved)"))
    end.add_argument("--key", required=True, help="the session's api_key")
    end.add_argument("--failed", action="store_true", help="the episode failed: train on none of it")

    trajectories = commands.add_parser("trajectories", help="saved trajectories").add_subparsers(
        dest="action", required=True
    )
    export = trajectories.add_parser(
        "export", help="a run's records, with their text decoded, as Parquet (pandas, datasets) or JSON lines"
    )
    export.add_argument("run", help="the run folder (holding trajectories/)")
    export.add_argument("--out", required=True, help="the file to write")
    export.add_argument("--format", choices=["parquet", "jsonl"], default="parquet")
    export.add_argument("--model", help="whose tokenizer decodes the text (default: the run's config.toml)")
    evaluate = commands.add_parser(
        "eval", help="a model's held-out episodes through a gateway: mean reward and pass@k per seed"
    )
    evaluate.add_argument("--config", required=True, help="the episodes: [task], [services] task_url, [evaluation]")
    evaluate.add_argument("--model", help="a model name or folder, or a run folder (its latest checkpoint)")
    evaluate.add_argument("--task", help="a built-in task instead of the config's")
    evaluate.add_argument("--dataset", help="a dataset (jsonl, parquet or a name) instead; with --reward")
    evaluate.add_argument("--reward", help="the dataset's reward function, MODULE:FUNCTION or FILE.py:FUNCTION")
    evaluate.add_argument("--task-app", help="a task app's base URL instead")
    evaluate.add_argument("--seeds", nargs="+", help="seeds or ranges (0-31); a dataset's seeds are its rows")
    evaluate.add_argument("--n", type=int, help="episodes per seed ([evaluation] n)")
    evaluate.add_argument(
        "--threshold", type=float, help="an episode passes at this reward ([evaluation] pass_threshold)"
    )
    evaluate.add_argument("--json", help="write the report here (default: standard output)")
    evaluate.add_argument(
        "--backend", default=os.environ.get("RLGATE_URL"), help="a gateway serving the model (default: one here)"
    )
    evaluate.add_argument("--api-key", default=os.environ.get("RLGATE_ADMIN_KEY"), help="default $RLGATE_ADMIN_KEY")
    model_export = commands.add_parser(
        "export", help="a run's checkpoint as a Hugging Face model folder with a model card"
    )
    model_export.add_argument("run", help="the run folder (holding trainer/step-*/)")
    model_export.add_argument("out", help="the folder to write (new or empty)")
    model_export.add_argument("--step", type=int, help="the checkpoint of this step (default: the latest)")
    model_export.add_argument(
        "--merged",
        action="store_true",
        help="a LoRA run: its merged model ([training.lora] save_merged), not the adapter",
    )
    model_export.add_argument("--push-to-hub", metavar="REPO_ID", help="then upload it to this Hub model repo")
    model_export.add_argument("--public", action="store_true", help="with --push-to-hub: a new repo is public")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(sys.argv[1:] if argv is None else argv)
    except KeyboardInterrupt:  # Ctrl-C: stopped, as the user asked; no traceback
        print("rlgate: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str]) -> int:
    if argv[:1] == ["serve"]:  # serve_app.py's own options
        from rlgate.serving.app import main as serve

        sys.argv = ["rlgate serve", *argv[1:]]
        serve()
        return 0
    args = _parser().parse_args(argv)
    if args.command == "train" and args.backend is None:
        return _train_here(args)
    if args.command in ("train", "jobs", "session"):
        from rlgate.sdk.client import RLGateError

        try:
            return _http_command(args)
        except RLGateError as err:
            print(f"rlgate: error: {err.message}", file=sys.stderr)
            print(f"rlgate: hint: {_hint(err, args)}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 130
    try:
        if args.command == "model":
            print(prepare_model(args.name, args.dtype))
            return 0
        if args.command == "check-parity":
            return _check_parity(args)
        if args.command == "chat":
            from rlgate.cli.chat import run_chat

            return run_chat(args.config)
        if args.command == "trajectories":
            return _export(args)
        if args.command == "export":
            return _export_model(args)
        if args.command == "eval":
            from rlgate.cli.evaluate import run_eval

            return run_eval(args)
    except (ModelNotFoundError, ValueError) as err:
        print(f"rlgate: error: {err}", file=sys.stderr)
        return 2
    return 2


def _export(args) -> int:
    from transformers import AutoTokenizer

    from rlgate.cli.export import export, run_model

    model = args.model or run_model(args.run)
    if model is None:
        raise ValueError(f"{args.run} has no config.toml naming its model; pass --model")
    count = export(args.run, args.out, args.format, AutoTokenizer.from_pretrained(prepare_model(model)))
    print(f"{count} records -> {args.out}")
    return 0


def _export_model(args) -> int:
    from rlgate.cli.export_model import export_model, push_to_hub

    out, step = export_model(args.run, args.out, args.step, args.merged)
    print(f"rlgate: step {step} of {args.run} -> {out} (README.md is its model card)")
    if args.push_to_hub:
        print(f"rlgate: pushed to {push_to_hub(out, args.push_to_hub, args.public)}")
    return 0


def _check_parity(args) -> int:
    import os

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # keep the report readable
    from transformers.utils import logging as hf_logging

    from rlgate.config import LoraSettings
    from rlgate.rollout.parity import failures, run_parity, tolerance_for

    hf_logging.disable_progress_bar()
    lora = LoraSettings(rank=args.lora, alpha=2.0 * args.lora) if args.lora is not None else None
    report = run_parity(
        args.model,
        engine=args.engine,
        dtype=args.dtype,
        learning_rate=args.learning_rate or (1e-2 if lora is not None else 1e-4),
        fresh_engine=not args.no_fresh_engine,
        weight_sync=args.weight_sync,
        lora=lora,
    )
    for line in report.lines():
        print(line)
    tolerance = args.tolerance if args.tolerance is not None else tolerance_for(args.model)
    problems = failures(report, tolerance)
    for problem in problems:
        print(f"FAIL: {problem}", file=sys.stderr)
    print("parity: " + ("FAIL" if problems else "OK"))
    return 1 if problems else 0


def _hint(err, args) -> str:
    from rlgate.sdk.client import APIConnectionError

    if isinstance(err, APIConnectionError):
        return f"is the gateway running at {args.backend}? set --backend or RLGATE_URL"
    if err.status == 0:  # not sent: something on this side (a file, a flag)
        return "fix the command line or the file it names as the message says"
    if err.status in (401, 403):
        return "pass the admin key (or the job's own key) with --api-key or RLGATE_ADMIN_KEY"
    if err.status == 404:
        return "`rlgate jobs list` shows the jobs there are"
    if err.status == 422:
        return "fix the config or request as the message says, then submit again"
    if err.status == 409:
        return "nothing to do: the job or session is already in that state"
    return "see the gateway's logs for more"


def _http_command(args) -> int:
    from rlgate.sdk.client import RLGateError, RLJob, Session, list_jobs

    if args.api_key is None and not (args.command == "session" and args.action in ("reward", "end")):
        raise RLGateError(401, "no API key given")
    show = lambda value: print(json.dumps(value, indent=2))  # noqa: E731
    if args.command == "train":
        if args.resume or args.run_dir:
            raise RLGateError(0, "--resume and --run-dir are for training here; a job on a gateway runs fresh")
        job = RLJob.from_config(
            args.config,
            args.backend,
            args.api_key,
            args.task_app,
            args.idempotency_key,
            args.model,
            task_app_api_key=args.task_app_key,  # for the job's calls to the task app; kept out of its records
        )
        job_id = job.submit()
        print(f"rlgate: job {job_id} submitted" + (f"; its own key: {job.job_api_key}" if job.job_api_key else ""))
        return _follow(job) if args.poll else 0
    if args.command == "jobs":
        if args.action == "list":
            for item in list_jobs(args.backend, args.api_key):
                step = item["progress"].get("step", 0)
                print(f"{item['job_id']}  {item['status']:<10} step {step}/{item['total_steps']}  {item['model']}")
            return 0
        job = RLJob.from_job_id(args.job_id, args.backend, args.api_key)
        if args.action == "status":
            show(job.get_status())
        elif args.action == "events":
            for event in job.events(since_seq=args.since, limit=10_000):
                print(f"{event['seq']:>5} {event['type']:<24} {event['message']}")
        else:
            print(f"rlgate: job {args.job_id} {job.cancel()['status']}")
        return 0
    if args.action == "start":
        session = Session.start(args.backend, args.api_key, args.task_id, args.group_size, args.wait)
        show({"session_id": session.session_id, "api_key": session.api_key, "inference_url": session.inference_url})
        return 0
    session = Session.of_key(args.key, args.backend)
    show(session.set_reward(args.reward, args.interaction_id) if args.action == "reward" else session.end(args.failed))
    return 0


def _train_here(args) -> int:
    """The training driver (``train_driver.py``) with this config, on this machine's Ray (started if none runs)."""
    if args.idempotency_key or args.poll:
        print("rlgate: error: --idempotency-key and --poll are for jobs on a gateway", file=sys.stderr)
        print("rlgate: hint: give the gateway with --backend or RLGATE_URL", file=sys.stderr)
        return 2
    from pydantic import ValidationError

    from rlgate.config import ConfigError, load_config

    try:  # a bad file is said in a second, before Ray and torch are imported
        load_config(args.config)
    except (ConfigError, ValidationError) as err:
        print(f"rlgate: error: {err}", file=sys.stderr)
        print(
            "rlgate: hint: fix the config as the message says (docs/configuration.md lists every key)", file=sys.stderr
        )
        return 2
    from rlgate.training import driver  # Ray, torch: only once it is sure to run

    if args.task_app_key:
        os.environ["ENVIRONMENT_API_KEY"] = args.task_app_key
    options = ["--config", args.config] + (["--resume"] if args.resume else [])
    for flag, value in (("--run-dir", args.run_dir), ("--task-app", args.task_app), ("--model", args.model)):
        options += [flag, value] if value else []
    sys.argv = ["rlgate train", *options]
    return driver.main()


def _follow(job) -> int:
    """A live progress bar until the job finishes; 0 if it succeeded."""
    import time

    from tqdm import tqdm

    bar, seen, waiting = None, 0, None
    while True:
        status = job.get_status()
        progress = status["progress"]
        if status.get("waiting") != waiting:  # why it has not started (resources, the queue), once
            waiting = status.get("waiting")
            if waiting:
                (bar.write if bar is not None else print)(f"rlgate: job {job.job_id}: {waiting}", file=sys.stderr)
        if bar is None and status["total_steps"]:
            bar = tqdm(total=status["total_steps"], desc=job.job_id, unit="step")
        if bar is not None:
            step = progress.get("step", 0)
            bar.update(step - seen)
            seen = step
            bar.set_postfix(status=status["status"], reward=progress.get("reward_mean"))
        if status["status"] in ("succeeded", "failed", "cancelled"):
            break
        time.sleep(2.0)
    if bar is not None:
        bar.close()
    if status["status"] != "succeeded":
        print(f"rlgate: job {job.job_id} {status['status']}: {status['error'] or ''}".rstrip(": "), file=sys.stderr)
        return 1
    results = status["results"]
    print(f"rlgate: job {job.job_id} succeeded; final reward {results['final_reward']}; model {results['model_path']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
