"""``rlgate export RUN OUT [--step N]``: a run's checkpoint as a Hugging Face model
folder with a model card, ready for ``from_pretrained``, vLLM, or the Hub.

The checkpoints a run keeps (``trainer/step-<step>/``, :mod:`rlgate.run`) hold
the model, the optimizer and where to resume; an export copies the model (and
its tokenizer) and writes ``README.md``: what it was trained from, with what,
and the step's metrics from ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path

from rlgate.run import checkpoint_states, checkpoints_dir


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


def model_card(run: Path, step: int, state: dict) -> str:
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
    if (run / "metrics.jsonl").is_file():
        lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        metrics = next((m for m in reversed(lines) if m.get("step") == step), {})
    algorithm, training = config.get("algorithm", {}), config.get("training", {})
    header = ["---", "library_name: transformers", "tags:", "- rlgate", "- reinforcement-learning"]
    if "/" in base:  # a Hub id, not a built-in name or a local folder
        header += [f"base_model: {base}"]
    shown = ("reward_mean", "samples", "staleness", "train_loss", "train_grad_norm", "train_logprob_mismatch_max")
    rows = [f"| {name} | {metrics[name]:.4g} |" for name in shown if isinstance(metrics.get(name), int | float)]
    body = [
        "---",
        "",
        f"# {run.name}, step {step}",
        "",
        f"Trained with rlgate from `{base}` by reinforcement learning",
        f"from live sessions: {algorithm.get('variety', 'grpo')} with the {loss} loss, "
        f"{training.get('batch_size', '?')} episodes per step",
        f"in groups of {training.get('group_size', '?')}, learning rate {training.get('learning_rate', '?')};",
        f"policy version {state['version']}.",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        'model = AutoModelForCausalLM.from_pretrained("<this folder or repo>")',
        "```",
    ]
    if rows:
        body += ["", f"## Metrics at step {step}", "", "| metric | value |", "|---|---|", *rows]
    return "\n".join(header + body) + "\n"


def export_model(run: str | Path, out: str | Path, step: int | None = None) -> tuple[Path, int]:
    """Copy the checkpoint's model folder to ``out`` (new or empty) and write its model card."""
    run, out = Path(run), Path(out)
    folder, chosen, state = checkpoint_at(run, step)
    if not (folder / "model").is_dir():
        raise ValueError(f"{folder} holds no model/ (an unfinished checkpoint?); choose another --step")
    if out.is_file() or (out.exists() and any(out.iterdir())):
        raise ValueError(f"{out} is not an empty folder; export into a new one")
    shutil.copytree(folder / "model", out, dirs_exist_ok=True)
    (out / "README.md").write_text(model_card(run, chosen, state))
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
