"""Peak memory per trainer worker under each way of holding the model.

    python bench/memory.py [--model smollm2-135m-instruct] [--rows 8] [--tokens 256] [--json out.json]

Each setting runs in fresh processes (two workers on gloo, as Ray Train sets
them up on CPU, for the data-parallel strategies): the worker loads the
model, prepares it as ``rlgate.training.strategy`` does, and takes two GRPO
steps (AdamW) on its share of ``--rows`` rows of ``--tokens`` tokens. It
reports its peak resident memory (``ru_maxrss``; on a GPU machine the peak
CUDA memory allocated instead) and the step time. The peer is full
fine-tuning with DDP, measured in the same run: the ratios say what each
setting saves.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

SETTINGS = {
    "ddp (full fine-tuning, the peer)": dict(strategy="ddp"),
    "ddp + gradient checkpointing": dict(strategy="ddp", checkpointing=True),
    "ddp + bf16 autocast": dict(strategy="ddp", bf16=True),
    "fsdp (2 workers)": dict(strategy="fsdp"),
    "fsdp + gradient checkpointing": dict(strategy="fsdp", checkpointing=True),
    "lora rank 16 (ddp)": dict(strategy="ddp", lora=16),
}


def rows(count: int, tokens: int, vocab: int) -> list:
    generator = torch.Generator().manual_seed(0)
    out = []
    for i in range(count):
        ids = torch.randint(10, vocab - 1, (tokens,), generator=generator).tolist()
        half = tokens // 2
        record = {
            "input_ids": ids,
            "loss_mask": [0] * half + [1] * (tokens - half),
            "logprobs": [0.0] * half + [-3.0] * (tokens - half),
            "versions": [-1] * half + [0] * (tokens - half),
        }
        out.append((record, 1.0 if i % 2 else -1.0))
    return out


def worker(rank: int, world: int, port: int, path: str, setting: dict, args, out: dict) -> None:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from rlgate.config import LoraSettings
    from rlgate.rollout import lora
    from rlgate.training import strategy
    from rlgate.training.grpo import LossConfig
    from rlgate.training.policy_step import PolicyTrainer, StepSettings, collate, shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if setting.get("lora"):
        model = lora.attach(model, LoraSettings(rank=setting["lora"], alpha=2.0 * setting["lora"]))
    if setting.get("checkpointing"):
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    vocab = model.config.vocab_size
    if setting["strategy"] == "fsdp":
        model = strategy.prepare(model, "fsdp", device="cpu").model
    else:  # what Ray Train's prepare_model does on CPU
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    settings = StepSettings(loss=LossConfig(aggregation="token_mean"), bf16=setting.get("bf16", False))
    trainer = PolicyTrainer(model, optimizer, settings)
    everything = rows(args.rows, args.tokens, vocab)
    mine = shard(everything, rank, world)
    batch = collate([r for r, _ in mine], [a for _, a in mine])
    normaliser = float(sum(sum(r["loss_mask"][1:]) for r, _ in everything))
    seconds = []
    for _ in range(2):
        started = time.perf_counter()
        trainer.step(batch, version=0, global_normaliser=normaliser, scale=float(world))
        seconds.append(time.perf_counter() - started)
    peak = (
        torch.cuda.max_memory_allocated() / 2**20
        if torch.cuda.is_available()
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    )
    out[rank] = {"peak_mib": peak, "step_s": seconds[-1]}
    dist.destroy_process_group()


def measure(path: str, setting: dict, args) -> dict:
    from tests.support import free_port

    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(worker, args=(2, free_port(), path, setting, args, out), nprocs=2)
        results = [out[rank] for rank in range(2)]
    return {
        "peak_mib_per_worker": max(r["peak_mib"] for r in results),
        "step_s": max(r["step_s"] for r in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, default=8, help="rows per step, over both workers")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per row")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from rich.console import Console
    from rich.table import Table

    from rlgate.models import prepare_model

    path = str(prepare_model(args.model))
    results = {name: measure(path, setting, args) for name, setting in SETTINGS.items()}
    peer = results["ddp (full fine-tuning, the peer)"]
    unit = "GPU MiB allocated" if torch.cuda.is_available() else "MiB resident"
    table = Table(title=f"{args.model}, 2 workers, {args.rows} rows x {args.tokens} tokens per step")
    for column in ("setting", f"peak {unit} per worker", "vs ddp", "step s", "vs ddp"):
        table.add_column(column, justify="right")
    for name, result in results.items():
        table.add_row(
            name,
            f"{result['peak_mib_per_worker']:.0f}",
            f"{result['peak_mib_per_worker'] / peer['peak_mib_per_worker']:.2f}x",
            f"{result['step_s']:.2f}",
            f"{result['step_s'] / peer['step_s']:.2f}x",
        )
    Console(width=120).print(table)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
