"""Reasoning out of model output text, by vLLM's reasoning parsers.

``[gateway] reasoning_parser`` names a parser of vLLM's registry (``qwen3``,
``deepseek_r1``, ...). A chat answer's text is split into ``reasoning_content``
and ``content`` (whole, or delta by delta while streaming); tool calls are then
parsed from the content. The token record is never touched: the trajectory
holds every sampled token, thinking included.

A parser is made per answer (vLLM's parsers keep streaming state) with the
request's ``chat_template_kwargs``: Qwen3's reads ``enable_thinking`` from them.
"""

from __future__ import annotations

from dataclasses import dataclass


def registered() -> list[str]:
    """The names vLLM's reasoning-parser registry holds (vLLM imported on first use)."""
    from vllm.reasoning import ReasoningParserManager

    return sorted(ReasoningParserManager.list_registered())


@dataclass
class Split:
    reasoning: str | None
    content: str


class ReasoningParser:
    def __init__(self, name: str, tokenizer) -> None:
        try:
            from vllm.reasoning import ReasoningParserManager
        except ImportError as err:
            raise ValueError(f"[gateway] reasoning_parser = {name!r} needs vLLM installed ({err})") from None
        if name not in ReasoningParserManager.list_registered():
            raise ValueError(f"[gateway] reasoning_parser: unknown parser {name!r}; vLLM has {', '.join(registered())}")
        self.name, self.tokenizer = name, tokenizer
        self.parser_class = ReasoningParserManager.get_reasoning_parser(name)
        try:
            parser = self._parser(None)
        except Exception as err:  # e.g. the model's tokenizer lacks the parser's <think> tokens
            raise ValueError(f"[gateway] reasoning_parser {name!r} cannot read this model's output: {err}") from None
        # kept in the text it reads even where the model's tokenizer marks them special
        self.markers = {m for m in (parser.reasoning_start_str, parser.reasoning_end_str) if m}

    def _parser(self, template_kwargs: dict | None):
        return self.parser_class(self.tokenizer, chat_template_kwargs=dict(template_kwargs or {}))

    def split(self, text: str, template_kwargs: dict | None) -> Split:
        reasoning, content = self._parser(template_kwargs).extract_reasoning(text, None)
        return Split(reasoning or None, content or "")

    def stream(self, template_kwargs: dict | None) -> ReasoningStream:
        return ReasoningStream(self._parser(template_kwargs))


class ReasoningStream:
    """One streamed answer: each piece of text (with its token ids) -> (reasoning delta, content delta)."""

    def __init__(self, parser) -> None:
        self.parser = parser
        self.text, self.ids = "", []

    def feed(self, delta: str, delta_ids: list[int]) -> tuple[str, str]:
        previous_text, previous_ids = self.text, self.ids
        self.text, self.ids = previous_text + delta, previous_ids + list(delta_ids)
        if not delta and not delta_ids:
            return "", ""
        message = self.parser.extract_reasoning_streaming(
            previous_text, self.text, delta, previous_ids, self.ids, list(delta_ids)
        )
        if message is None:  # held back (a marker in the making)
            return "", ""
        return message.reasoning or "", message.content or ""

    def finish(self) -> tuple[str, str]:
        """What the parser still holds at the end of the answer."""
        finish = getattr(self.parser, "finish_streaming", None)
        message = finish() if finish is not None else None
        if message is None:
            return "", ""
        return message.reasoning or "", message.content or ""
