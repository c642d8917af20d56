"""One chat completion turn: generate, shape the OpenAI answer (whole or streamed), record it.

A :class:`Turn` is made by :meth:`rlgate.serving.service.GatewayService.chat`
once the session has begun the request; it ends in the session either
recorded (its interactions, with token ids, logprobs and versions as the
engine produced them) or abandoned (the client went away, the engine failed).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from openai.types import CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice, ChoiceLogprobs
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta, ChoiceDeltaToolCall, ChoiceDeltaToolCallFunction
from openai.types.chat.chat_completion_chunk import ChoiceLogprobs as ChunkLogprobs
from openai.types.chat.chat_completion_message_tool_call import ChatCompletionMessageToolCall, Function

from rlgate.rollout.engines import SamplingParams
from rlgate.rollout.engines.base import Completion
from rlgate.serving.chat import extend_key
from rlgate.serving.errors import HTTPError, broken_stream, sse_error
from rlgate.serving.openai_format import TextStream, chat_logprobs, visible_text
from rlgate.sessions.manager import SessionError
from rlgate.sessions.trajectory import Interaction

if TYPE_CHECKING:
    from rlgate.serving.service import GatewayService


async def chain(first: list, rest: AsyncIterator) -> AsyncIterator:
    for item in first:
        yield item
    async for item in rest:
        yield item


def choice_id(completion_id: str, index: int) -> str:
    """The interaction id of a choice: the completion id for the first (so
    ``set_reward(interaction_id=completion.id)`` works), suffixed for others."""
    return completion_id if index == 0 else f"{completion_id}-{index}"


class TurnStream:
    """A streamed turn's server-sent events (``events``, made by :meth:`Turn.stream`
    from the engine's ``chunks``) that can be closed whether or not they ever
    started: a client gone while the response begins leaves a generator that
    never ran, whose own ``finally`` would never run either. ``aclose`` stops the
    engine's request and settles the turn in its session in any case
    (``routes.ClosingStream`` calls it however the response ends)."""

    def __init__(self, turn: Turn, events: AsyncIterator[str], chunks: AsyncIterator) -> None:
        self.turn, self.events, self.chunks = turn, events, chunks

    def __aiter__(self) -> AsyncIterator[str]:
        return self.events

    async def aclose(self) -> None:
        try:
            await self.events.aclose()
            await self.chunks.aclose()
        finally:
            self.turn.settle()


class Turn:
    """One chat completion request: generate, shape the answer, record the interactions."""

    def __init__(
        self,
        service: GatewayService,
        request,
        params,
        session_id,
        prompt_ids,
        parent_id,
        messages_key,
        tools: list[dict] | None,
        id_prefix: str = "chatcmpl-",
    ):
        """``tools``: the request's tools when its answer is parsed for calls, else None."""
        self.g, self.request, self.params = service, request, params
        self.session_id, self.prompt_ids, self.parent_id = session_id, prompt_ids, parent_id
        self.messages_key, self.tools = messages_key, tools
        self.id = id_prefix + secrets.token_hex(12)
        self.created = int(time.time())
        self.recorded = False
        self.settled = False  # handed to the session's record (taken or refused), or given back (``settle``)

    def settle(self) -> None:
        """The request is over: unless it was recorded, it no longer counts as in
        flight in its session. Idempotent: a stream settles from its own end and
        from its response's."""
        if not self.settled:
            self.g.sessions.abandon(self.session_id)
        self.settled = True

    def _answer(self, text: str):
        """(reasoning, content, tool calls) as returned to the client."""
        reasoning = None
        if self.g.reasoning is not None:
            split = self.g.reasoning.split(text, self.request.chat_template_kwargs)
            reasoning, text = split.reasoning, split.content
        if self.tools is None:
            return reasoning, text, []
        parsed = self.g.tool_parser.parse(text, self.tools)
        return reasoning, parsed.content, parsed.tool_calls

    def _interaction(self, completion, content, calls) -> Interaction:
        message = {
            "role": "assistant",
            "content": content,
            "tool_calls": [{"function": {"name": c.name, "arguments": c.arguments}} for c in calls],
        }
        return Interaction(
            id=choice_id(self.id, completion.index),
            prompt_ids=self.prompt_ids,
            completion_ids=completion.token_ids,
            logprobs=completion.logprobs,
            versions=completion.versions,
            finish_reason=completion.finish_reason,
            parent=self.parent_id,
            key=extend_key(self.messages_key, message),
            temperature=self.params.temperature,  # as sampled (after the engines' floors)
            adapter=completion.adapter,
        )

    def _finish_reason(self, completion, calls) -> str:
        if calls:
            return "tool_calls"
        return "length" if completion.finish_reason == "length" else "stop"

    async def complete(self, params: SamplingParams) -> ChatCompletion:
        completions = await self.g.engine.generate_all(self.prompt_ids, params)
        choices, interactions = [], []
        for c in completions:
            text = visible_text(self.g.tokenizer, c.token_ids, c.stop_reason, self.g.kept_special)
            reasoning, content, calls = self._answer(text)
            interactions.append(self._interaction(c, content, calls))
            logprobs = None
            if self.request.logprobs:
                logprobs = ChoiceLogprobs(
                    content=chat_logprobs(self.g.text_of, c.token_ids, c.logprobs, c.top_logprobs)
                )
            message = ChatCompletionMessage(
                role="assistant",
                content=content,
                tool_calls=[
                    ChatCompletionMessageToolCall(
                        id=t.id, type="function", function=Function(name=t.name, arguments=t.arguments)
                    )
                    for t in calls
                ]
                or None,
            )
            if self.g.reasoning is not None:  # the model's thinking, apart (as vLLM's reasoning parsers give it)
                message.reasoning_content = reasoning
            finish = self._finish_reason(c, calls)
            # stop_reason, vLLM's extension: the stop string or token id that ended the choice
            choice = Choice(index=c.index, message=message, finish_reason=finish, logprobs=logprobs)
            choice.stop_reason = c.stop_reason
            choices.append(choice)
        self.settled = True  # a record ends the request's flight in the session, whether it is taken or refused
        await self.g.sessions.record(self.session_id, interactions)
        self.recorded = True
        generated = sum(len(c.token_ids) for c in completions)
        return ChatCompletion(
            id=self.id,
            object="chat.completion",
            created=self.created,
            model=self.g.settings.served_model_name,
            choices=choices,
            usage=CompletionUsage(
                prompt_tokens=len(self.prompt_ids),
                completion_tokens=generated,
                total_tokens=len(self.prompt_ids) + generated,
            ),
        )

    def _chunk(self, choices, usage=None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id,
            object="chat.completion.chunk",
            created=self.created,
            model=self.g.settings.served_model_name,
            choices=choices,
            usage=usage,
        )

    async def stream(self, params: SamplingParams, chunks: AsyncIterator) -> AsyncIterator[str]:
        """OpenAI's server-sent events for :meth:`chunks`, then ``[DONE]``; an error
        after the stream began is one last event in OpenAI's error shape."""
        try:
            async for chunk in self.chunks(params, chunks):
                yield f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"
            yield "data: [DONE]\n\n"
        except (HTTPError, SessionError) as err:
            yield sse_error(err)
        except Exception as err:  # a parser's or the engine's own error: the stream still ends with one
            yield sse_error(broken_stream(err))
        finally:  # also when the client goes away mid-stream
            self.settle()

    async def chunks(self, params: SamplingParams, chunks: AsyncIterator) -> AsyncIterator[ChatCompletionChunk]:
        """The answer as chunks from the engine's ``chunks``: text as tokens arrive, tool
        calls once complete, the interactions recorded before the usage chunk. A
        refusal after the first chunk (engine or session down) is raised."""
        n = params.n
        texts = [TextStream(self.g.tokenizer, list(params.stop), self.g.kept_special) for _ in range(n)]
        calls_stream = [self.g.tool_parser.stream(self.tools) if self.tools is not None else None for _ in range(n)]
        reasoning = self.g.reasoning
        thinking = [reasoning.stream(self.request.chat_template_kwargs) if reasoning else None for _ in range(n)]
        done = [Completion(index=i) for i in range(n)]
        sent = [""] * n  # content already streamed, per choice
        try:
            for i in range(n):
                yield self._chunk([ChunkChoice(index=i, delta=ChoiceDelta(role="assistant", content=""))])
            async for chunk in chunks:
                i = chunk.index
                done[i].add(chunk)
                # the parsers get the ids whose text they get: a stop string's hold delays both
                text = texts[i].push(chunk.token_ids)
                ids = texts[i].released
                if chunk.finish_reason is not None:
                    text += texts[i].finish(chunk.stop_reason)
                    ids = ids + texts[i].released
                thought = ""
                if thinking[i] is not None:
                    thought, text = thinking[i].feed(text, ids)
                    if chunk.finish_reason is not None:
                        held_thought, held_text = thinking[i].finish()
                        thought, text = thought + held_thought, text + held_text
                pieces = calls_stream[i].feed(text, ids) if calls_stream[i] else [text]
                logprobs = None
                if self.request.logprobs:
                    logprobs = ChunkLogprobs(
                        content=chat_logprobs(self.g.text_of, chunk.token_ids, chunk.logprobs, chunk.top_logprobs)
                    )
                content = "".join(pieces)
                sent[i] += content
                if content or logprobs or thought:
                    delta = ChoiceDelta(content=content or (None if thought else ""))
                    if thought:
                        delta.reasoning_content = thought
                    yield self._chunk([ChunkChoice(index=i, delta=delta, logprobs=logprobs)])
            interactions = []
            for i, completion in enumerate(done):
                if calls_stream[i]:
                    parsed = calls_stream[i].finish()
                    content, calls = parsed.content, parsed.tool_calls
                    rest = (content or "")[len(sent[i]) :]  # text the parser held back until the end
                    if rest:
                        yield self._chunk([ChunkChoice(index=i, delta=ChoiceDelta(content=rest))])
                else:  # recorded as sent: what the client sends back next turn (a parser's streamed
                    # split may differ from its split of the whole text)
                    content, calls = sent[i], []
                interactions.append(self._interaction(completion, content, calls))
                if calls:
                    yield self._chunk(
                        [
                            ChunkChoice(
                                index=i,
                                delta=ChoiceDelta(
                                    tool_calls=[
                                        ChoiceDeltaToolCall(
                                            index=k,
                                            id=t.id,
                                            type="function",
                                            function=ChoiceDeltaToolCallFunction(name=t.name, arguments=t.arguments),
                                        )
                                        for k, t in enumerate(calls)
                                    ]
                                ),
                            )
                        ]
                    )
                finish = self._finish_reason(completion, calls)
                stop = completion.stop_reason
                ending = ChunkChoice(index=i, delta=ChoiceDelta(), finish_reason=finish, stop_reason=stop)
                yield self._chunk([ending])
            self.settled = True  # as in complete(): the record settles the request either way
            await self.g.sessions.record(self.session_id, interactions)
            self.recorded = True
            options = self.request.stream_options
            if options is not None and options.include_usage:  # as OpenAI: a usage chunk only when asked for
                generated = sum(len(c.token_ids) for c in done)
                usage = CompletionUsage(
                    prompt_tokens=len(self.prompt_ids),
                    completion_tokens=generated,
                    total_tokens=len(self.prompt_ids) + generated,
                )
                yield self._chunk([], usage=usage)
        finally:  # also when the client goes away mid-stream
            self.settle()
