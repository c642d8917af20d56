"""A run's step metrics and sample completions in TensorBoard, Weights & Biases
and MLflow (``[logging]``), beside ``metrics.jsonl``, which stays the record of truth.

Each tracker is imported only when it is asked for (``pip install
'rlgate[tracking]'`` brings all three). A resumed run goes on in the same W&B
and MLflow run (their ids are kept in the run folder) and the same
TensorBoard folder, where the steps it trains again replace the stopped
run's; a fresh run starts a new W&B and MLflow run. Samples are a few of
each step's trajectories, decoded: the prompt, the completion, the reward.
A tracker that fails while the run trains is dropped with a warning: it
never stops the training. (MLflow appends a step trained again beside the
stopped run's value at that step.)
"""

from __future__ import annotations

import logging
import math
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from rlgate.config import LoggingConfig

SAMPLE_COLUMNS = ["step", "task_id", "reward", "prompt", "completion"]

logger = logging.getLogger(__name__)


class Tracker(Protocol):
    def log(self, step: int, metrics: dict[str, float], samples: list[list[Any]]) -> None: ...

    def close(self) -> None: ...


def numeric(metrics: dict[str, Any]) -> dict[str, float]:
    """The metrics a tracker can plot: finite numbers (bools count)."""
    return {
        name: float(value)
        for name, value in metrics.items()
        if isinstance(value, int | float) and math.isfinite(float(value))
    }


class TensorBoardTracker:
    """Scalars under ``train/``, and the samples as a Markdown table, in ``<run>/tensorboard``."""

    def __init__(self, folder: Path, first_step: int) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ImportError("[logging] tensorboard needs the tensorboard package: pip install tensorboard") from None
        # over an earlier writer's events, readers discard those from this step on: steps trained again
        # (a resumed run's, or a fresh run's under the same name) replace them
        earlier = folder.is_dir() and any(folder.glob("events.out.tfevents.*"))
        self.writer = SummaryWriter(str(folder), purge_step=first_step + 1 if earlier else None)

    def log(self, step: int, metrics: dict[str, float], samples: list[list[Any]]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(f"train/{name}", value, step)
        if samples:
            self.writer.add_text("samples", markdown_table(samples), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """One W&B run per rlgate run (resumed with it), its config the run's; the
    samples as a ``wandb.Table`` per step. Offline unless ``WANDB_API_KEY`` is set
    or ``[logging] wandb_mode`` says otherwise (``wandb sync`` uploads it later).
    Charts are drawn against the ``step`` metric, not W&B's own step counter,
    which would drop the steps a resumed run trains again."""

    def __init__(self, settings: LoggingConfig, folder: Path, run_name: str, config: dict, resumed: bool) -> None:
        try:
            import wandb
        except ImportError:
            raise ImportError("[logging] wandb needs the wandb package: pip install wandb") from None
        self.wandb = wandb
        folder.mkdir(parents=True, exist_ok=True)
        id_file = folder / "run_id"
        if not resumed or not id_file.exists():  # a fresh run under an old name is a new W&B run
            id_file.write_text(secrets.token_hex(6))  # W&B run ids are short lower-case strings
        mode = settings.wandb_mode or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self.run = wandb.init(
            project=settings.wandb_project,
            entity=settings.wandb_entity,
            name=run_name,
            id=id_file.read_text().strip(),
            resume="allow",
            dir=str(folder),
            mode=mode,
            config=config,
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, metrics: dict[str, float], samples: list[list[Any]]) -> None:
        data: dict[str, Any] = dict(metrics)
        if samples:
            data["samples"] = self.wandb.Table(columns=SAMPLE_COLUMNS, data=samples)
        self.run.log({**data, "step": step})

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """One MLflow run per rlgate run (resumed with it) in ``[logging]
    mlflow_experiment``: each step's metrics at that step, the samples as a
    table artifact per step (``samples/step-000020.json``), the config as
    ``config.json``. The tracking server is ``mlflow_tracking_uri``, else
    ``$MLFLOW_TRACKING_URI``, else a file store in the run folder (``mlruns/``:
    ``mlflow ui --backend-store-uri <run>/mlruns`` shows it)."""

    def __init__(self, settings: LoggingConfig, run_dir: Path, run_name: str, config: dict, resumed: bool) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise ImportError("[logging] mlflow needs the mlflow package: pip install mlflow-skinny") from None
        uri = settings.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if uri is None:  # the run folder's own file store (MLflow 3 asks to be told that a file store is meant)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (run_dir / "mlruns").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        id_file = run_dir / "mlflow_run_id"
        if resumed and id_file.exists():
            self.run_id = id_file.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
        else:  # a fresh run under an old name is a new MLflow run
            name = settings.mlflow_experiment
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
            self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
            id_file.write_text(self.run_id)
            self.client.log_dict(self.run_id, config, "config.json")
        self.uri = uri

    def log(self, step: int, metrics: dict[str, float], samples: list[list[Any]]) -> None:
        import time

        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        batch = [Metric(name, value, stamp, step) for name, value in metrics.items()]
        for start in range(0, len(batch), 1000):  # MLflow takes at most 1000 metrics per batch
            self.client.log_batch(self.run_id, metrics=batch[start : start + 1000])
        if samples:
            table = {column: [row[i] for row in samples] for i, column in enumerate(SAMPLE_COLUMNS)}
            self.client.log_table(self.run_id, data=table, artifact_file=f"samples/step-{step:06d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def markdown_table(samples: list[list[Any]]) -> str:
    def cell(value: Any) -> str:
        text = f"{value:.3g}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(SAMPLE_COLUMNS) + " |", "|" + "---|" * len(SAMPLE_COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in samples])


def sample_rows(step: int, records: list[dict], decode: Callable[[list[int]], str], count: int) -> list[list[Any]]:
    """Up to ``count`` of a step's trajectories as table rows: the prompt (the
    tokens before the first trained one), the completion (the rest), the reward."""
    rows = []
    for record in [r for r in records if not r.get("failed")][:count]:
        mask = record["loss_mask"]
        first = mask.index(1) if 1 in mask else len(mask)
        ids = record["input_ids"]
        rows.append([step, record["task_id"], float(record["reward"]), decode(ids[:first]), decode(ids[first:])])
    return rows


class Tracking:
    """The trackers ``[logging]`` asks for, fed by the run log each step."""

    def __init__(self, trackers: list[Tracker], decode: Callable[[list[int]], str] | None, samples: int) -> None:
        self.trackers, self.decode, self.samples = trackers, decode, samples

    @classmethod
    def start(
        cls,
        settings: LoggingConfig,
        run_dir: Path,
        run_name: str,
        config: dict,
        model_path: Callable[[], str],
        first_step: int = 0,
        resumed: bool = False,
    ) -> Tracking:
        """The trackers ``settings`` ask for, going on from ``first_step``;
        ``model_path()`` (the tokenizer's folder) is called only when samples are
        to be decoded. ImportError names a missing package."""
        trackers: list[Tracker] = []
        if settings.tensorboard:
            trackers.append(TensorBoardTracker(run_dir / "tensorboard", first_step))
        if settings.wandb:
            trackers.append(WandbTracker(settings, run_dir / "wandb", run_name, config, resumed))
        if settings.mlflow:
            trackers.append(MlflowTracker(settings, run_dir, run_name, config, resumed))
        decode = None
        if trackers and settings.samples_per_step:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_path())
            decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        return cls(trackers, decode, settings.samples_per_step)

    def log(self, step: int, metrics: dict[str, Any], records: list[dict]) -> None:
        if not self.trackers:
            return
        samples = sample_rows(step, records, self.decode, self.samples) if self.decode else []
        for tracker in list(self.trackers):
            self._guarded(tracker, "log", lambda t=tracker: t.log(step, numeric(metrics), samples))

    def close(self) -> None:
        for tracker in list(self.trackers):
            self._guarded(tracker, "close", tracker.close)

    def _guarded(self, tracker: Tracker, what: str, call: Callable[[], None]) -> None:
        """A tracker that fails is dropped, said once; metrics.jsonl goes on."""
        try:
            call()
        except Exception as err:
            logger.warning(
                "%s failed to %s (%s: %s); the run goes on without it",
                type(tracker).__name__,
                what,
                err.__class__.__name__,
                err,
            )
            self.trackers.remove(tracker)
