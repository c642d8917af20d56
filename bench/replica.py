"""What a Gateway replica (the split shape: its engines elsewhere) costs to
start: its resident memory and CPU-seconds once Serve says it is ready.

    python bench/replica.py [--model smollm2-135m-instruct] [--rounds 3]

rlgate's replica loads the model's tokenizer by the class name resolved where
the app is built (``rlgate.models.load_tokenizer``) and never imports torch;
the peer is the same replica loading it with ``AutoTokenizer``, which imports
torch (what every replica did before). Both on one local Ray, one app at a
time, the two alternating for ``--rounds`` rounds; prints each start and the
medians' ratios. Run it alone: it reads the replica's process from ``/proc``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import psutil  # noqa: E402
from gateway import free_port  # noqa: E402


def replica(app: str) -> psutil.Process:
    """The live process of ``app``'s Gateway replica (its process title names it)."""
    title = f"ServeReplica:{app}:Gateway"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for process in psutil.process_iter(["cmdline"]):
            if title in " ".join(process.info["cmdline"] or []):
                return process
        time.sleep(0.2)
    raise RuntimeError(f"no process titled {title}")


def start(model: str, app: str, by_name: bool) -> tuple[float, float]:
    """Deploy the app and return its Gateway replica's (MiB resident, CPU-s) once ready."""
    from ray import serve

    import rlgate.serving.app as serving_app
    from rlgate.config import parse_config
    from rlgate.models import tokenizer_class
    from rlgate.sessions.manager import hash_key

    # the peer: no class name, so the replica falls back to AutoTokenizer (and torch)
    serving_app.tokenizer_class = tokenizer_class if by_name else (lambda path: "")
    config = parse_config(
        {
            "model": {"name": model},
            "rollout": {"engine": "hf", "max_model_len": 512},
            "gateway": {"run_dir": tempfile.mkdtemp(prefix="rlgate-replica-"), "run_name": app},
        }
    )
    serve.run(serving_app.build_app(config, hash_key("bench-admin-key-" + "x" * 24)), name=app, route_prefix=f"/{app}")
    process = replica(app)
    times = process.cpu_times()
    resident = process.memory_info().rss / 2**20, times.user + times.system
    serve.delete(app)
    return resident


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import ray
    from ray import serve

    from rlgate.serving.routing import serve_start_options

    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()}, **serve_start_options())
    seen: dict[str, list[tuple[float, float]]] = {"rlgate": [], "AutoTokenizer": []}
    try:
        for round_ in range(args.rounds):
            for side, by_name in (("rlgate", True), ("AutoTokenizer", False)):
                mib, cpu = start(args.model, f"r{round_}-{'name' if by_name else 'auto'}", by_name)
                seen[side].append((mib, cpu))
                print(f"round {round_ + 1}, {side:>13}: {mib:6.0f} MiB resident, {cpu:5.2f} CPU-s to ready", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    (ours_mib, ours_cpu), (peer_mib, peer_cpu) = (
        (statistics.median(m for m, _ in seen[side]), statistics.median(c for _, c in seen[side])) for side in seen
    )
    print(f"\n{args.model}: a Gateway replica ready at {ours_mib:.0f} MiB and {ours_cpu:.2f} CPU-s (medians);")
    print(f"with AutoTokenizer {peer_mib:.0f} MiB and {peer_cpu:.2f} CPU-s: {ours_mib / peer_mib:.2f}x the memory,")
    print(f"{ours_cpu / peer_cpu:.2f}x the CPU")


if __name__ == "__main__":
    main()
