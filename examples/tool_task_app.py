"""A multi-turn tool-use task app (the synth-ai task-app contract).

The policy is asked an arithmetic question and given a ``calculator`` tool. It
may call the tool over several turns (each result goes back as a ``tool``
message) before it answers; the reward is 1 for the right number in the final
answer, and each turn whose tool calls all parse earns an event reward of 0.1
(one event per turn, as the trainer puts the i-th on the i-th completion).
The built-in ``tiny-tools`` model has learned to call the calculator.

    python examples/tool_task_app.py --port 8202
    python train_driver.py --config configs/taskapp-tools.toml
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re

from rlgate.models import CALCULATOR_TOOL
from rlgate.sdk import Episode, Outcome, create_task_app, serve

CALCULATOR = CALCULATOR_TOOL  # the tool tiny-tools has learned to call
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> str:
    """+, - and * over integers; anything else is an error message for the policy."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("only integers with + - * are supported")

    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, RecursionError) as err:
        return f"error: {err}"


def problem(seed: int) -> tuple[str, int]:
    rng = random.Random(seed)
    a, b, op = rng.randint(2, 20), rng.randint(2, 20), rng.choice("+-*")
    expression = f"{a} {op} {b}"
    return expression, int(calculate(expression))


async def rollout(episode: Episode) -> Outcome:
    expression, answer = problem(episode.seed)
    messages: list[dict] = [{"role": "user", "content": f"What is {expression}?"}]
    events: list[float] = []
    max_turns = int(episode.config.get("max_turns", 4))
    policy = {k: v for k, v in episode.request.policy.config.items() if k in ("temperature", "max_tokens")}
    for _ in range(max_turns):
        reply = await episode.client.chat.completions.create(
            model=episode.model, messages=messages, tools=[CALCULATOR], **policy
        )
        message = reply.choices[0].message
        if not message.tool_calls:
            found = re.search(r"-?\d+", message.content or "")
            correct = found is not None and int(found.group()) == answer
            return Outcome(float(correct), events, steps=len(events) + 1, details={"answer": message.content})
        messages.append(message.model_dump(exclude_none=True))
        parsed = True
        for call in message.tool_calls:
            try:
                result = calculate(json.loads(call.function.arguments)["expression"])
            except (ValueError, KeyError, TypeError):
                result, parsed = "error: arguments must be JSON with an 'expression'", False
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        events.append(0.1 if parsed else 0.0)
    return Outcome(0.0, events, steps=len(events), details={"answer": None, "reason": "out of turns"})


app = create_task_app(
    "calculator",
    rollout,
    description="Answer an arithmetic question, using a calculator tool over several turns.",
    dataset={"seeds": "any integer"},
)

if __name__ == "__main__":
    serve(app, port=8202, description=__doc__.splitlines()[0])
