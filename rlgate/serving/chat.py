"""Chat messages to token ids, reusing earlier ids verbatim when a request
continues an earlier exchange.

``exchange_keys`` gives every prefix of a conversation a stable key (a hash
chain over canonical messages, seeded with the tools), so the session store
can find the interaction a new request continues without keeping messages.
``ChatRenderer`` renders with the model's chat template and builds the prompt
of a continuation as: the earlier prompt and completion ids, the text the
template writes after an assistant turn (minus whatever the completion
already produced, e.g. its end-of-turn token), then only the new messages.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

_PROBE = "\u2063rlgate-probe\u2063"  # text no real answer contains


def _normalise_arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):  # not JSON, or nested past what the parser takes
            return arguments
    return arguments


def canonical_message(message: dict) -> dict:
    """The parts of a message that reach the model, in a stable form: role,
    text content, tool calls by name and parsed arguments, tool call id, name."""
    calls = [
        {"name": c["function"]["name"], "arguments": _normalise_arguments(c["function"].get("arguments"))}
        for c in message.get("tool_calls") or []
    ]
    return {
        "role": message["role"],
        "content": message.get("content") or "",
        "tool_calls": calls,
        "tool_call_id": message.get("tool_call_id"),
        "name": message.get("name"),
    }


def _digest(previous: str, item: Any) -> str:
    payload = json.dumps(item, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256((previous + payload).encode()).hexdigest()


def exchange_keys(messages: list[dict], tools: list[dict] | None) -> list[str]:
    """``keys[i]`` identifies ``messages[: i + 1]`` under these tools."""
    key = _digest("", {"tools": tools or []})
    keys = []
    for message in messages:
        key = _digest(key, canonical_message(message))
        keys.append(key)
    return keys


def extend_key(previous: str, message: dict) -> str:
    """The key of a conversation whose key was ``previous`` plus ``message``."""
    return _digest(previous, canonical_message(message))


class ChatRenderer:
    """Renders chat messages to prompt token ids with a tokenizer's chat template."""

    def __init__(self, tokenizer) -> None:
        if not tokenizer.chat_template:
            raise ValueError("the model's tokenizer has no chat template; chat completions need one")
        self.tokenizer = tokenizer
        probe = self.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}], None, False)
        # What the template writes after an assistant turn's content ("<|im_end|>\n" for ChatML).
        self.turn_tail = probe[probe.rindex(_PROBE) + len(_PROBE) :]

    def render(
        self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool, template_kwargs=None
    ) -> str:
        """``template_kwargs``: more variables for the template (``enable_thinking``, ...)."""
        return self.tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            add_generation_prompt=generation_prompt,
            tokenize=False,
            **(template_kwargs or {}),
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None, template_kwargs=None) -> list[int]:
        return self.encode(self.render(messages, tools, True, template_kwargs))

    def continuation_ids(
        self,
        messages: list[dict],
        tools: list[dict] | None,
        upto: int,
        earlier: list[int],
        ended_with: list[int],
        template_kwargs=None,
    ) -> list[int] | None:
        """Prompt ids for ``messages`` when ``messages[: upto + 1]`` is an earlier
        exchange whose prompt + completion ids were ``earlier``; ``ended_with`` is
        that completion's last token (empty if none). None when the template
        renders the earlier turns differently once more messages follow (some
        templates drop earlier reasoning), so the prompt cannot be a verbatim
        extension and is tokenized afresh instead.
        """
        full = self.render(messages, tools, True, template_kwargs)
        prefix = self.render(messages[: upto + 1], tools, False, template_kwargs)
        if not full.startswith(prefix) or not prefix.endswith(self.turn_tail):
            return None
        produced = self.tokenizer.decode(ended_with, skip_special_tokens=False) if ended_with else ""
        # Drop what the completion already produced (its end-of-turn token) from the
        # tail, but only if it is that very token, not text that merely looks alike.
        same_token = self.encode(self.turn_tail)[: len(ended_with)] == list(ended_with)
        produced_tail = produced and same_token and self.turn_tail.startswith(produced)
        tail = self.turn_tail[len(produced) :] if produced_tail else self.turn_tail
        return earlier + self.encode(tail + full[len(prefix) :])
