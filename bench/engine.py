"""Engine benchmark: generated tokens/s and in-place weight-update seconds.

    python bench/engine.py [--models tiny-random smollm2-135m-instruct] [--tokens 64]

For each model, runs VLLMEngine, HFEngine and, as the peer, vLLM's bare
``AsyncLLM`` (no rlgate wrapper) one after another on the same machine, at
concurrency 1 and 64, then prints a table with ratios against the peer.
Every request samples ``--tokens`` tokens (temperature 1, seeded, EOS ignored).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlgate.models import prepare_model  # noqa: E402
from rlgate.rollout.engines import SamplingParams, collect  # noqa: E402

PROMPT = "Write a short story about a robot who learns to paint."


TRIALS = 3
PEER = "bare AsyncLLM (peer)"


async def throughput(generate_one, concurrency: int, tokens: int, rounds: int) -> list[float]:
    """Generated tokens per second with ``concurrency`` requests in flight, one
    figure per trial (on a small shared machine single runs vary by 2x)."""
    figures = []
    for trial in range(TRIALS):
        started = time.perf_counter()
        total = 0
        for r in range(rounds):
            base = (trial * rounds + r) * concurrency  # distinct seeds for every request
            counts = await asyncio.gather(*[generate_one(base + i, tokens) for i in range(concurrency)])
            total += sum(counts)
        figures.append(total / (time.perf_counter() - started))
    return figures


async def bench_rlgate_engine(kind: str, path: Path, prompt_ids, tokens: int, updates: int) -> dict:
    from safetensors.torch import load_file

    from rlgate.config import RolloutConfig
    from rlgate.rollout.engines import make_engine

    engine = make_engine(path, RolloutConfig(engine=kind, max_model_len=1024, kv_cache_gib=1.0))
    await engine.ready()

    async def one(seed: int, n_tokens: int) -> int:
        params = SamplingParams(max_tokens=n_tokens, temperature=1.0, seed=seed, ignore_eos=True)
        [out] = await collect(engine.generate(prompt_ids, params))
        return len(out.token_ids)

    try:
        await one(0, 4)  # warm-up
        result = {
            "c1": await throughput(one, 1, tokens, rounds=4),
            "c64": await throughput(one, 64, tokens, rounds=1),
        }
        weights = load_file(next(path.glob("*.safetensors")))
        seconds = []
        for _ in range(updates):
            report = await engine.update_weights(weights, engine.version + 1)
            seconds.append(report.seconds)
        result["update_s"] = statistics.median(seconds)
        return result
    finally:
        await engine.shutdown()


async def bench_bare_asyncllm(path: Path, prompt_ids, tokens: int) -> dict:
    """The peer: vLLM's AsyncLLM with the same engine settings, no rlgate code."""
    import torch
    from vllm import SamplingParams as VllmParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import tokens_input
    from vllm.v1.engine.async_llm import AsyncLLM

    from rlgate.rollout.engines.vllm import cpu_engine_overrides, cpu_environment_defaults

    kwargs = dict(model=str(path), dtype="float32", max_model_len=1024, enforce_eager=True, disable_log_stats=True)
    if not torch.cuda.is_available():
        for key, value in cpu_environment_defaults().items():
            os.environ.setdefault(key, value)
        kwargs.update(cpu_engine_overrides(1024, 1.0))
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))

    async def one(seed: int, n_tokens: int) -> int:
        params = VllmParams(max_tokens=n_tokens, temperature=1.0, seed=seed, ignore_eos=True, logprobs=0)
        outputs = [
            out async for out in llm.generate(tokens_input(list(prompt_ids)), params, f"bench-{seed}-{time.time_ns()}")
        ]
        return len(outputs[-1].outputs[0].token_ids)

    try:
        await one(0, 4)
        return {
            "c1": await throughput(one, 1, tokens, rounds=4),
            "c64": await throughput(one, 64, tokens, rounds=1),
        }
    finally:
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["tiny-random", "smollm2-135m-instruct"])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table
    from transformers import AutoTokenizer

    from rlgate.rollout.engines import vllm_installed

    results: dict[str, dict[str, dict]] = {}
    for model in args.models:
        path = prepare_model(model)
        tokenizer = AutoTokenizer.from_pretrained(path)
        prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)[
            "input_ids"
        ]
        rows = results.setdefault(model, {})
        if vllm_installed():
            rows[PEER] = asyncio.run(bench_bare_asyncllm(path, prompt_ids, args.tokens))
            rows["VLLMEngine"] = asyncio.run(bench_rlgate_engine("vllm", path, prompt_ids, args.tokens, args.updates))
        rows["HFEngine"] = asyncio.run(bench_rlgate_engine("hf", path, prompt_ids, args.tokens, args.updates))

    title = (
        f"generated tokens/s, median (min-max) of {TRIALS} trials ({args.tokens} tokens/request, {os.cpu_count()} CPUs)"
    )
    table = Table(title=title)
    for column in ("model", "engine", "conc. 1", "conc. 64", "vs peer c1", "vs peer c64", "update s"):
        table.add_column(column, justify="left" if column in ("model", "engine") else "right")
    med = statistics.median
    for model, rows in results.items():
        peer = rows.get(PEER)
        for name, row in rows.items():
            cells = [f"{med(row[c]):.0f} ({min(row[c]):.0f}-{max(row[c]):.0f})" for c in ("c1", "c64")]
            ratios = [f"{med(row[c]) / med(peer[c]):.2f}x" if peer else "-" for c in ("c1", "c64")]
            update = f"{row['update_s']:.3f}" if "update_s" in row else "-"
            table.add_row(model, name, *cells, *ratios, update)
    Console(width=140).print(table)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
