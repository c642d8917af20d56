"""Gateway benchmark: rlgate (sessions and recording on) against vLLM's own
OpenAI server on the same model, prompts, max_tokens and concurrency, in one run.

    python bench/gateway.py [--model smollm2-135m-instruct] [--concurrency 1 8 32] [--requests 4]
                            [--stream] [--colocate] [--direct] [--peer-logprobs]

Each of ``c`` concurrent clients sends ``--requests`` chat completions back to
back (greedy, so both servers generate the same tokens). Through rlgate each
client is one session (start_session, chats with its key, end_session), so
every completion is rendered, generated, recorded and exported. Prints
requests/s, p50/p99 latency and the ratio rlgate/vLLM. The two servers run one
after the other, never together. ``--stream`` streams every answer (tokens
from the final usage chunk; the time to the first content chunk is reported
too); ``--colocate`` and ``--direct`` run
rlgate with ``[gateway] colocate`` and ``direct_port``. ``--peer-logprobs``
has vLLM's clients ask for the sampled tokens' logprobs, as an RL client of
``vllm serve`` must (rlgate's engine computes them for every turn it records).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import httpx  # noqa: E402
import openai  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cost import cpu_seconds, per_turn, spent  # noqa: E402

from rlgate.models import prepare_model  # noqa: E402
from rlgate.serving.routing import serve_start_options  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Give me a synonym for happy.",
    "What is 12 times 12?",
    "Write a haiku about the sea.",
    "Why is the sky blue?",
    "List two uses of a paperclip.",
    "What does CPU stand for?",
]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def drive(
    base_url: str, keys: list[str], model: str, requests: int, max_tokens: int, stream: bool = False, logprobs=False
):
    """Run len(keys) clients concurrently; return (latencies, seconds, completion tokens,
    CPU-seconds the servers spent per process, times to the first streamed token)."""
    latencies: list[float] = []
    first_tokens: list[float] = []
    tokens = 0

    async def client(index: int, key: str) -> None:
        nonlocal tokens
        api = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=600)
        for r in range(requests):
            question = QUESTIONS[(index + r) % len(QUESTIONS)]
            body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens}
            if logprobs:
                body["logprobs"] = True
            started = time.perf_counter()
            if stream:
                first, usage = None, None
                options = {"include_usage": True}
                async for chunk in await api.chat.completions.create(
                    **body, temperature=0, stream=True, stream_options=options
                ):
                    if first is None and chunk.choices and chunk.choices[0].delta.content:
                        first = time.perf_counter() - started
                    usage = chunk.usage or usage
                tokens += usage.completion_tokens
                first_tokens.append(first if first is not None else float("nan"))
            else:
                reply = await api.chat.completions.create(**body, temperature=0)
                tokens += reply.usage.completion_tokens
            latencies.append(time.perf_counter() - started)
        await api.close()

    started, cpu_before = time.perf_counter(), cpu_seconds()
    await asyncio.gather(*[client(i, key) for i, key in enumerate(keys)])
    return latencies, time.perf_counter() - started, tokens, spent(cpu_before, cpu_seconds()), first_tokens


def summarise(latencies, seconds, tokens, cpu, first_tokens) -> dict:
    ordered = sorted(latencies)
    return {
        "first_token_p50_s": statistics.median(first_tokens) if first_tokens else None,
        "cpu_ms_per_request": per_turn(cpu, len(latencies)),
        "requests_per_s": len(latencies) / seconds,
        "tokens_per_s": tokens / seconds,
        "p50_s": statistics.median(ordered),
        "p99_s": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "requests": len(latencies),
    }


@contextlib.contextmanager
def vllm_server(model_path: Path):
    """vLLM's OpenAI server with the engine settings rlgate uses on this machine;
    yields its base URL (served model name ``bench``)."""
    import torch

    from rlgate.rollout.engines.vllm import cpu_environment_defaults, engine_threads

    port = free_port()
    env = dict(os.environ)
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_path),
        "--served-model-name",
        "bench",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--disable-log-stats",
    ]
    if not torch.cuda.is_available():
        env.update({k: v for k, v in cpu_environment_defaults().items() if k not in env})
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        env["OMP_NUM_THREADS"] = str(engine_threads())  # as many threads as rlgate's engine computes on
        command += ["--enforce-eager", "--no-enable-chunked-prefill", "--max-num-batched-tokens", "2048"]
    log = tempfile.NamedTemporaryFile(prefix="vllm-serve-", suffix=".log", delete=False)
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise RuntimeError(f"vllm serve exited; see {log.name}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=60)


def bench_vllm_server(model_path: Path, levels, requests, max_tokens, stream=False, logprobs=False) -> dict:
    with vllm_server(model_path) as url:
        asyncio.run(drive(f"{url}/v1", ["none"], "bench", 1, 4))  # warm-up
        return {
            c: summarise(
                *asyncio.run(drive(f"{url}/v1", ["none"] * c, "bench", requests, max_tokens, stream, logprobs))
            )
            for c in levels
        }


@contextlib.contextmanager
def rlgate_server(
    name: str, model: str, max_concurrent: int, colocate=False, direct=False, access_log=True, replicas: int = 1
):
    """rlgate on a fresh local Ray, its Serve app ``name`` at the root; yields
    (base URL, admin key). ``direct``: the URL is the replica's own port (with
    colocated ``replicas``, replica n's is that port + n)."""
    import secrets

    import ray
    from ray import serve

    from rlgate.config import parse_config
    from rlgate.serving.app import build_app
    from rlgate.sessions.manager import hash_key

    admin = secrets.token_hex(16)
    config = parse_config(
        {
            "model": {"name": model},
            "rollout": {"max_model_len": 2048, "kv_cache_gib": 1.0, "replicas": replicas},
            "gateway": {
                "run_dir": tempfile.mkdtemp(prefix=f"rlgate-{name}-"),
                "run_name": name,
                "max_concurrent": max_concurrent,
                "access_log": access_log,
                "colocate": colocate,
                "direct_port": free_port() if direct else None,
            },
        }
    )
    port = free_port()
    ray.init(include_dashboard=False, log_to_driver=False)
    quiet = {"enable_access_log": False}
    serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config=quiet, **serve_start_options())
    serve.run(build_app(config, hash_key(admin)), name=name, route_prefix="/", logging_config=quiet)
    try:
        yield f"http://127.0.0.1:{config.gateway.direct_port or port}", admin
    finally:
        serve.shutdown()
        ray.shutdown()


def bench_rlgate(model: str, levels, requests, max_tokens, stream=False, colocate=False, direct=False) -> dict:
    """rlgate's gateway and engines on local Ray, sessions and recording on."""
    with rlgate_server("bench", model, 256, colocate, direct) as (url, admin):
        return _bench_rlgate(url, admin, model, levels, requests, max_tokens, stream)


def _bench_rlgate(url: str, admin: str, model: str, levels, requests, max_tokens, stream) -> dict:
    headers = {"Authorization": f"Bearer {admin}"}

    def sessions(count):
        return [
            httpx.post(f"{url}/rl/start_session", json={"task_id": "bench"}, headers=headers).json()["api_key"]
            for _ in range(count)
        ]

    def end(keys):
        for key in keys:
            httpx.post(f"{url}/rl/end_session", headers={"Authorization": f"Bearer {key}"})

    warm = sessions(1)
    asyncio.run(drive(f"{url}/v1", warm, model, 1, 4))
    end(warm)
    results = {}
    for c in levels:
        keys = sessions(c)
        results[c] = summarise(*asyncio.run(drive(f"{url}/v1", keys, model, requests, max_tokens, stream)))
        end(keys)
    exported = httpx.get(f"{url}/rl/status", headers=headers).json()["trajectories"]["trajectories"]
    results["trajectories_saved"] = exported
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=4, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--stream", action="store_true", help="stream every answer (SSE)")
    parser.add_argument("--colocate", action="store_true", help="[gateway] colocate: the engine in the gateway replica")
    parser.add_argument("--direct", action="store_true", help="[gateway] direct_port: skip Serve's proxy")
    parser.add_argument(
        "--peer-logprobs",
        action="store_true",
        help="vLLM's clients ask for logprobs, as an RL client of vllm serve must (rlgate records them anyway)",
    )
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table

    path = prepare_model(args.model)
    peer = bench_vllm_server(path, args.concurrency, args.requests, args.max_tokens, args.stream, args.peer_logprobs)
    ours = bench_rlgate(
        args.model, args.concurrency, args.requests, args.max_tokens, args.stream, args.colocate, args.direct
    )
    expected = sum(args.concurrency) * args.requests + 1  # + the warm-up session
    shape = ("streamed" if args.stream else "whole") + (", colocated" if args.colocate else "")
    shape += ", direct port" if args.direct else ""
    shape += ", peer with logprobs" if args.peer_logprobs else ""
    table = Table(
        title=f"chat completions ({shape}), {args.model}, max_tokens={args.max_tokens}, greedy, {os.cpu_count()} CPUs"
    )
    columns = ("concurrency", "server", "req/s", "tok/s", "p50 s", "p99 s", "first token p50 s", "CPU ms/req")
    for column in (*columns, "rlgate / vLLM req/s, tok/s"):
        table.add_column(column, justify="right")
    for c in args.concurrency:
        for name, result in (("vllm serve", peer[c]), ("rlgate gateway", ours[c])):
            ratio = (
                f"{ours[c]['requests_per_s'] / peer[c]['requests_per_s']:.2f}, "
                f"{ours[c]['tokens_per_s'] / peer[c]['tokens_per_s']:.2f}"
                if name.startswith("rlgate")
                else ""
            )
            first = result["first_token_p50_s"]
            table.add_row(
                str(c),
                name,
                f"{result['requests_per_s']:.2f}",
                f"{result['tokens_per_s']:.0f}",
                f"{result['p50_s']:.2f}",
                f"{result['p99_s']:.2f}",
                f"{first:.2f}" if first is not None else "-",
                f"{result['cpu_ms_per_request']['total']:.1f}",
                ratio,
            )
    console = Console(width=140)
    console.print(table)
    console.print(f"trajectories saved by rlgate: {ours['trajectories_saved']} (expected {expected})")
    top = max(args.concurrency)
    for name, result in (("vLLM", peer[top]), ("rlgate", ours[top])):
        parts = ", ".join(f"{k} {v}" for k, v in result["cpu_ms_per_request"].items() if k != "total")
        console.print(f"CPU ms per request at concurrency {top}, {name}: {parts}")
    if args.json:
        args.json.write_text(json.dumps({"vllm": peer, "rlgate": ours}, indent=2))


if __name__ == "__main__":
    main()
