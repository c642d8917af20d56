"""Asynchrony benchmark: the same training job with max_staleness S = 0
(synchronous GRPO) and S = 2 against an environment that takes its time,
in one run, one after the other.

    python bench/async.py [--config configs/bench-learning.toml] [--staleness 2] [--env-delay 1.0] [--steps 10]
                          [--colocate]

Both runs use the demo config with ``[task] env_delay_s`` set (every turn
takes a uniformly random 0 to 2 x env-delay seconds, as tools, simulators or
judges do) and ``max_concurrent`` episodes in flight. With S = 0 the
capacity actor admits exactly one batch per policy version, so each step
waits for the slowest episode of its batch, and no episode runs while the
trainer trains and syncs. With S = 2 episodes keep starting on weights up to
two versions old; the trainer corrects for it (decoupled PPO) and drops
anything older. Prints trained samples (episodes) per second after the first
step, the mean staleness of trained tokens, and the ratio S=2 / S=0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from rlgate.config import dump_config, load_config  # noqa: E402


def run(
    config_path: Path, staleness: int, env_delay: float, steps: int, concurrency: int, folder: Path, colocate: bool
) -> dict:
    """train_driver.py with S and the environment delay set; its metrics.jsonl."""
    config = load_config(config_path)
    if colocate:  # the engine in the gateway replica, episodes on its own port
        config.gateway.colocate, config.gateway.direct_port = True, config.gateway.port + 1
    config.training.max_staleness = staleness
    config.training.total_steps = steps
    config.training.save_every = 0
    config.task.env_delay_s = env_delay
    config.task.max_concurrent = concurrency
    config.gateway.max_concurrent = max(config.gateway.max_concurrent, concurrency)
    config.gateway.run_dir = str(folder)
    config.gateway.run_name = f"async-s{staleness}"
    path = dump_config(config, folder / f"s{staleness}.toml")
    env = os.environ | {"RLGATE_ADMIN_KEY": "bench-async-admin-key-0123"}
    subprocess.run(
        [sys.executable, "train_driver.py", "--config", str(path)],
        cwd=ROOT,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    metrics = [
        json.loads(line) for line in (folder / config.gateway.run_name / "metrics.jsonl").read_text().splitlines()
    ]
    # From the end of step 1 (everything warm) to the end of the last step.
    elapsed = metrics[-1]["time"] - metrics[0]["time"]
    samples = sum(m["samples"] for m in metrics[1:])
    return {
        "staleness": staleness,
        "samples_per_s": samples / elapsed,
        "mean_step_s": elapsed / (len(metrics) - 1),
        "mean_staleness": sum(m["staleness"] for m in metrics[1:]) / (len(metrics) - 1),
        "stale_tokens_dropped": sum(m["stale_tokens_dropped"] for m in metrics),
        "reward_first": metrics[0]["reward_mean"],
        "reward_last": metrics[-1]["reward_mean"],
        "metrics": metrics,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "bench-learning.toml")
    parser.add_argument("--staleness", type=int, default=2)
    parser.add_argument("--env-delay", type=float, default=1.0, help="mean seconds per environment turn")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=32, help="episodes in flight")
    parser.add_argument("--colocate", action="store_true", help="the gateway runs the engine, episodes on its port")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="rlgate-bench-async-") as folder:
        for staleness in (0, args.staleness):
            started = time.monotonic()
            results.append(
                run(args.config, staleness, args.env_delay, args.steps, args.concurrency, Path(folder), args.colocate)
            )
            results[-1]["wall_s"] = time.monotonic() - started
    print(f"{args.steps} steps, environment {args.env_delay:g} s per turn on average, {args.concurrency} in flight")
    print(f"{'S':>3} {'samples/s':>10} {'s/step':>8} {'staleness':>10} {'dropped tok':>12} {'reward':>12}")
    for r in results:
        print(
            f"{r['staleness']:>3} {r['samples_per_s']:>10.2f} {r['mean_step_s']:>8.2f} {r['mean_staleness']:>10.2f}"
            f" {r['stale_tokens_dropped']:>12.0f} {r['reward_first']:>5.2f}->{r['reward_last']:.2f}"
        )
    print(f"ratio S={args.staleness} / S=0: {results[1]['samples_per_s'] / results[0]['samples_per_s']:.2f}x samples/s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
