"""The ``rlgate`` command.

    rlgate model prepare NAME [--dtype float32|bfloat16]
    rlgate check-parity --model NAME [--engine auto|vllm|hf] [--tolerance X]
    rlgate chat [--config configs/chat.toml]

Exit codes: 0 success, 1 a check failed, 2 bad usage or input.
"""

from __future__ import annotations

import argparse
import sys

from rlgate.models import BUILTIN_DTYPES, ModelNotFoundError, prepare_model


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
    parity.add_argument("--learning-rate", type=float, default=1e-4, help="size of the optimizer step pushed")
    parity.add_argument("--no-fresh-engine", action="store_true", help="skip the fresh-engine comparison")
    parity.add_argument(
        "--weight-sync", choices=["file", "ipc"], default="file", help="ipc: the CUDA IPC fast path (GPU only)"
    )

    chat = commands.add_parser("chat", help="serve the model on Ray, run a short scripted chat, save its trajectory")
    chat.add_argument("--config", default="configs/chat.toml")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "model":
            print(prepare_model(args.name, args.dtype))
            return 0
        if args.command == "check-parity":
            return _check_parity(args)
        if args.command == "chat":
            from rlgate.scripted_chat import run_chat

            return run_chat(args.config)
    except (ModelNotFoundError, ValueError) as err:
        print(f"rlgate: error: {err}", file=sys.stderr)
        return 2
    return 2


def _check_parity(args) -> int:
    import os

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # keep the report readable
    from transformers.utils import logging as hf_logging

    from rlgate.parity import failures, run_parity, tolerance_for

    hf_logging.disable_progress_bar()
    report = run_parity(
        args.model,
        engine=args.engine,
        dtype=args.dtype,
        learning_rate=args.learning_rate,
        fresh_engine=not args.no_fresh_engine,
        weight_sync=args.weight_sync,
    )
    for line in report.lines():
        print(line)
    tolerance = args.tolerance if args.tolerance is not None else tolerance_for(args.model)
    problems = failures(report, tolerance)
    for problem in problems:
        print(f"FAIL: {problem}", file=sys.stderr)
    print("parity: " + ("FAIL" if problems else "OK"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
