"""``rlgate chat``: one recorded episode, end to end, without training.

Starts local Ray with the gateway and a rollout engine, opens a session with
the admin key, holds a short scripted chat through the official ``openai``
client (streamed token by token), sets a reward, ends the session, and shows
the trajectory that was saved: exactly the tokens the model saw and sampled.
"""

from __future__ import annotations

import secrets
import socket

CHAT_APP = "rlgate-chat"
SCRIPT = [
    "Hi! In one sentence, what is reinforcement learning?",
    "Give me one everyday example of it.",
    "Thanks. Summarise our chat in five words.",
]


def _free_port(preferred: int) -> int:
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", preferred)) != 0:
            return preferred
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_chat(config_path: str, max_tokens: int = 64) -> int:
    import httpx
    import openai
    import ray
    from ray import serve
    from rich.console import Console, Group
    from rich.live import Live
    from rich.panel import Panel
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table
    from rich.text import Text

    from rlgate.config import load_config
    from rlgate.serving.app import build_app, claim_run, end_served, refuse_served, resolve_model
    from rlgate.serving.routing import serve_start_options
    from rlgate.sessions.manager import hash_key

    console = Console()
    config = load_config(config_path)
    with console.status(f"Preparing model {config.model.name} (built once, then cached)"):
        resolve_model(config)
    from ray.serve.context import _get_global_client

    admin = {"Authorization": f"Bearer {secrets.token_urlsafe(32)}"}  # 256 bits, as every key rlgate makes
    with console.status(f"Starting Ray, a {config.rollout.engine} rollout engine and the gateway (about 30 s on CPU)"):
        ray.init(include_dashboard=False, log_to_driver=False)  # joins a cluster `ray start` left running here
        running = _get_global_client(raise_if_no_controller_running=False)
        refuse_served(CHAT_APP)  # another chat
        claim = claim_run(config.gateway.run_name)  # a run in use under this name refuses it; held while it chats
        if running is None:  # our own Serve, at the root of a free port; shut down at the end
            port, prefix = _free_port(config.gateway.port), "/"
            serve.start(
                http_options={"host": "127.0.0.1", "port": port},
                logging_config={"enable_access_log": False},
                **serve_start_options(),
            )
        else:  # a Serve with its own apps: beside them, under a prefix of our own, and they are left alone
            port, prefix = running.http_config.port, f"/{CHAT_APP}"
        admin_hash = hash_key(admin["Authorization"].split()[1])
        serve.run(build_app(config, admin_hash), name=CHAT_APP, route_prefix=prefix)
    url = f"http://127.0.0.1:{port}{prefix.rstrip('/')}"
    try:
        health = httpx.get(f"{url}/health").json()
        console.print(f"[green]gateway ready[/] at {url}: {health}")
        session = httpx.post(f"{url}/rl/start_session", json={"task_id": "demo"}, headers=admin).json()
        console.print(f"session [bold]{session['session_id']}[/] started (the agent gets its own API key)")
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=session["api_key"])
        messages = [{"role": "system", "content": "You are a concise, friendly assistant."}]
        for turn, question in enumerate(SCRIPT, start=1):
            messages.append({"role": "user", "content": question})
            console.print(f"\n[bold cyan]user[/]: {question}")
            progress = Progress(
                TextColumn("[magenta]tokens"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
            )
            task = progress.add_task("generate", total=max_tokens)
            reply = ""
            with Live(console=console, refresh_per_second=12) as live:
                stream = client.chat.completions.create(
                    model="default",
                    messages=messages,
                    max_tokens=max_tokens,
                    temperature=0.7,
                    top_p=0.95,
                    seed=turn,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                for chunk in stream:
                    if chunk.usage is not None:
                        progress.update(task, completed=chunk.usage.completion_tokens)
                    elif chunk.choices and chunk.choices[0].delta.content:
                        reply += chunk.choices[0].delta.content
                        progress.advance(task)
                    live.update(
                        Group(Panel(Text(reply), title=f"assistant, turn {turn}", border_style="green"), progress)
                    )
            messages.append({"role": "assistant", "content": reply})
        key = {"Authorization": f"Bearer {session['api_key']}"}
        httpx.post(f"{url}/rl/set_reward", json={"reward": 1.0}, headers=key)
        ended = httpx.post(f"{url}/rl/end_session", headers=key).json()
        console.print(f"\nreward 1.0 set; {ended['message']} ({ended['interaction_count']} completions)")
        _show_trajectory(console, Table, httpx.get(f"{url}/rl/trajectories", headers=admin).text, session, config)
    finally:
        end_served(config, running is None, CHAT_APP)  # another Serve's applications are left alone (and the claim)
        del claim
        ray.shutdown()
    return 0


def _show_trajectory(console, Table, lines: str, session: dict, config) -> None:
    import json

    records = [json.loads(line) for line in lines.splitlines()]
    records = [r for r in records if r["session_id"] == session["session_id"]]
    table = Table(title=f"saved trajectory ({config.gateway.export_style} style)")
    for column in ("sample", "completions", "tokens", "sampled by the model", "reward", "policy versions"):
        table.add_column(column, justify="right")
    for record in records:
        versions = sorted({v for v in record["versions"] if v >= 0})
        table.add_row(
            str(record["seq"]),
            str(len(record["interaction_ids"])),
            str(len(record["input_ids"])),
            str(sum(record["loss_mask"])),
            f"{record['reward']:.2f}",
            ", ".join(map(str, versions)),
        )
    console.print(table)
    folder = f"{config.gateway.run_dir}/{config.gateway.run_name}/trajectories"
    console.print(f"Files: {folder}/part-*.jsonl (one JSON record per line; pandas.read_json(path, lines=True))")
