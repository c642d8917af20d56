"""``make demo`` (for now): serve the model on Ray and hold a short scripted chat.

Starts local Ray, deploys the RolloutServer through ``serve_app.build_app``,
renders each turn with the model's chat template (token-in), streams the
engine's token ids back (token-out) and shows them as they arrive.
"""

from __future__ import annotations

import time

SCRIPT = [
    "Hi! In one sentence, what is reinforcement learning?",
    "Give me one everyday example of it.",
    "Thanks. Summarise our chat in five words.",
]


def run_demo(config_path: str, max_tokens: int = 64) -> int:
    import ray
    from ray import serve
    from rich.console import Console, Group
    from rich.live import Live
    from rich.panel import Panel
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table
    from rich.text import Text
    from transformers import AutoTokenizer

    from rlgate.config import load_config
    from rlgate.engines import SamplingParams
    from serve_app import build_rollout_app, resolve_model

    console = Console()
    config = load_config(config_path)
    with console.status(f"Preparing model {config.model.name} (built once, then cached)"):
        model_path = resolve_model(config)
    with console.status(f"Starting Ray and a {config.rollout.engine} rollout engine (about 30 s on CPU)"):
        ray.init(include_dashboard=False, log_to_driver=False)
        handle = serve.run(build_rollout_app(config), name="rlgate-demo", route_prefix=None)
        health = handle.health.remote().result()
    console.print(f"[green]engine ready[/]: {health['engine']} on {health['model']}, policy version {health['version']}")

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    messages = [{"role": "system", "content": "You are a concise, friendly assistant."}]
    summary = Table(title="scripted chat", show_lines=False)
    for column in ("turn", "prompt tokens", "completion tokens", "tokens/s", "mean logprob", "finish"):
        summary.add_column(column, justify="right")
    try:
        for turn, question in enumerate(SCRIPT, start=1):
            messages.append({"role": "user", "content": question})
            prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
            console.print(f"\n[bold cyan]user[/]: {question}")
            progress = Progress(
                TextColumn("[magenta]tokens"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
            )
            task = progress.add_task("generate", total=max_tokens)
            params = SamplingParams(max_tokens=max_tokens, temperature=0.7, top_p=0.95, seed=turn).model_dump()
            ids, logprobs, finish = [], [], None
            started = time.perf_counter()
            with Live(console=console, refresh_per_second=12) as live:
                for chunk in handle.options(stream=True).generate.remote(prompt_ids, params):
                    ids += chunk.token_ids
                    logprobs += chunk.logprobs
                    finish = chunk.finish_reason or finish
                    progress.update(task, completed=len(ids))
                    text = Text(tokenizer.decode(ids, skip_special_tokens=True))
                    live.update(Group(Panel(text, title="assistant", border_style="green"), progress))
            seconds = time.perf_counter() - started
            reply = tokenizer.decode(ids, skip_special_tokens=True)
            messages.append({"role": "assistant", "content": reply})
            summary.add_row(
                str(turn),
                str(len(prompt_ids)),
                str(len(ids)),
                f"{len(ids) / seconds:.1f}",
                f"{sum(logprobs) / max(len(logprobs), 1):.3f}",
                finish or "-",
            )
        console.print(summary)
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
