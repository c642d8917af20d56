"""Completion ids to OpenAI-shaped text, logprobs and tool calls (pure; no Ray).

The engine returns token ids (including an end-of-turn or stop token the model
produced); clients get text. Text stops before a matched stop string, as
OpenAI's does; the recorded ids keep everything the model sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

from openai.types.chat import ChatCompletionTokenLogprob
from openai.types.chat.chat_completion_token_logprob import TopLogprob


def visible_text(
    tokenizer, token_ids: list[int], stop_reason: str | int | None, keep: frozenset[int] = frozenset()
) -> str:
    """The text a client sees: special tokens dropped (but those in ``keep``: a
    tool-call or reasoning marker the model's tokenizer marks special, which the
    parsers must see), cut before a stop string."""
    if keep:
        dropped = set(tokenizer.all_special_ids) - keep
        text = tokenizer.decode([t for t in token_ids if t not in dropped], skip_special_tokens=False)
    else:
        text = tokenizer.decode(token_ids, skip_special_tokens=True)
    if isinstance(stop_reason, str) and stop_reason in text:
        text = text[: text.index(stop_reason)]
    return text


class TextStream:
    """Incremental detokenisation for streaming.

    ``push(ids)`` returns the new text that is safe to send: an incomplete
    UTF-8 sequence at the end waits for its next token, and the last
    ``longest stop string - 1`` characters wait until it is clear they do not
    begin a stop string. ``finish(stop_reason)`` returns the rest, cut before a
    matched stop string. Everything returned concatenates to ``visible_text``.
    Text is returned a whole token at a time, and :attr:`released` holds the
    ids it came from (a parser that reads ids must see them in step with it).

    Each token costs a constant amount of work: fast tokenizers decode through
    ``tokenizers``' ``DecodeStream`` (a window of a few tokens, as vLLM's
    detokenizer does); re-decoding the whole completion per chunk made a long
    streamed completion quadratic on the gateway's event loop.
    """

    def __init__(self, tokenizer, stops: list[str], keep: frozenset[int] = frozenset()) -> None:
        """``keep``: special token ids whose text is kept (see :func:`visible_text`)."""
        from tokenizers.decoders import DecodeStream

        self.tokenizer, self.keep = tokenizer, keep
        self.dropped = set(tokenizer.all_special_ids) - keep if keep else set()
        self.ids: list[int] = []
        self.text = ""  # decoded so far (complete characters only)
        self.ends: list[int] = []  # len(text) once each id of ids was decoded
        self.sent = 0
        self.released: list[int] = []  # the ids whose text was returned by the last push or finish
        self._released_upto = 0
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in stops), default=1) - 1
        self._decoder = DecodeStream(skip_special_tokens=not keep) if tokenizer.is_fast else None

    def _decode(self, token_ids: list[int]) -> None:
        if self._decoder is None:  # a slow tokenizer: decode everything again
            # a multi-byte character not yet complete waits for its next token
            self.text = visible_text(self.tokenizer, self.ids, None, self.keep).rstrip("\ufffd")
            self.ends += [len(self.text)] * len(token_ids)
            return
        for token_id in token_ids:
            if token_id not in self.dropped:
                piece = self._decoder.step(self.tokenizer.backend_tokenizer, token_id)
                if piece:  # None while a character is incomplete
                    self.text += piece
            self.ends.append(len(self.text))

    def push(self, token_ids: list[int]) -> str:
        self.ids += token_ids
        self._decode(token_ids)
        text = self.text
        safe = len(text) - self.hold
        for stop in self.stops:  # never send a stop string, nor what follows it
            at = text.find(stop, self.sent)  # sent text holds no stop: the hold saw to that
            if at != -1:
                safe = min(safe, at)
        # whole tokens only: the text goes out with the ids it came from, in step for the parsers
        start = upto = self._released_upto
        while upto < len(self.ids) and self.ends[upto] <= safe:
            upto += 1
        self.released, self._released_upto = self.ids[start:upto], upto
        boundary = self.ends[upto - 1] if upto else 0
        if boundary <= self.sent:
            return ""
        delta, self.sent = text[self.sent : boundary], boundary
        return delta

    def finish(self, stop_reason: str | int | None) -> str:
        text = visible_text(self.tokenizer, self.ids, stop_reason, self.keep)
        delta = text[self.sent :]
        self.sent = len(text)
        self.released, self._released_upto = self.ids[self._released_upto :], len(self.ids)
        return delta


@dataclass
class TokenText:
    """Per-token display strings, cached per token id."""

    tokenizer: object

    def __post_init__(self) -> None:
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        if token_id not in self._cache:
            self._cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return self._cache[token_id]


def chat_logprobs(
    text_of: TokenText, token_ids: list[int], logprobs: list[float], top: list[dict[int, float]] | None
) -> list[ChatCompletionTokenLogprob]:
    entries = []
    for position, (token_id, logprob) in enumerate(zip(token_ids, logprobs)):
        alternatives = top[position] if top else {}
        entries.append(
            ChatCompletionTokenLogprob(
                token=text_of(token_id),
                logprob=logprob,
                bytes=list(text_of(token_id).encode()),
                top_logprobs=[
                    TopLogprob(token=text_of(t), logprob=lp, bytes=list(text_of(t).encode()))
                    for t, lp in sorted(alternatives.items(), key=lambda item: -item[1])
                ],
            )
        )
    return entries
