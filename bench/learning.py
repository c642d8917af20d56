"""Learning benchmark: wall-clock to a reward threshold, rlgate against TRL's
``GRPOTrainer``, in one run, one after the other.

    python bench/learning.py [--config configs/bench-learning.toml] [--thresholds 0.5 0.7 0.9] [--colocate]
                             [--lora RANK] [--learning-rate LR] [--json results.json]
    python bench/learning.py --config configs/bench-learning-smollm2.toml [--lora 16]   # the real-model race

Both train the same model on the same task (the toy mode: ``[task] builtin``,
the demo's ``vowels`` on tiny-random; the real-model mode: SmolLM2-135M-Instruct
on ``examples/arithmetic.jsonl`` with its reward function, ``[task] dataset``)
with the same prompts in the same order, batch (sessions per step), group size,
learning rate (constant), clip range, completion length and temperature, no
KL, and GRPO's sequence-mean-token-mean loss with group mean/std advantages.
``--lora RANK`` trains a LoRA adapter of that rank on both sides (alpha = 2 x
rank, every linear layer) instead of the whole model; ``--learning-rate``
replaces the config's on both sides.

* **rlgate**: ``train_driver.py --config ...`` exactly as a user runs it: Ray,
  the gateway and a vLLM engine on Serve, a Ray Train worker, episodes played
  through HTTP by the built-in OpenAI-SDK agent, weights pushed every step.
* **TRL**: ``GRPOTrainer`` on the same prompts and reward function, generating
  with transformers in the training process (TRL's default without vLLM).

Prints, per threshold and system: steps and seconds (from launch, and from
the first rollout) until a step's mean reward first reaches the threshold,
the median step time, and the ratio TRL / rlgate (above 1: rlgate got there
sooner).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from rlgate.config import LoraSettings, dump_config, load_config  # noqa: E402
from rlgate.models import prepare_model  # noqa: E402
from rlgate.training.dataset_task import dataset_task  # noqa: E402
from rlgate.training.tasks import Problem, get_task  # noqa: E402


def adjusted(config_path: Path, rank: int | None, learning_rate: float | None, folder: Path) -> Path:
    """The config, with ``[training.lora]`` of ``rank`` (alpha 2 x rank) and the
    learning rate when given."""
    if rank is None and learning_rate is None:
        return config_path
    config = load_config(config_path)
    if rank is not None:
        config.training.lora = LoraSettings(rank=rank, alpha=2.0 * rank)
    if learning_rate is not None:
        config.training.learning_rate = learning_rate
    return dump_config(config, folder / "race.toml")


def run_rlgate(config_path: Path, colocate: bool = False) -> dict:
    """train_driver.py in its own process; step times from its metrics.jsonl."""
    config = load_config(config_path)
    name = f"bench-learning-{int(time.time())}"
    if colocate:  # the same job with the engine in the gateway replica, episodes on its own port
        config.gateway.colocate, config.gateway.direct_port = True, config.gateway.port + 1
        config_path = dump_config(config, Path(tempfile.mkdtemp(prefix="rlgate-bench-learning-")) / "colocated.toml")
    env = os.environ | {"RLGATE_ADMIN_KEY": "bench-learning-admin-key-0123"}
    launched = time.time()
    subprocess.run(
        [sys.executable, "train_driver.py", "--config", str(config_path), "--run-name", name],
        cwd=ROOT,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    run = ROOT / config.gateway.run_dir / name
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    first_rollout = metrics[0]["time"] - metrics[0]["step_s"] - metrics[0].get("collect_s", 0.0)
    return {
        "launched": launched,
        "first_rollout": first_rollout,
        "steps": [{"step": m["step"], "reward": m["reward_mean"], "time": m["time"]} for m in metrics],
        "run_dir": str(run),
    }


def run_trl(config_path: Path, workdir: Path) -> dict:
    out = workdir / "trl.json"
    launched = time.time()
    subprocess.run(
        [sys.executable, __file__, "--trl-worker", "--config", str(config_path), "--out", str(out)],
        cwd=ROOT,
        check=True,
    )
    return {"launched": launched, **json.loads(out.read_text())}


def trl_worker(config_path: Path, out: Path) -> None:
    """TRL's GRPOTrainer with the rlgate config's settings (run as a subprocess)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    config = load_config(config_path)
    training, algorithm = config.training, config.algorithm.resolved(config.training.max_staleness)
    plain = (algorithm.advantage, algorithm.aggregation, algorithm.kl_coef, algorithm.entropy_coef)
    if plain != ("grpo", "seq_mean_token_mean", 0, 0):
        raise SystemExit("bench/learning.py compares plain GRPO (variety = grpo, no KL, no entropy bonus) only")
    spec = config.task
    if spec.dataset is not None:  # rows and the reward function, as the driver loads them
        task = dataset_task(spec.dataset, spec.dataset_split, spec.prompt_column, spec.reward)
    else:
        task = get_task(config.task.builtin)
    rng = random.Random(training.seed)  # the driver's order of prompts
    prompts = [task.problem(rng) for _ in range(training.total_steps * training.batch_size // training.group_size)]
    dataset = Dataset.from_list([{"prompt": p.messages, "problem": json.dumps(asdict(p))} for p in prompts])

    def reward(completions, problem, **_) -> list[float]:
        return [task.reward(Problem(**json.loads(p)), c[0]["content"]) for c, p in zip(completions, problem)]

    steps: list[dict] = []
    timing: dict = {}

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            timing["first_rollout"] = time.time()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                steps.append({"step": state.global_step, "reward": logs["reward"], "time": time.time()})

    path = prepare_model(config.model.name)
    torch.manual_seed(training.seed)
    args = GRPOConfig(
        output_dir=str(out.parent / "trl-output"),
        per_device_train_batch_size=training.batch_size,  # completions per step: the same sessions per step
        num_generations=training.group_size,
        learning_rate=training.learning_rate,
        lr_scheduler_type="constant",
        weight_decay=training.weight_decay,
        max_grad_norm=training.max_grad_norm,
        max_steps=training.total_steps,
        max_completion_length=config.task.max_tokens,
        temperature=config.task.temperature,
        epsilon=algorithm.clip_low,
        epsilon_high=algorithm.clip_high,
        loss_type="grpo",  # sequence mean of token means, as rlgate's grpo variety
        scale_rewards="group",
        beta=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        seed=training.seed,
        disable_tqdm=True,
    )
    peft_config = None
    if training.lora is not None:
        from peft import LoraConfig

        lora = training.lora
        peft_config = LoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=lora.target_modules,
            task_type="CAUSAL_LM",
        )
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        processing_class=AutoTokenizer.from_pretrained(path),
        reward_funcs=reward,
        args=args,
        train_dataset=dataset,
        callbacks=[Clock()],
        peft_config=peft_config,
    )
    trainer.train()
    out.write_text(json.dumps({"first_rollout": timing["first_rollout"], "steps": steps}))


def reached(result: dict, threshold: float) -> dict:
    """Steps and seconds until a step's mean reward first reaches ``threshold``."""
    steps = result["steps"]
    hit = next((s for s in steps if s["reward"] >= threshold), None)
    times = [s["time"] for s in steps]
    step_s = statistics.median(b - a for a, b in zip(times, times[1:])) if len(times) > 1 else float("nan")
    return {
        "step": hit["step"] if hit else None,
        "from_launch_s": hit["time"] - result["launched"] if hit else None,
        "from_first_rollout_s": hit["time"] - result["first_rollout"] if hit else None,
        "median_step_s": step_s,
        "first_reward": steps[0]["reward"],
        "final_reward": steps[-1]["reward"],
    }


def report(results: dict, thresholds: list[float]) -> None:
    width = max(map(len, results))
    columns = f"{'step':>5} {'from launch':>12} {'from 1st rollout':>17} {'median step':>12}"
    print(f"{'reward':>6} {'system':{width}} {columns}")
    for threshold in thresholds:
        summary = {name: reached(result, threshold) for name, result in results.items()}
        for name, s in summary.items():
            hit = s["step"] is not None
            launch = f"{s['from_launch_s']:.1f} s" if hit else "-"
            rollout = f"{s['from_first_rollout_s']:.1f} s" if hit else "-"
            step = s["step"] if hit else "never"
            print(f"{threshold:>6} {name:{width}} {step:>5} {launch:>12} {rollout:>17} {s['median_step_s']:>10.2f} s")
        rl, trl = summary["rlgate"], summary.get("trl", {"step": None})
        if rl["step"] and trl["step"]:
            print(
                f"{'':6} ratio TRL / rlgate: {trl['from_launch_s'] / rl['from_launch_s']:.2f}x from launch, "
                f"{trl['from_first_rollout_s'] / rl['from_first_rollout_s']:.2f}x from the first rollout"
            )
    for name, result in results.items():
        rewards = [s["reward"] for s in result["steps"]]
        print(f"{name}: reward by step {' '.join(f'{r:.2f}' for r in rewards)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "bench-learning.toml")
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.5, 0.7, 0.9])
    parser.add_argument(
        "--colocate",
        action="store_true",
        help="also run rlgate with the engine in the gateway ([gateway] colocate, episodes on its direct_port)",
    )
    parser.add_argument("--lora", type=int, metavar="RANK", help="train a LoRA adapter of this rank on both sides")
    parser.add_argument("--learning-rate", type=float, help="instead of the config's, on both sides")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(args.config, args.out)
        return 0

    with tempfile.TemporaryDirectory(prefix="rlgate-bench-learning-") as folder:
        config = adjusted(args.config, args.lora, args.learning_rate, Path(folder))
        results = {"rlgate": run_rlgate(config)}
        if args.colocate:
            results["rlgate-colocated"] = run_rlgate(config, colocate=True)
        if importlib.util.find_spec("trl") is not None:
            results["trl"] = run_trl(config, Path(folder))
        else:
            print("TRL is not installed (pip install -e '.[bench]', or make bench): rlgate alone", flush=True)
    report(results, args.thresholds)
    if args.json:
        args.json.write_text(json.dumps({"thresholds": args.thresholds, "raw": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
