"""Idle-session benchmark: how much memory an open session costs, and that one
gateway replica holds many of them.

    python bench/idle.py [--sessions 10000] [--turns 1] [--colocate] [--model tiny-random]

Opens ``--sessions`` sessions (admin key) and gives each ``--turns`` chat
completions (the official openai client, 64 at a time), then leaves them all
open and idle. Reports the growth in resident memory of the processes that
hold sessions (the Gateway replica, and the SessionStore unless colocated)
from before the first session to when all are open, per session; then ends
every session and checks that each was saved exactly once with all its turns.
Exits 1 on any error.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import json
import os
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
from gateway import QUESTIONS, rlgate_server  # noqa: E402
from load import rss_of  # noqa: E402

MARKERS = ("ServeReplica:idle:Gateway", "ray::SessionStore")


async def open_sessions(url: str, admin: str, args, errors: collections.Counter) -> list[dict]:
    opened: list[dict] = []
    gate = asyncio.Semaphore(64)
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=60), limits=limits) as http:

        async def one(index: int) -> None:
            async with gate:
                started = await http.post(
                    f"{url}/rl/start_session",
                    json={"task_id": f"idle{index}"},
                    headers={"Authorization": f"Bearer {admin}"},
                )
                if started.status_code != 200:
                    errors[f"start {started.status_code}"] += 1
                    return
                body = started.json()
                client = openai.AsyncOpenAI(
                    base_url=f"{url}/v1", api_key=body["api_key"], max_retries=0, http_client=http
                )
                messages = [{"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]}]
                for _ in range(args.turns):
                    try:
                        reply = await client.chat.completions.create(
                            model=args.model, messages=messages, max_tokens=args.max_tokens
                        )
                    except openai.APIError as err:
                        errors[f"chat {err.__class__.__name__}"] += 1
                        return
                    messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""}]
                    messages += [{"role": "user", "content": "And then?"}]
                opened.append(body)

        await asyncio.gather(*[one(i) for i in range(args.sessions)])
    return opened


async def end_sessions(url: str, opened: list[dict], errors: collections.Counter) -> None:
    gate = asyncio.Semaphore(64)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as http:

        async def one(body: dict) -> None:
            async with gate:
                ended = await http.post(f"{url}/rl/end_session", headers={"Authorization": f"Bearer {body['api_key']}"})
                if ended.status_code != 200:
                    errors[f"end {ended.status_code}"] += 1

        await asyncio.gather(*[one(body) for body in opened])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--turns", type=int, default=1, help="chat completions per session before it idles")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--colocate", action="store_true", help="[gateway] colocate: sessions in the gateway replica")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    errors: collections.Counter = collections.Counter()
    server = rlgate_server("idle", args.model, args.sessions, args.colocate, direct=True, access_log=False)
    with server as (url, admin):
        gc.collect()
        before = rss_of(MARKERS)
        started = time.monotonic()
        opened = asyncio.run(open_sessions(url, admin, args, errors))
        seconds = time.monotonic() - started
        time.sleep(2)
        after = rss_of(MARKERS)
        status = httpx.get(f"{url}/rl/status", headers={"Authorization": f"Bearer {admin}"}, timeout=60).json()
        open_now = status["sessions"]["open_sessions"]
        asyncio.run(end_sessions(url, opened, errors))
        records, since = [], 0
        while page := httpx.get(
            f"{url}/rl/trajectories",
            params={"since": since, "limit": 100_000},
            headers={"Authorization": f"Bearer {admin}"},
            timeout=600,
        ).text.splitlines():
            records += [json.loads(line) for line in page]
            since = records[-1]["seq"]
    saved = collections.Counter(record["session_id"] for record in records)
    result = {
        "sessions_opened": len(opened),
        "open_at_peak": open_now,
        "seconds_to_open": round(seconds, 1),
        "rss_before_mib": round(before / 2**20, 1),
        "rss_after_mib": round(after / 2**20, 1),
        "kib_per_open_session": round((after - before) / max(1, open_now) / 1024, 1),
        "saved_exactly_once": dict(saved) == {body["session_id"]: args.turns for body in opened},
        "errors": dict(errors),
    }
    shape = "colocated" if args.colocate else "split"
    print(f"{args.sessions} sessions x {args.turns} turn(s), {args.model}, {shape}: {json.dumps(result)}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if errors or not result["saved_exactly_once"] or open_now != args.sessions:
        sys.exit(1)


if __name__ == "__main__":
    main()
