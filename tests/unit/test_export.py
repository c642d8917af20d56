"""`rlgate trajectories export`'s pure parts (the command end to end, on a served
session's records: tests/integration/test_export.py)."""

from __future__ import annotations

from rlgate.cli.export import sampled_spans


def test_sampled_spans_are_the_runs_of_the_loss_mask():
    assert sampled_spans([0, 1, 1, 0, 0, 1, 0, 1]) == [(1, 3), (5, 6), (7, 8)]
    assert sampled_spans([]) == [] and sampled_spans([0, 0]) == []
