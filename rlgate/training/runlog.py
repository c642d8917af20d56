"""What a training run shows and keeps: a live progress bar, ``metrics.jsonl``,
``batches.jsonl`` (which trajectories each step used), Ray dashboard metrics
(``ray.util.metrics``, declared in :mod:`rlgate.telemetry`), a reward-curve PNG,
and the trackers ``[logging]`` asks for (:mod:`rlgate.training.tracking`)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from rlgate.telemetry import TRAIN_GAUGES, Metrics
from rlgate.training.tracking import Tracking

SHOWN = ("reward_mean", "samples", "dropped", "staleness", "tokens_per_s", "step_s")


class RunLog:
    def __init__(
        self, folder: Path, total_steps: int, first_step: int = 0, show: bool = True, tracking: Tracking | None = None
    ) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / "metrics.jsonl"
        self.progress = Progress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[summary]}"),
            disable=not show,
        )
        self.task = self.progress.add_task("train", total=total_steps, completed=first_step, summary="waiting")
        self.progress.start()
        self.metrics = Metrics(folder.name)
        self.tracking = tracking or Tracking([], None, 0)

    def log(self, step: int, metrics: dict, records: list[dict] = ()) -> None:
        """A step's line in metrics.jsonl, the progress bar, the dashboard, and
        the trackers (with a few of ``records``, the step's trajectories, as samples)."""
        record = {"step": step, "time": time.time(), **metrics}
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        summary = "  ".join(f"{k}={metrics[k]:.3g}" for k in SHOWN if k in metrics)
        self.progress.update(self.task, completed=step, summary=summary)
        for name in TRAIN_GAUGES:
            value = metrics.get(name, metrics.get(f"train_{name}"))
            if value is not None:
                self.metrics.set(f"rlgate_train_{name}", float(value))
        self.tracking.log(step, metrics, list(records))

    def batch(self, step: int, seqs: list[int]) -> None:
        """Which saved trajectories (by ``seq``) a step trained on: the audit trail."""
        with open(self.folder / "batches.jsonl", "a") as handle:
            handle.write(json.dumps({"step": step, "seqs": seqs}) + "\n")

    def complete(self, step: int, line: dict, seqs: list[int]) -> list[str]:
        """Write ``step``'s line in metrics.jsonl (and to the dashboard and trackers) and in
        batches.jsonl where the run's log lacks it: a driver killed after the workers saved
        the step's checkpoint, before it wrote them. Returns the files it wrote to."""
        written = []
        if step not in self.steps("metrics.jsonl"):
            self.log(step, line)
            written.append("metrics.jsonl")
        if step not in self.steps("batches.jsonl"):
            self.batch(step, seqs)
            written.append("batches.jsonl")
        return written

    def steps(self, name: str) -> set[int]:
        """The steps with a line in the run's file ``name``."""
        path = self.folder / name
        return {json.loads(line)["step"] for line in path.read_text().splitlines()} if path.is_file() else set()

    @staticmethod
    def forget_after(folder: Path, step: int) -> list[int]:
        """Drop the lines of steps after ``step`` from the run's metrics.jsonl,
        batches.jsonl and eval.jsonl: a run resumed from the checkpoint of ``step``
        trains them again, and its log then has every step once. Returns the steps
        dropped (a torn last line goes too)."""
        dropped: set[int] = set()
        for name in ("metrics.jsonl", "batches.jsonl", "eval.jsonl"):
            path = folder / name
            if not path.is_file():
                continue
            kept = []
            for line in path.read_text().splitlines():
                try:
                    line_step = json.loads(line)["step"]
                except (ValueError, KeyError, TypeError):
                    continue  # torn by a stop mid-write
                if line_step <= step:
                    kept.append(line + "\n")
                else:
                    dropped.add(line_step)
            temporary = path.with_suffix(".tmp")
            temporary.write_text("".join(kept))
            os.replace(temporary, path)
        return sorted(dropped)

    def history(self) -> list[dict]:
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def plot(self) -> Path | None:
        """Write ``reward_curve.png`` (mean reward per step); None without data."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = [r for r in self.history() if "reward_mean" in r]
        if not rows:
            return None
        figure, axis = plt.subplots(figsize=(6, 3.5))
        axis.plot([r["step"] for r in rows], [r["reward_mean"] for r in rows], marker="o")
        axis.set_xlabel("step")
        axis.set_ylabel("mean reward")
        axis.set_title(self.folder.name)
        axis.grid(alpha=0.3)
        figure.tight_layout()
        path = self.folder / "reward_curve.png"
        figure.savefig(path, dpi=120)
        plt.close(figure)
        return path

    def close(self) -> None:
        self.progress.stop()
        self.tracking.close()
