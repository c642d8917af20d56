"""A single-turn math task app (the synth-ai task-app contract).

Each seed is a sum of two small numbers; the reward is 1 when the first number
in the policy's reply is the answer.

    python examples/math_task_app.py --port 8201          # ENVIRONMENT_API_KEY guards it when set
    python train_driver.py --config configs/taskapp-math.toml
"""

from __future__ import annotations

import random
import re

from rlgate.sdk import Episode, Outcome, create_task_app, serve


def problem(seed: int) -> tuple[str, int]:
    rng = random.Random(seed)
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    return f"What is {a} + {b}? Answer with the number only.", a + b


async def rollout(episode: Episode) -> Outcome:
    question, answer = problem(episode.seed)
    reply = await episode.chat([{"role": "user", "content": question}])
    found = re.search(r"-?\d+", reply)
    correct = found is not None and int(found.group()) == answer
    return Outcome(float(correct), details={"question": question, "reply": reply, "answer": answer})


app = create_task_app(
    "math",
    rollout,
    description="Add two numbers from 1 to 20; reward 1 for the right sum.",
    dataset={"seeds": "any integer", "splits": {"train": "seeds >= 1000", "test": "seeds < 1000"}},
)

if __name__ == "__main__":
    serve(app, port=8201, description=__doc__.splitlines()[0])
