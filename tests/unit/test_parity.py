"""`rlgate check-parity`'s verdict: what fails a report, and how the command says
so (the real measurement, on real engines, is tests/system/test_cli.py)."""

from __future__ import annotations

import pytest

from rlgate.cli import main as cli
from rlgate.rollout import parity
from rlgate.rollout.parity import FRESH_ENGINE_TOLERANCE, ParityReport, failures


def report(**changes) -> ParityReport:
    exact = dict(
        model="tiny-random",
        engine="vllm",
        diff_before_update=3e-6,
        diff_after_update=4e-6,
        diff_vs_fresh_engine=None,
        update_change=0.2,
        weight_update_seconds=0.05,
        greedy_agree=7,
        greedy_total=8,
        greedy_near_ties=1,
    )
    return ParityReport(**exact | changes)


def test_a_report_fails_for_each_thing_out_of_bounds_and_only_those():
    assert failures(report(), tolerance=1e-4) == []
    assert failures(report(diff_after_update=2e-4), 1e-4) == [
        "logprobs differ from the reference by 2.000e-04 > 1.0e-04"
    ]
    [fresh] = failures(report(diff_vs_fresh_engine=10 * FRESH_ENGINE_TOLERANCE), 1e-4)
    assert fresh.startswith("the updated engine differs from a fresh engine on the same weights")
    assert failures(report(greedy_near_ties=0), 1e-4) == [
        "greedy decoding disagrees with the reference away from a near tie"
    ]


@pytest.mark.parametrize("fresh", [True, False])
def test_check_parity_fails_loudly_when_the_bar_is_impossible(monkeypatch, capsys, fresh):
    asked = {}

    def measured(model, **options):
        asked.update(options, model=model)
        return report(diff_vs_fresh_engine=1e-6 if options["fresh_engine"] else None)

    monkeypatch.setattr(parity, "run_parity", measured)
    flags = [] if fresh else ["--no-fresh-engine"]
    assert cli.main(["check-parity", "--model", "tiny-random", "--tolerance", "1e-12", *flags]) == 1
    out, err = capsys.readouterr()
    assert asked["model"] == "tiny-random" and asked["fresh_engine"] is fresh
    assert "FAIL: logprobs differ from the reference by 4.000e-06 > 1.0e-12" in err
    assert "parity: FAIL" in out and "max_abs_logprob_diff=4.000e-06" in out
    assert ("max_abs_logprob_diff_vs_fresh_engine" in out) is fresh
