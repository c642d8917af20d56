"""Load benchmark: many concurrent agent sessions against the gateway for a
fixed time, and vLLM's own OpenAI server under the same chat load as the peer.

    python bench/load.py [--model tiny-random] [--sessions 256] [--turns 4] [--seconds 60] [--rounds 1]
                         [--json out.json]

Each of ``--sessions`` virtual agents loops until the time is up: start a
session (admin key), ``--turns`` chat completions continuing one
conversation (the official openai client, its session key), a reward, the
end. Against vLLM the same agents send the same conversations with no
session calls. Everything is on loopback. Reports sessions/s, turns/s,
p50/p99 latency per call, errors by status, the resident memory that open
sessions add (Gateway replica + SessionStore, sampled every second, over the
most sessions open at once) beside what the same agents add to vLLM's API
server (the load itself: connections, requests in flight), and checks that
every session whose end was acknowledged was saved exactly once.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import httpx  # noqa: E402
import openai  # noqa: E402
from cost import cpu_seconds, own_seconds, per_turn, resident_bytes, spent  # noqa: E402
from gateway import QUESTIONS, rlgate_server, vllm_server  # noqa: E402

from rlgate.models import prepare_model  # noqa: E402


class Tally:
    """Latencies per call and answers per status."""

    def __init__(self) -> None:
        self.latencies: dict[str, list[float]] = collections.defaultdict(list)
        self.statuses: collections.Counter = collections.Counter()
        self.ended: dict[str, int] = {}  # session id -> turns answered, for sessions whose end answered 200

    async def timed(self, call: str, coroutine):
        started = time.perf_counter()
        try:
            result = await coroutine
        except openai.APIStatusError as err:
            self.statuses[f"{call} {err.status_code}"] += 1
            return None
        except (openai.APIConnectionError, httpx.HTTPError) as err:
            self.statuses[f"{call} {err.__class__.__name__}"] += 1
            return None
        status = getattr(result, "status_code", 200)
        self.statuses[f"{call} {status}"] += 1
        if status < 400:
            self.latencies[call].append(time.perf_counter() - started)
        return result if status < 400 else None

    def summary(self, seconds: float, cpu: dict[str, float], client_cpu: float) -> dict:
        def pct(values, q):
            ordered = sorted(values)
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None

        return {
            "seconds": seconds,
            "sessions_per_s": len(self.ended) / seconds,
            "turns_per_s": len(self.latencies["chat"]) / seconds,
            "latency_s": {
                call: {"p50": statistics.median(v), "p99": pct(v, 0.99), "n": len(v)}
                for call, v in self.latencies.items()
                if v
            },
            "statuses": dict(sorted(self.statuses.items())),
            "errors": sum(n for k, n in self.statuses.items() if not k.endswith(" 200")),
            "cpu_ms_per_turn": per_turn(cpu, len(self.latencies["chat"])),
            # the agents' side (this process) shares the machine: it bounds both servers alike
            "client_cpu_ms_per_turn": round(1000 * client_cpu / max(1, len(self.latencies["chat"])), 2),
        }


async def conversation(
    client: openai.AsyncOpenAI,
    model: str,
    turns: int,
    index: int,
    tally: Tally,
    max_tokens: int,
    logprobs: bool = False,
):
    """Up to ``turns`` chat completions continuing one conversation; returns how many were answered."""
    messages = [{"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]}]
    extra = {"logprobs": True} if logprobs else {}
    for turn in range(turns):
        reply = await tally.timed(
            "chat", client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, **extra)
        )
        if reply is None:
            return turn
        messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""}]
        messages += [{"role": "user", "content": "And then?"}]
    return turns


async def rlgate_agent(url: str, admin: str, index: int, args, tally: Tally, deadline: float) -> None:
    # one connection pool per agent, kept across its sessions (as an agent process would)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=60)) as http:
        while time.monotonic() < deadline:
            started = await tally.timed(
                "start",
                http.post(
                    f"{url}/rl/start_session",
                    json={"task_id": f"load{index}", "wait_s": 30},
                    headers={"Authorization": f"Bearer {admin}"},
                ),
            )
            if started is None:
                await asyncio.sleep(1)
                continue
            body = started.json()
            headers = {"Authorization": f"Bearer {body['api_key']}"}
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=body["api_key"], max_retries=0, http_client=http)
            answered = await conversation(client, args.model, args.turns, index, tally, args.max_tokens)
            if answered:
                await tally.timed("reward", http.post(f"{url}/rl/set_reward", json={"reward": 1.0}, headers=headers))
            if await tally.timed("end", http.post(f"{url}/rl/end_session", headers=headers)) is not None:
                tally.ended[body["session_id"]] = answered


async def peer_agent(url: str, index: int, args, tally: Tally, deadline: float) -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=60)) as http:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, http_client=http)
        while time.monotonic() < deadline:
            await conversation(client, "bench", args.turns, index, tally, args.max_tokens, args.peer_logprobs)


# the processes that hold sessions, and their counterpart in vLLM's server (its HTTP front end
# and engine client; the engine core is a process of its own on both sides)
RLGATE_FRONT = {"ray::ServeReplica:load:Gateway", "ray::SessionStore"}
PEER_FRONT = {"vllm api_server"}


async def peak_resident(labels: set[str], deadline: float, peak: dict, open_now=None) -> None:
    """Sample the resident memory of ``labels`` each second until ``deadline``; ``peak`` keeps the
    most, with the open sessions counted then (``open_now``: a coroutine function) where given."""
    while time.monotonic() < deadline:
        count = await open_now() if open_now else 0
        if count >= peak.get("open", 0):
            peak.update(open=count, rss=max(peak.get("rss", 0), resident_bytes(labels)))
        await asyncio.sleep(1)


WARM_UP_AGENTS, WARM_UP_S = 8, 2.0


async def run_rlgate(url: str, admin: str, args) -> dict:
    # a few sessions first, so the memory baseline is of a server that has served (caches, lazy imports)
    tally, warm, deadline = Tally(), Tally(), time.monotonic() + WARM_UP_S
    await asyncio.gather(*[rlgate_agent(url, admin, i, args, warm, deadline) for i in range(WARM_UP_AGENTS)])
    baseline, peak = resident_bytes(RLGATE_FRONT), {"open": 0, "rss": 0}
    deadline = time.monotonic() + args.seconds

    async def sample() -> None:
        async with httpx.AsyncClient(timeout=30) as http:

            async def open_now() -> int:
                status = await http.get(f"{url}/rl/status", headers={"Authorization": f"Bearer {admin}"})
                return status.json()["sessions"]["open_sessions"]

            await peak_resident(RLGATE_FRONT, deadline, peak, open_now)

    started, cpu_before, client_before = time.monotonic(), cpu_seconds(), own_seconds()
    # through Serve's proxy every agent uses one URL; on the direct ports of colocated replicas agent i
    # takes replica i mod N's own (a session's requests must reach its replica, which the proxy would route)
    urls = [url]
    if args.direct and args.replicas > 1:
        host, port = url.rsplit(":", 1)
        urls = [f"{host}:{int(port) + n}" for n in range(args.replicas)]
    agents = [rlgate_agent(urls[i % len(urls)], admin, i, args, tally, deadline) for i in range(args.sessions)]
    await asyncio.gather(sample(), *agents)
    result = tally.summary(time.monotonic() - started, spent(cpu_before, cpu_seconds()), own_seconds() - client_before)
    result["peak_open_sessions"] = peak["open"]
    result["rss_per_open_session_kib"] = (peak["rss"] - baseline) / max(1, peak["open"]) / 1024
    async with httpx.AsyncClient(timeout=600) as http:
        lines = (
            await http.get(
                f"{url}/rl/trajectories", params={"limit": 100_000}, headers={"Authorization": f"Bearer {admin}"}
            )
        ).text.splitlines()
    saved = collections.Counter(json.loads(line)["session_id"] for line in lines)
    # a session saves a record per answered turn ("individual" export); one with none saves nothing
    expected = {session: turns for session, turns in (warm.ended | tally.ended).items() if turns}
    result["sessions_ended"] = len(tally.ended)
    result["sessions_saved"] = len(saved)
    result["saved_exactly_once"] = dict(saved) == expected
    return result


def bench_rlgate(args) -> dict:
    server = rlgate_server(
        "load", args.model, args.sessions, args.colocate, args.direct, access_log=False, replicas=args.replicas
    )
    with server as (url, admin):
        return asyncio.run(run_rlgate(url, admin, args))


def bench_peer(args) -> dict:
    with vllm_server(prepare_model(args.model)) as url:

        async def warm_up():  # as the rlgate side does, before its memory baseline
            deadline = time.monotonic() + WARM_UP_S
            await asyncio.gather(*[peer_agent(url, i, args, Tally(), deadline) for i in range(WARM_UP_AGENTS)])

        asyncio.run(warm_up())
        tally, baseline, peak = Tally(), resident_bytes(PEER_FRONT), {"rss": 0}
        deadline = time.monotonic() + args.seconds
        started, cpu_before, client_before = time.monotonic(), cpu_seconds(), own_seconds()

        async def agents():
            agents = [peer_agent(url, i, args, tally, deadline) for i in range(args.sessions)]
            await asyncio.gather(peak_resident(PEER_FRONT, deadline, peak), *agents)

        asyncio.run(agents())
        result = tally.summary(
            time.monotonic() - started, spent(cpu_before, cpu_seconds()), own_seconds() - client_before
        )
        # the same load with no sessions: what serving this many agents at once costs a front end
        result["rss_per_agent_kib"] = (peak["rss"] - baseline) / args.sessions / 1024
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--sessions", type=int, default=256, help="concurrent agents")
    parser.add_argument("--turns", type=int, default=4, help="chat completions per session")
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--colocate", action="store_true", help="[gateway] colocate: the engine and sessions in the gateway replica"
    )
    parser.add_argument(
        "--direct", action="store_true", help="[gateway] direct_port: agents call the replica, not Serve's proxy"
    )
    parser.add_argument("--replicas", type=int, default=1, help="engine replicas (colocated: gateway replicas too)")
    parser.add_argument(
        "--peer-logprobs",
        action="store_true",
        help="vLLM's agents ask for logprobs, as an RL client of vllm serve must (rlgate records them anyway)",
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="measure both sides this many times, in alternating order"
    )
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table

    # The machine's speed drifts over minutes: each round measures both sides, in alternating order,
    # and the ratios are taken within a round, then averaged.
    rounds = []
    for n in range(args.rounds):
        if n % 2 == 0:
            peer = bench_peer(args)
            ours = bench_rlgate(args)
        else:
            ours = bench_rlgate(args)
            peer = bench_peer(args)
        rounds.append({"vllm": peer, "rlgate": ours})
    table = Table(
        title=f"{args.sessions} agents x {args.turns} turns, {args.seconds:g} s, {args.model}, "
        f"max_tokens={args.max_tokens}, {os.cpu_count()} CPUs"
    )
    columns = (
        "round",
        "server",
        "sessions/s",
        "turns/s",
        "chat p50 s",
        "chat p99 s",
        "errors",
        "CPU ms/turn",
        "agents' CPU ms/turn",
        "rlgate / vLLM",
    )
    for column in columns:
        table.add_column(column, justify="right")
    for n, measured in enumerate(rounds, 1):
        peer, ours = measured["vllm"], measured["rlgate"]
        measured["turns_ratio"] = ours["turns_per_s"] / peer["turns_per_s"]
        measured["cpu_ratio"] = ours["cpu_ms_per_turn"]["total"] / peer["cpu_ms_per_turn"]["total"]
        for name, result in (("vllm serve (peer)", peer), ("rlgate gateway", ours)):
            chat = result["latency_s"].get("chat", {"p50": float("nan"), "p99": float("nan")})
            table.add_row(
                str(n),
                name,
                f"{result['sessions_per_s']:.2f}" if name.startswith("rlgate") else "-",
                f"{result['turns_per_s']:.1f}",
                f"{chat['p50']:.2f}",
                f"{chat['p99']:.2f}",
                str(result["errors"]),
                f"{result['cpu_ms_per_turn']['total']:.1f}",
                f"{result['client_cpu_ms_per_turn']:.1f}",
                f"{measured['turns_ratio']:.2f}x turns/s, {measured['cpu_ratio']:.2f}x CPU/turn"
                if name.startswith("rlgate")
                else "",
            )
    console = Console(width=150)
    console.print(table)
    mean = {key: statistics.mean(r[key] for r in rounds) for key in ("turns_ratio", "cpu_ratio")}
    if len(rounds) > 1:
        console.print(
            f"mean of {len(rounds)} rounds: rlgate {mean['turns_ratio']:.2f}x vLLM's turns/s, "
            f"{mean['cpu_ratio']:.2f}x its CPU per turn"
        )
    for n, measured in enumerate(rounds, 1):
        peer, ours = measured["vllm"], measured["rlgate"]
        console.print(
            f"round {n}: rlgate: {ours['peak_open_sessions']} sessions open at most, "
            f"{ours['rss_per_open_session_kib']:.0f} KiB resident per open session (Gateway + SessionStore; "
            f"vLLM's API server under the same agents: {peer['rss_per_agent_kib']:.0f} KiB per agent); "
            f"{ours['sessions_ended']} sessions ended, {ours['sessions_saved']} saved, "
            f"each exactly once with all its turns: {ours['saved_exactly_once']}"
        )
        console.print(f"  answers: rlgate {ours['statuses']}; vLLM {peer['statuses']}")
        for name, result in (("vLLM", peer), ("rlgate", ours)):
            parts = ", ".join(f"{label} {ms}" for label, ms in result["cpu_ms_per_turn"].items() if label != "total")
            console.print(f"  CPU ms per turn, {name}: {parts}")
    if args.json:
        args.json.write_text(json.dumps({"rounds": rounds, "mean": mean}, indent=2))
    if any(not r["rlgate"]["saved_exactly_once"] or r["rlgate"]["errors"] for r in rounds):
        sys.exit(1)


if __name__ == "__main__":
    main()
