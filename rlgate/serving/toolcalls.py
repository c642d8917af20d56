"""Tool calls out of model output text, whole or streamed.

The gateway turns what the model wrote into an OpenAI response: ``content``
plus ``tool_calls``. The token record is never touched; this only reads text.

One convention is implemented, Hermes/Qwen (also the one ``tiny-random``'s
template renders)::

    Let me look.
    <tool_call>{"name": "search", "arguments": {"q": "ray"}}</tool_call>

A *block* is ``<tool_call>``, then text holding neither ``<tool_call>`` nor
``</tool_call>``, then ``</tool_call>``. It is a call when the text between the
tags, stripped of whitespace, is a JSON object with a non-empty string
``"name"`` and an ``"arguments"`` object (``"parameters"`` is read as a
synonym, a JSON string holding an object is accepted, and a missing one means
``{}``). Anything else -- a malformed block, an unclosed one cut by
``max_tokens``, a stray tag -- stays in ``content`` verbatim, so nothing the
model wrote is lost. Arguments that contain a literal tag cannot be written in
this convention (the block ends at the first ``</tool_call>``), as in every
Hermes parser.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Protocol

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_DECODER = json.JSONDecoder()


@dataclass
class ToolCall:
    """One call, as OpenAI returns it: ``arguments`` is the JSON text of an object."""

    id: str
    name: str
    arguments: str


@dataclass
class ParsedOutput:
    """``content`` is None when there are tool calls and no other text."""

    content: str | None
    tool_calls: list[ToolCall]


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class ToolCallStream(Protocol):
    def feed(self, delta: str, delta_ids=()) -> list[str]: ...

    def finish(self) -> ParsedOutput: ...


class ToolCallParser(Protocol):
    def parse(self, text: str, tools: list[dict] | None = None) -> ParsedOutput: ...

    def stream(self, tools: list[dict] | None = None) -> ToolCallStream: ...


def _call_from_json(inner: str) -> ToolCall | None:
    """The call the text between the tags spells, or None if it is malformed."""
    try:
        obj = json.loads(inner.strip())
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than json allows
        return None
    return _call_from_object(obj)


def _call_from_object(obj: object) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    try:  # NaN and Infinity (1e999) parse, but are not JSON a client can read back
        arguments = json.dumps(args, ensure_ascii=False, allow_nan=False)
    except ValueError:
        return None
    return ToolCall(id=new_call_id(), name=name, arguments=arguments)


def _held_tag_prefix(text: str, start: int) -> int:
    """Length of the longest suffix of ``text[start:]`` that is a proper prefix of OPEN."""
    for size in range(min(len(OPEN) - 1, len(text) - start), 0, -1):
        if text.endswith(OPEN[:size]):
            return size
    return 0


class _Scanner:
    """Cuts a growing text into content pieces and calls, deciding only what is final.

    ``advance(final=False)`` decides as far as no later text can change the
    answer; ``advance(final=True)`` decides the rest. Every decision taken
    early is the one the whole text leads to, so parsing at once and parsing
    in pieces agree.
    """

    def __init__(self, text: str = "") -> None:
        self.text = text
        self.pos = 0  # everything before pos is decided

    def advance(self, final: bool) -> list[str | ToolCall]:
        text, out = self.text, []
        while True:
            start = text.find(OPEN, self.pos)
            if start < 0:
                end = len(text) if final else len(text) - _held_tag_prefix(text, self.pos)
                if end > self.pos:
                    out.append(text[self.pos : end])
                self.pos = end
                return out
            if start > self.pos:
                out.append(text[self.pos : start])
            self.pos = start
            body = start + len(OPEN)
            call, decided = self._block(body, final)
            if not decided:
                return out
            if call is None:  # not a call: the tag is text, and what follows it is read afresh
                out.append(OPEN)
                self.pos = body
            else:
                out.append(call)
                close = text.find(CLOSE, body)
                self.pos = close + len(CLOSE) if close >= 0 else len(text)  # unclosed: the last call

    def _block(self, body: int, final: bool) -> tuple[ToolCall | None, bool]:
        """(the call, whether decided) for the block whose text begins at ``body``."""
        text = self.text
        close, reopen = text.find(CLOSE, body), text.find(OPEN, body)
        if close >= 0 and (reopen < 0 or close < reopen):
            return _call_from_json(text[body:close]), True
        if reopen >= 0:  # a block inside a block
            return None, True
        if final:  # never closed: a call when the rest is one (an agent's stop=["</tool_call>"]
            # cuts the tag off), else text
            return _call_from_json(text[body:]), True
        # Still open. Decide early only where no continuation can make it a
        # call, so that the text after the tag is not held back for nothing.
        first = body
        while first < len(text) and text[first].isspace():
            first += 1
        if first == len(text):
            return None, False
        if text[first] != "{":
            return None, True
        try:
            obj, end = _DECODER.raw_decode(text, first)
        except (ValueError, RecursionError):  # incomplete, or broken: only a tag or the end tells
            return None, False
        # A complete object cannot change, and no tag can begin inside it (no
        # prefix of a tag ends in "}"): what follows decides.
        while end < len(text) and text[end].isspace():
            end += 1
        if _call_from_object(obj) is None or not CLOSE.startswith(text[end:]):
            return None, True
        return None, False


def _assemble(pieces: list[str | ToolCall]) -> ParsedOutput:
    calls = [piece for piece in pieces if isinstance(piece, ToolCall)]
    content = "".join(piece for piece in pieces if isinstance(piece, str))
    if not calls:  # leading whitespace is not content (a reasoning model's "\n\n" after its thinking)
        return ParsedOutput(content=content.lstrip(), tool_calls=[])
    return ParsedOutput(content=content.strip() or None, tool_calls=calls)


class HermesStream:
    """Incremental Hermes parsing for a streamed response.

    ``feed(delta)`` returns the content that can be sent to the client now
    (a list of non-empty strings, often empty); ``finish()`` returns the
    result for the whole text, equal to ``HermesToolParser().parse(text)``
    but for the call ids (those decided while streaming keep theirs).

    Contract: the concatenation of everything ``feed`` returned is always a
    prefix of ``finish().content`` (of ``""`` when that is None). Sent text
    cannot be taken back, so ``feed`` holds back whatever may still change:

    * a trailing piece that may start ``<tool_call>`` (``<``, ``<tool``);
    * everything from an open ``<tool_call>`` until it is known to be a call
      (its ``</tool_call>`` arrived) or known not to be one (its text cannot
      begin a JSON object, the object is complete but not a call, or text
      other than ``</tool_call>`` follows it); broken JSON inside an open
      block is held until a tag or the end;
    * trailing whitespace, which the final content strips if calls follow
      (leading whitespace is never content: the stream starts at the first
      other character).

    ``tool_calls`` lists the calls decided so far, for streaming them.
    """

    def __init__(self) -> None:
        self._scanner = _Scanner()
        self._pieces: list[str | ToolCall] = []
        self._outside = ""  # decided content so far, calls left out
        self._first = -1  # index in _outside of the first non-space character
        self._last = 0  # index in _outside after the last non-space character
        self._sent = 0  # _outside[:_sent] (from _first once calls exist) has been returned
        self._has_calls = False
        self._result: ParsedOutput | None = None

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [piece for piece in self._pieces if isinstance(piece, ToolCall)]

    def feed(self, delta: str, delta_ids=()) -> list[str]:
        if self._result is not None:
            raise RuntimeError("feed() after finish()")
        self._scanner.text += delta
        return self._take(self._scanner.advance(final=False))

    def finish(self) -> ParsedOutput:
        if self._result is None:
            self._pieces.extend(self._scanner.advance(final=True))
            self._result = _assemble(self._pieces)
        return self._result

    def _take(self, pieces: list[str | ToolCall]) -> list[str]:
        self._pieces.extend(pieces)
        for piece in pieces:
            if isinstance(piece, ToolCall):
                self._has_calls = True
                continue
            kept = piece.rstrip()
            if kept:
                if self._first < 0:
                    self._first = len(self._outside) + len(piece) - len(piece.lstrip())
                self._last = len(self._outside) + len(kept)
            self._outside += piece
        if self._first < 0:
            return []
        self._sent = max(self._sent, self._first)
        if self._last <= self._sent:
            return []
        out = self._outside[self._sent : self._last]
        self._sent = self._last
        return [out]


# Constrained JSON may hold at most this many whitespace characters in a row: a
# small model cannot loop on whitespace until max_tokens, and pretty-printed
# JSON (a newline and an indent) still fits.
MAX_JSON_WHITESPACE = 8


def json_format(schema: dict) -> dict:
    """JSON following ``schema``, as an xgrammar structural-tag format."""
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_JSON_WHITESPACE}


def structural_tag(form: dict) -> str:
    return json.dumps({"type": "structural_tag", "format": form})


class HermesToolParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen)."""

    markers = (OPEN, CLOSE)  # kept in the text it reads even where the tokenizer marks them special

    def parse(self, text: str, tools: list[dict] | None = None) -> ParsedOutput:
        """Content and calls of a whole output (``tools`` is not needed to read them).

        With no calls, content is ``text`` without its leading whitespace; with
        calls, it is the text outside them, stripped, or None if that is empty.
        """
        return _assemble(_Scanner(text).advance(final=True))

    def stream(self, tools: list[dict] | None = None) -> HermesStream:
        return HermesStream()

    @staticmethod
    def forced(tools: list[dict], name: str | None, one: bool) -> str:
        """A structural tag for vLLM's structured outputs that makes the whole output
        calls in this format: of ``name`` only when given, else of any of ``tools``;
        one call when ``one``, else one or more (separated by a newline). Each
        call's arguments follow its tool's JSON schema."""
        tags = [
            {
                "type": "tag",
                "begin": OPEN + '{"name": ' + json.dumps(tool["function"]["name"]) + ', "arguments": ',
                "content": json_format(tool["function"].get("parameters") or {"type": "object"}),
                "end": "}" + CLOSE,
            }
            for tool in tools
            if name is None or tool["function"]["name"] == name
        ]
        calls = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True}
        return structural_tag(calls | {"stop_after_first": one})


class VllmToolParser:
    """A tool parser of vLLM's registry (``llama3_json``, ``mistral``, ``pythonic``,
    ``qwen3_coder``, ...), behind the same interface as :class:`HermesToolParser`.

    vLLM's parsers take a vLLM request (made once, from the tools of each
    request) and keep streaming state, so one is made per answer. Streamed,
    the content vLLM's parser releases is sent as it comes and the calls are
    those of the whole text, sent once complete (as for Hermes)."""

    forced = None  # constraining calls to a vLLM parser's format is not offered

    def __init__(self, name: str, tokenizer) -> None:
        try:
            from vllm.tool_parsers import ToolParserManager
        except ImportError as err:
            raise ValueError(f"[gateway] tool_parser = {name!r} needs vLLM installed ({err})") from None
        self.name, self.tokenizer = name, tokenizer
        known = sorted(ToolParserManager.list_registered())
        if name not in known:
            raise ValueError(f"[gateway] tool_parser: unknown parser {name!r}; hermes, none, auto, or vLLM's {known}")
        self.parser_class = ToolParserManager.get_tool_parser(name)
        try:
            parser = self.parser_class(tokenizer)
        except Exception as err:  # e.g. the model's tokenizer lacks the parser's markers
            raise ValueError(f"[gateway] tool_parser {name!r} cannot read this model's output: {err}") from None
        # What the parser looks for (vLLM's parsers name them ``*_token``, on the class or
        # the instance): kept in the text it reads even where the tokenizer marks them special.
        self.markers = set()
        for attribute in dir(parser):
            if attribute.endswith("_token") and not attribute.startswith("__"):
                value = getattr(parser, attribute, None)
                if isinstance(value, str) and value:
                    self.markers.add(value)

    def _request(self, tools: list[dict] | None):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        body = {"model": "m", "messages": [{"role": "user", "content": ""}], "tools": tools or None}
        return ChatCompletionRequest.model_validate(body)

    def parse(self, text: str, tools: list[dict] | None = None) -> ParsedOutput:
        return self._extract(text, self._request(tools))

    def _extract(self, text: str, request) -> ParsedOutput:
        parser = self.parser_class(self.tokenizer)
        found = parser.extract_tool_calls(text, parser.adjust_request(request))
        if not found.tools_called:
            return ParsedOutput(content=text, tool_calls=[])
        calls = [
            ToolCall(id=new_call_id(), name=call.function.name, arguments=call.function.arguments or "{}")
            for call in found.tool_calls
        ]
        return ParsedOutput(content=(found.content or "").strip() or None, tool_calls=calls)

    def stream(self, tools: list[dict] | None = None) -> VllmToolStream:
        return VllmToolStream(self, tools)


class VllmToolStream:
    def __init__(self, owner: VllmToolParser, tools: list[dict] | None) -> None:
        self.owner = owner
        self.parser = owner.parser_class(owner.tokenizer)
        self.request = self.parser.adjust_request(owner._request(tools))
        self.text, self.ids, self.sent = "", [], ""

    def feed(self, delta: str, delta_ids: list[int] = ()) -> list[str]:
        if not self.text:
            # Leading whitespace is never the answer's (as for Hermes), and vLLM's streaming parsers look for a
            # call at the text's very start (llama3_json: "{"), where their whole-text parsers search all of it.
            delta = delta.lstrip()
            if not delta:
                return []
        previous_text, previous_ids = self.text, self.ids
        self.text, self.ids = previous_text + delta, previous_ids + list(delta_ids)
        if not delta:
            return []
        message = self.parser.extract_tool_calls_streaming(
            previous_text, self.text, delta, previous_ids, self.ids, list(delta_ids), self.request
        )
        content = (message.content if message is not None else None) or ""
        if not content or not self.text.startswith(self.sent + content):
            return []  # only text that is the answer's own, in order, is sent
        self.sent += content
        return [content]

    def finish(self) -> ParsedOutput:
        """The calls of the whole text; the content is exactly what was streamed (the
        client has it, and sends it back), or the whole text when it held no call."""
        whole = self.owner._extract(self.text, self.request)
        if not whole.tool_calls:
            return whole
        if self.sent.strip() and self.sent.strip() == self.text.strip():
            # vLLM's streaming parser let the whole answer through as text, where its whole-text parser reads a
            # call (llama3_json: words, then the JSON): the client has it as content, as vLLM's server streams it
            return ParsedOutput(content=self.sent, tool_calls=[])
        return ParsedOutput(content=self.sent if self.sent.strip() else None, tool_calls=whole.tool_calls)


def get_parser(name: str, tokenizer=None) -> ToolCallParser:
    """rlgate's ``hermes`` (it keeps text after a call, which vLLM's drops), else
    the parser of vLLM's registry by that name (``vllm:hermes`` for vLLM's own)."""
    if name == "hermes":
        return HermesToolParser()
    return VllmToolParser(name.removeprefix("vllm:"), tokenizer)


# Markers of tool-call formats in chat templates, and vLLM's parser for each.
_TEMPLATE_MARKERS = [
    ("<function=", "qwen3_coder"),  # Qwen3-Coder: XML calls inside <tool_call>
    (OPEN, "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3_json"),
]


def detect_parser(chat_template: str | None) -> str | None:
    """The parser for a model's chat template, or None if it has no tool call format it knows."""
    for marker, name in _TEMPLATE_MARKERS:
        if chat_template and marker in chat_template:
            return name
    return None
