"""Chaos: agents drive a training run while rlgate's processes are killed.

    python bench/chaos.py [--seconds 240] [--kill-every 8] [--agents 16] [--json out.json]

Starts ``train_driver.py`` in online mode (tiny-random, a fresh run folder),
runs ``--agents`` virtual agents against its gateway (start a session, two
chat turns, a reward, the end; a refused or failed call is counted and the
agent goes on), and every ``--kill-every`` seconds SIGKILLs one rlgate
process, each kind once per round in a random order: the SessionStore, the
TrajectoryStore, the CapacityActor, the PolicyStore, the Gateway or
RolloutServer replica, or a Ray Train worker.
Then the load stops, the driver is interrupted (Ctrl-C: it writes its curve
and exits), and the run folder is checked:

* every session whose end answered 200 is saved exactly once, with a record
  per answered turn;
* no saved record is in two training batches (no token trained twice);
* the run kept training: steps in order, and steps taken after the first kill.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support import free_port  # noqa: E402

ADMIN = "chaos-bench-admin-key-0123456789"
TARGETS = {  # what to kill: a process title Ray gives it
    "SessionStore": "ray::SessionStore",
    "TrajectoryStore": "ray::TrajectoryStore",
    "CapacityActor": "ray::CapacityActor",
    "PolicyStore": "ray::PolicyStore",
    "Gateway replica": "ray::ServeReplica:rlgate:Gateway",
    "RolloutServer replica": "ray::ServeReplica:rlgate:RolloutServer",
    "trainer worker": "ray::RayTrainWorker",
}


def config(run_dir: Path, port: int) -> str:
    return f"""
[model]
name = "tiny-random"
[rollout]
max_model_len = 512
kv_cache_gib = 0.5
[gateway]
run_name = "chaos"
run_dir = "{run_dir}"
port = {port}
session_timeout_s = 60
[training]
batch_size = 8
group_size = 2
group_timeout_s = 30
learning_rate = 1e-3
max_staleness = 1
total_steps = 100000
save_every = 5
max_failures = -1
"""


def processes(title: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        line = " ".join(process.info["cmdline"] or [])
        if line.startswith(title):
            found.append(process)
    return found


class Tally:
    def __init__(self) -> None:
        self.statuses: collections.Counter = collections.Counter()
        self.ended: dict[str, int] = {}  # session id -> turns answered, for ends that answered 200

    def note(self, call: str, status) -> None:
        self.statuses[f"{call} {status}"] += 1


async def agent(url: str, index: int, tally: Tally, deadline: float) -> None:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    round_ = 0
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=30)) as http:
        while time.monotonic() < deadline:
            task = f"chaos{index // 2}-{round_}"  # agents 2k and 2k+1 make one group of two
            round_ += 1
            try:
                started = await http.post(
                    f"{url}/rl/start_session", json={"task_id": task, "wait_s": 20}, headers=admin
                )
            except httpx.HTTPError as err:
                tally.note("start", err.__class__.__name__)
                await asyncio.sleep(1)
                continue
            tally.note("start", started.status_code)
            if started.status_code != 200:
                await asyncio.sleep(1)
                continue
            body = started.json()
            headers = {"Authorization": f"Bearer {body['api_key']}"}
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=body["api_key"], max_retries=0, http_client=http)
            messages, answered = [{"role": "user", "content": f"Tell me about {task}."}], 0
            for _ in range(2):
                try:
                    reply = await client.chat.completions.create(model="default", messages=messages, max_tokens=8)
                except openai.APIStatusError as err:
                    tally.note("chat", err.status_code)
                    break
                except openai.APIConnectionError as err:
                    tally.note("chat", err.__class__.__name__)
                    break
                tally.note("chat", 200)
                answered += 1
                messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""}]
                messages += [{"role": "user", "content": "And then?"}]
            for call, path, extra in (
                ("reward", "set_reward", {"json": {"reward": float(answered)}}),
                ("end", "end_session", {}),
            ):
                for _attempt in range(30):  # a 503 (a store restarting) is retried, as the API says
                    try:
                        answer = await http.post(f"{url}/rl/{path}", headers=headers, **extra)
                    except httpx.HTTPError as err:
                        tally.note(call, err.__class__.__name__)
                        await asyncio.sleep(1)
                        continue
                    tally.note(call, answer.status_code)
                    if answer.status_code != 503:
                        break
                    await asyncio.sleep(1)
                if call == "end" and answer.status_code == 200:
                    tally.ended[body["session_id"]] = answered


async def killer(started: float, deadline: float, every_s: float, kills: list, rng: random.Random, run: Path) -> None:
    await asyncio.sleep(every_s * 2)  # the first sessions run undisturbed
    round_: list[str] = []
    while time.monotonic() < deadline - every_s:
        if not round_:  # every kind once per round, in a random order
            round_ = rng.sample(sorted(TARGETS), len(TARGETS))
        name = round_.pop()
        found = processes(TARGETS[name])
        if found:
            victim = rng.choice(found)
            try:
                victim.send_signal(signal.SIGKILL)
                steps = len(lines(run / "metrics.jsonl"))
                kills.append({"at_s": round(time.monotonic() - started, 1), "what": name, "steps_before": steps})
            except psutil.NoSuchProcess:
                pass
        await asyncio.sleep(every_s)


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=240.0)
    parser.add_argument("--kill-every", type=float, default=8.0)
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the summary here")
    args = parser.parse_args()

    folder, port = Path(tempfile.mkdtemp(prefix="rlgate-chaos-")), free_port()
    (folder / "chaos.toml").write_text(config(folder / "runs", port))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {
        "RLGATE_ADMIN_KEY": ADMIN,
        "RAY_AUTH_MODE": "disabled",
        "HF_HUB_OFFLINE": "1",
    }
    log = open(folder / "driver.log", "w")
    driver = subprocess.Popen(
        [sys.executable, "train_driver.py", "--config", str(folder / "chaos.toml")],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url, run = f"http://127.0.0.1:{port}", folder / "runs" / "chaos"
    kills: list[dict] = []
    tally = Tally()
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if driver.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the driver did not come up; see {folder / 'driver.log'}")
            time.sleep(1)
        started = time.monotonic()
        deadline = started + args.seconds

        async def load() -> None:
            agents = [agent(url, i, tally, deadline) for i in range(args.agents)]
            rng = random.Random(args.seed)
            await asyncio.gather(killer(started, deadline, args.kill_every, kills, rng, run), *agents)

        asyncio.run(load())
    finally:
        if driver.poll() is None:
            driver.send_signal(signal.SIGINT)  # Ctrl-C: the curve is written, the driver exits
            try:
                driver.wait(timeout=180)
            except subprocess.TimeoutExpired:
                driver.kill()
                driver.wait()
        log.close()

    records = [r for f in sorted((run / "trajectories").glob("part-*.jsonl")) for r in lines(f)]
    saved = collections.Counter(r["session_id"] for r in records)
    acknowledged_wrong = {
        s: (turns, saved.get(s, 0)) for s, turns in tally.ended.items() if turns and saved.get(s, 0) != turns
    }
    twice = [
        k
        for k, n in collections.Counter((r["session_id"], tuple(r["interaction_ids"])) for r in records).items()
        if n > 1
    ]
    batches = lines(run / "batches.jsonl")
    trained = collections.Counter(seq for b in batches for seq in b["seqs"])
    metrics = lines(run / "metrics.jsonl")
    steps = [m["step"] for m in metrics]
    summary = {
        "seconds": args.seconds,
        "agents": args.agents,
        "kills": dict(collections.Counter(k["what"] for k in kills)),
        "kills_total": len(kills),
        "sessions_acknowledged": len(tally.ended),
        "acknowledged_not_saved_exactly_once": len(acknowledged_wrong),
        "records_saved_twice": len(twice),
        "records_trained_twice": sum(n > 1 for n in trained.values()),
        "steps": len(steps),
        "steps_in_order": steps == list(range(1, len(steps) + 1)),
        "steps_after_first_kill": len(steps) - (kills[0]["steps_before"] if kills else len(steps)),
        "driver_exit": driver.returncode,
        "statuses": dict(sorted(tally.statuses.items())),
        "run_folder": str(folder),
    }
    print(json.dumps(summary, indent=2, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2, default=str))


if __name__ == "__main__":
    main()
