"""How often the pool test's learning checks would fail, simulated in one process.

tests/system/test_training.py's pool test trains two runs on opposite rewards and
checks that each run's last half of steps beats its first step by 0.05 and that
the two together score above 1.2. Those runs take minutes; this plays the same
loop in about two seconds a pair: tiny-random with a rank-8 LoRA adapter, the
trainer's own PolicyTrainer and Dr. GRPO loss, four groups of 8 a step, four
sampled tokens at temperature 1, the test's learning rate and reward function.
Sampling is Hugging Face's on the trainer's own model, always on-policy (the
test's runs are synchronous), so the engine is the only part left out.

    python scripts/pool_learning.py --pairs 120                 # the test's reward
    python scripts/pool_learning.py --pairs 120 --reward letters  # letters alone as the denominator
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlgate.config import LoraSettings
from rlgate.models import prepare_model
from rlgate.rollout.lora import attach
from rlgate.training.grpo import LossConfig, dr_grpo_advantages
from rlgate.training.policy_step import PolicyTrainer, StepSettings, collate, token_logprobs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, for the test's own settings
from tests.system.test_training import LETTERS_REWARD, POOL_STEPS, RUNS, VOWELS_REWARD

TOPICS = ["the sea", "a cat", "music", "rain", "a garden", "the moon"]
GROUPS, GROUP_SIZE, MAX_TOKENS = 4, 8, 4


def reward_function(source: str):
    scope: dict = {}
    exec(source, scope)  # the test's own reward, as its dataset file holds it
    return scope["reward"]


def run(seed: int, letters: str, reward, tokenizer, path: str, steps: int, lr: float) -> list[float]:
    """One run's mean reward at each step."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = attach(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), LoraSettings(rank=8, alpha=16)
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    loss = LossConfig(aggregation="seq_mean_token_sum_norm")  # what variety = "dr_grpo" resolves to
    trainer = PolicyTrainer(model, optimizer, StepSettings(variety_loss="ppo_clip", loss=loss))
    means = []
    for step in range(steps):
        records, rewards, groups = [], [], []
        for group in range(GROUPS):
            row = {"prompt": f"Say something about {rng.choice(TOPICS)}.", "letters": letters}
            messages = [{"role": "user", "content": row["prompt"]}]
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
            ids = torch.tensor([prompt] * GROUP_SIZE)
            with torch.no_grad():
                out = model.generate(
                    ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                    max_new_tokens=MAX_TOKENS, pad_token_id=tokenizer.pad_token_id or 0,
                )  # fmt: skip
            for sampled in out[:, len(prompt) :].tolist():
                if tokenizer.eos_token_id in sampled:
                    sampled = sampled[: sampled.index(tokenizer.eos_token_id) + 1]
                n = len(prompt) + len(sampled)
                records.append(
                    {
                        "input_ids": prompt + sampled,
                        "loss_mask": [0] * len(prompt) + [1] * len(sampled),
                        "logprobs": [0.0] * n,
                        "versions": [-1] * len(prompt) + [step] * len(sampled),
                    }
                )
                rewards.append(reward(tokenizer.decode(sampled, skip_special_tokens=True), row, messages))
                groups.append(group)
        batch = collate(records, dr_grpo_advantages(torch.tensor(rewards), torch.tensor(groups)).tolist())
        with torch.no_grad():
            batch.behaviour_logp = token_logprobs(model, batch)  # on-policy: the engine's logprobs are the trainer's
        trainer.step(batch, step)
        means.append(sum(rewards) / len(rewards))
    return means


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=40)
    parser.add_argument("--steps", type=int, default=POOL_STEPS)
    parser.add_argument("--lr", type=float, default=5e-2)
    parser.add_argument("--reward", choices=["shown", "letters"], default="shown",
                        help="shown: the pool test's (letters' share of every shown character); "
                        "letters: the letters' share of the letters")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = prepare_model("tiny-random")
    tokenizer = AutoTokenizer.from_pretrained(path)
    reward = reward_function(LETTERS_REWARD if args.reward == "shown" else VOWELS_REWARD)
    half = args.steps // 2
    margins, sums, failed = [], [], 0
    for pair in range(args.seed, args.seed + args.pairs):
        late = {}
        for index, (name, letters) in enumerate(RUNS.items()):
            means = run(1000 * (index + 1) + pair, letters, reward, tokenizer, path, args.steps, args.lr)
            late[name] = statistics.mean(means[half:])
            margins.append(late[name] - means[0])
        sums.append(sum(late.values()))
        failed += min(margins[-2:]) <= 0.05 or sums[-1] <= 1.2
        print(f"pair {pair}: " + ", ".join(f"{k} {v:.2f} (+{m:.2f})" for (k, v), m in zip(late.items(), margins[-2:])))
    print(f"{failed} of {args.pairs} pairs fail the test's checks")
    print(f"last half - step 1: median {statistics.median(margins):.2f}, least {min(margins):.2f}")
    print(f"a + b: median {statistics.median(sums):.2f}, least {min(sums):.2f}")


if __name__ == "__main__":
    main()
