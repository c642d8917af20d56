"""rlgate's RL loop as a Ray job (GRPO on Ray Train).

The training loop is not built yet: it lands with the trainer work (placement
group, Ray Train GRPO, weight sync, capacity grants, checkpoints). Until then
this entry point says so instead of pretending to train.
"""

from __future__ import annotations

import sys


def main() -> int:
    print(
        "rlgate: train_driver.py has no training loop yet; `make demo` serves the model and "
        "runs a scripted chat through the rollout engine in the meantime.",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
