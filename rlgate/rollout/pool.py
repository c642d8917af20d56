"""Engine pools: one set of vLLM engines on a base model, shared by several runs
(``[rollout] pool``), each run training and serving its own LoRA adapter.

A pool is a Serve application of RolloutServer replicas (``enginepool-<pool>``)
and a keeper actor of the same name (:mod:`rlgate.actors.engine_pool`) that
knows its runs. The first run to join deploys it with its own ``[rollout]``
settings; a later run joins only when it would have asked for the same engines
(:meth:`PoolSpec.refusal`); the last run to leave deletes it. This module is the
pure part: names, and what a run must agree on to share the engines.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlgate.config import RLGateConfig

# Never the prefix of a run's names (``rlgate-<run>-<role>``, applications ``rlgate``/``rlgate-<run>``).
PREFIX = "enginepool-"
LEASE = "pool-lease"  # a run's role (rlgate.run) holding its place in a pool: an actor that ends with its driver


def pool_name(pool: str) -> str:
    """The pool's Serve application and its keeper actor: ``enginepool-<pool>``."""
    return PREFIX + pool


@dataclass(frozen=True)
class PoolSpec:
    """What a pool's engines are: the runs sharing them must agree on it."""

    model: str  # the resolved base model folder
    dtype: str
    replicas: int
    lora_rank: int  # the engines' LoRA rank (vLLM's): a run's adapter may have this rank or less
    max_model_len: int

    @classmethod
    def of(cls, config: RLGateConfig, model_path: str) -> PoolSpec:
        from rlgate.config import engine_lora_rank

        if config.training.lora is None:
            raise ValueError("an engine pool serves LoRA adapters: set [training.lora]")
        return cls(
            model=str(model_path),
            dtype=config.model.dtype,
            replicas=config.rollout.replicas,
            lora_rank=engine_lora_rank(config.training.lora.rank),
            max_model_len=config.rollout.max_model_len,
        )

    def refusal(self, joining: PoolSpec) -> str | None:
        """Why a run asking for ``joining`` cannot share these engines (None: it can)."""
        problems = [
            f"{name} {getattr(joining, name)!r} (the pool's is {getattr(self, name)!r})"
            for name in ("model", "dtype", "replicas", "max_model_len")
            if getattr(joining, name) != getattr(self, name)
        ]
        if joining.lora_rank > self.lora_rank:
            problems.append(f"LoRA rank up to {joining.lora_rank} (the pool's engines take up to {self.lora_rank})")
        return "; ".join(problems) or None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TenantInfo:
    """What a pool's engines need to serve one run: the version it starts at, the
    adapter that version is (a resumed run's checkpoint; None: the base model), and
    which joining of the run this is (a run started again under its name is new)."""

    version: int = 0
    adapter: str | None = None
    joined: str = ""


class PoolRefused(ValueError):
    """A run that cannot join a pool (its engines differ from what the run asks for)."""


class KeeperEnding(RuntimeError):
    """A join that reached a pool's keeper as it ends with the pool: join again (a new keeper)."""
