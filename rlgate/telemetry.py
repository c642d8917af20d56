"""rlgate's dashboard metrics, declared in one place.

Exported through ``ray.util.metrics``: Ray's metrics agent on every node
serves them to Prometheus (and so to the Ray dashboard and Grafana, see
``deploy/grafana-dashboard.json``), each tagged with the run it belongs to.
The training loop's own figures (reward, step and sync seconds, staleness,
...) are the ``rlgate_train_*`` gauges, set by :mod:`rlgate.training.runlog` each step.
"""

from __future__ import annotations

import threading
import time

# name -> (kind, description, tag keys besides "run")
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "rlgate_requests_total": ("counter", "HTTP requests the gateway answered", ("route", "status")),
    "rlgate_request_seconds": ("histogram", "Gateway request latency in seconds (to the first byte)", ("route",)),
    "rlgate_sessions_started_total": ("counter", "Sessions started", ()),
    "rlgate_sessions_ended_total": ("counter", "Sessions ended, by reason", ("reason",)),
    "rlgate_sessions_rejected_total": ("counter", "start_session answered 429: no capacity", ()),
    "rlgate_sessions_open": ("gauge", "Sessions open now", ()),
    "rlgate_completion_tokens_total": ("counter", "Completion tokens generated and recorded", ()),
    "rlgate_trajectories_saved_total": ("counter", "Trajectory records saved to disk", ()),
    "rlgate_policy_version": ("gauge", "Policy version the capacity actor admits sessions for", ()),
    "rlgate_capacity_running": ("gauge", "Sessions holding a capacity slot", ()),
    "rlgate_capacity_free": ("gauge", "Sessions that may start now", ()),
}
# The training loop's figures, set every step from the driver (rlgate.training.runlog) as rlgate_train_<name>
# (from the step's metrics line: <name>, or the trainer's train_<name>).
TRAIN_GAUGES = {
    "reward_mean": "Mean reward of the last training batch",
    "step_s": "Seconds per training step",
    "version": "Policy version trained",
    "staleness": "Mean staleness (versions) of trained tokens",
    "staleness_max": "Largest staleness (versions) of a trained token",
    "samples": "Episodes in the last batch",
    "dropped": "Episodes dropped so far (equal-reward, partial, stale or failed groups)",
    "failed": "Episodes that failed so far (their environment errored)",
    "stale_tokens_dropped": "Sampled tokens masked out as too stale in the last batch",
    "tokens_per_s": "Trained tokens per second",
    "sync_s": "Seconds to get new weights to every replica",
    "collect_s": "Seconds the trainer waited for a batch",
    "logprob_mismatch_max": "Largest |trainer - engine| logprob of a trained token",
    "eval_reward_mean": "Mean reward on the held-out seeds at the last evaluation",
}
METRICS.update({f"rlgate_train_{name}": ("gauge", text, ()) for name, text in TRAIN_GAUGES.items()})
LATENCY_BOUNDARIES = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300]


GAUGE_REFRESH_S = 5.0


class Metrics:
    """The metrics above for one run; made on first use in the process that
    records them (an actor or replica), and nothing at all where Ray is not
    initialised (unit tests).

    Ray exports a gauge only while it is being set, so the last value of every
    gauge is set again every ``GAUGE_REFRESH_S`` seconds by a daemon thread."""

    def __init__(self, run: str) -> None:
        self.run = run
        self._made: dict | None = None
        self._gauges: dict[tuple[str, tuple], float] = {}
        self._refresher: threading.Thread | None = None

    def _get(self, name: str):
        import ray

        if self._made is None:
            if not ray.is_initialized():
                return None
            from ray.util.metrics import Counter, Gauge, Histogram

            made = {}
            for metric, (kind, description, tags) in METRICS.items():
                keys = ("run", *tags)
                if kind == "counter":
                    made[metric] = Counter(metric, description=description, tag_keys=keys)
                elif kind == "gauge":
                    made[metric] = Gauge(metric, description=description, tag_keys=keys)
                else:
                    made[metric] = Histogram(
                        metric, description=description, boundaries=LATENCY_BOUNDARIES, tag_keys=keys
                    )
                made[metric].set_default_tags({"run": self.run})
            self._made = made
        return self._made[name]

    def inc(self, name: str, value: float = 1.0, **tags: str) -> None:
        metric = self._get(name)
        if metric is not None and value > 0:  # a counter only goes up
            metric.inc(value, tags=tags or None)

    def set(self, name: str, value: float, **tags: str) -> None:
        metric = self._get(name)
        if metric is not None:
            metric.set(value, tags=tags or None)
            self._gauges[(name, tuple(sorted(tags.items())))] = value
            if self._refresher is None:
                self._refresher = threading.Thread(target=self._refresh, daemon=True, name="rlgate-gauges")
                self._refresher.start()

    def _refresh(self) -> None:
        while True:
            time.sleep(GAUGE_REFRESH_S)
            for (name, tags), value in list(self._gauges.items()):
                self._made[name].set(value, tags=dict(tags) or None)

    def observe(self, name: str, value: float, **tags: str) -> None:
        metric = self._get(name)
        if metric is not None:
            metric.observe(value, tags=tags or None)
