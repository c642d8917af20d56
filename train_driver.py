"""rlgate's RL loop as a Ray job (its body: :mod:`rlgate.training.driver`):

    python train_driver.py --config configs/demo.toml [--resume] [--run-name NAME] [--run-dir DIR]
    ray job submit --working-dir . -- python train_driver.py --config configs/demo.toml --run-dir /shared/runs

An installed rlgate runs the same as ``rlgate train`` or ``python -m rlgate.training.driver``.
"""

import sys

from rlgate.training.driver import main

if __name__ == "__main__":
    sys.exit(main())
