"""``rlgate export RUN OUT [--step N]``: a run's checkpoint as a Hugging Face model
folder with a model card, ready for ``from_pretrained``, vLLM, or the Hub.

The checkpoints a run keeps (``trainer/step-<step>/``, :mod:`rlgate.run`) hold
the model, the optimizer and where to resume; an export copies the model (and
its tokenizer) and writes ``README.md``: what it was trained from, with what,
and the step's metrics from ``metrics.jsonl``. A LoRA run's export is its
adapter (PEFT format, loaded over the base model), or with ``--merged`` the
merged model its checkpoints keep with ``[training.lora] save_merged``.
"""

from __future__ import annotations

import json
import os
import shutil
import tomllib
from pathlib import Path

from rlgate.logfile import json_lines
from rlgate.run import ADAPTER, MERGED, MODEL, checkpoint_states, checkpoints_dir


def checkpoint_at(run: str | Path, step: int | None = None) -> tuple[Path, int, dict]:
    """The checkpoint folder of ``step`` (default: the latest), its step and its trainer state."""
    if not Path(run).is_dir():
        raise ValueError(f"no run folder {run}")
    states = checkpoint_states(checkpoints_dir(run))
    if not states:
        raise ValueError(f"{run} has no checkpoints (trainer/step-*/); set [training] save_every")
    by_step = {(state.get("driver") or {}).get("step", state["version"]): (f, state) for f, state in states.items()}
    chosen = max(by_step) if step is None else step
    if chosen not in by_step:
        raise ValueError(f"{run} has no checkpoint at step {step}; it has steps {', '.join(map(str, sorted(by_step)))}")
    folder, state = by_step[chosen]
    return folder, chosen, state


def model_card(run: Path, step: int, state: dict, adapter: bool = False) -> str:
    """README.md for the exported folder: the Hub's metadata header, then the run's story."""
    config = tomllib.loads((run / "config.toml").read_text()) if (run / "config.toml").is_file() else {}
    base = config.get("model", {}).get("name", "unknown")
    loss = "ppo_clip"
    if config:
        from rlgate.config import parse_config

        try:
            settings = parse_config(config)
            loss = settings.algorithm.resolved(settings.training.max_staleness).loss
        except ValueError:  # a config an older rlgate wrote: the card says less
            loss = config.get("algorithm", {}).get("loss") or loss
    metrics = {}
    if (run / "metrics.jsonl").is_file():  # a run still writing it may have a torn last line
        with open(run / "metrics.jsonl", encoding="utf-8", errors="replace") as log:
            lines = [entry for _, entry in json_lines(log, bad=lambda line: None)]
        metrics = next((m for m in reversed(lines) if m.get("step") == step), {})
    algorithm, training = config.get("algorithm", {}), config.get("training", {})
    library = "peft" if adapter else "transformers"
    header = ["---", f"library_name: {library}", "tags:", "- rlgate", "- reinforcement-learning"]
    if "/" in base:  # a Hub id, not a built-in name or a local folder
        header += [f"base_model: {base}"]
    shown = ("reward_mean", "samples", "staleness", "train_loss", "train_grad_norm", "train_logprob_mismatch_max")
    rows = [f"| {name} | {metrics[name]:.4g} |" for name in shown if isinstance(metrics.get(name), int | float)]
    what = f"Trained with rlgate from `{base}`"
    load = ['model = AutoModelForCausalLM.from_pretrained("<this folder or repo>")']
    if adapter:
        what = f"A LoRA adapter (rank {state.get('lora_rank', '?')}) over `{base}`, trained with rlgate"
        load = [
            "from peft import PeftModel",
            "",
            f'base = AutoModelForCausalLM.from_pretrained("{base}")',
            'model = PeftModel.from_pretrained(base, "<this folder or repo>")',
        ]
    body = [
        "---",
        "",
        f"# {run.name}, step {step}",
        "",
        f"{what} by reinforcement learning",
        f"from live sessions: {algorithm.get('variety', 'grpo')} with the {loss} loss, "
        f"{training.get('batch_size', '?')} episodes per step",
        f"in groups of {training.get('group_size', '?')}, learning rate {training.get('learning_rate', '?')};",
        f"policy version {state['version']}.",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        *load,
        "```",
    ]
    if rows:
        body += ["", f"## Metrics at step {step}", "", "| metric | value |", "|---|---|", *rows]
    return "\n".join(header + body) + "\n"


def export_model(run: str | Path, out: str | Path, step: int | None = None, merged: bool = False) -> tuple[Path, int]:
    """Copy the checkpoint's model folder (a LoRA run's adapter, or with ``merged`` its
    merged model) to ``out`` (new or empty) and write its model card."""
    run, out = Path(run), Path(out)
    folder, chosen, state = checkpoint_at(run, step)
    adapter = (folder / ADAPTER).is_dir() and not merged
    source = folder / (ADAPTER if adapter else MERGED if merged else MODEL)
    if not source.is_dir():
        if merged:
            raise ValueError(f"{folder} holds no merged/ model: set [training.lora] save_merged = true to keep one")
        raise ValueError(f"{folder} holds no {MODEL}/ (an unfinished checkpoint?); choose another --step")
    if out.is_file() or (out.exists() and any(out.iterdir())):
        raise ValueError(f"{out} is not an empty folder; export into a new one")
    # Written beside it and renamed into place: an export that fails leaves no half folder a retry refuses.
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        shutil.copytree(source, partial)
        if adapter:
            state = {**state, "lora_rank": json.loads((source / "adapter_config.json").read_text()).get("r")}
        (partial / "README.md").write_text(model_card(run, chosen, state, adapter))
        os.replace(partial, out)  # over an empty folder too
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out, chosen


def push_to_hub(folder: Path, repo_id: str, public: bool = False) -> str:
    """Upload an exported folder to the Hugging Face Hub (a model repo, made private
    unless ``public``: a model trained on private data stays private by default)."""
    from huggingface_hub import HfApi

    api = HfApi()
    try:
        api.create_repo(repo_id, repo_type="model", private=not public, exist_ok=True)
        api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model")
    except Exception as err:  # offline, no token, no rights: huggingface_hub says which
        raise ValueError(f"could not push to the Hub as {repo_id}: {err.__class__.__name__}: {err}") from None
    return f"https://huggingface.co/{repo_id}"
