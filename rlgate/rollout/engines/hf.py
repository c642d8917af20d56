"""HFEngine: the reference rollout engine on plain transformers.

Created by a RolloutServer replica when ``engine = "hf"`` (and by tests and
benchmarks as the parity reference); also the fallback where vLLM does not
install. It batches whatever requests are waiting, prefills them together
(left-padded) and decodes with a KV cache, one forward pass per step in a
worker thread so the event loop keeps streaming. Requests that arrive while
a batch runs join the next batch. Weights change only between steps, and a
batch that outlives a change is prefilled again (prompts and tokens so far)
on the new weights, so each token is exactly the version it is labelled with.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rlgate.rollout.engines.base import Engine, SamplingParams, TokenChunk, check_update, read_safetensors_specs

if TYPE_CHECKING:
    import torch


@dataclass
class _Row:
    """One completion being generated (a request with ``n`` > 1 has n rows)."""

    request_id: str
    index: int
    prompt: list[int]
    params: SamplingParams
    queue: asyncio.Queue
    generator: torch.Generator
    generated: list[int] = field(default_factory=list)
    done: bool = False
    cancelled: bool = False


class HFEngine(Engine):
    """Token-in, token-out generation on a transformers causal LM."""

    name = "hf"

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "float32",
        max_model_len: int = 2048,
        max_batch_size: int = 64,
        seed: int = 0,
        device: str = "cpu",
        initial_version: int = 0,
        adapter: str | Path | None = None,
    ) -> None:
        """``adapter``: a PEFT LoRA adapter folder merged in from the start, as ``initial_version``."""
        super().__init__(model_path, max_model_len, initial_version)
        self._initial_adapter = adapter
        self._pristine: dict | None = None  # the adapted weights as loaded, for merging each new adapter
        self._weights_loaded = 0  # counts weight loads: a batch's KV cache is of the count it began with
        self.dtype = dtype
        self.max_batch_size = max_batch_size
        self.device = device
        self.seed = seed
        self._expected = read_safetensors_specs(model_path)
        self._tied = "lm_head.weight" not in self._expected
        self._waiting: list[_Row] = []
        self._active: list[_Row] = []
        self._wake = asyncio.Event()
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._step_lock = asyncio.Lock()
        self._loop_task: asyncio.Task | None = None
        self.model = None
        self.tokenizer = None

    async def ready(self) -> None:
        if self.model is not None:
            return
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        def load():
            model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=getattr(torch, self.dtype))
            return model.to(self.device).eval(), AutoTokenizer.from_pretrained(self.model_path)

        self.model, self.tokenizer = await asyncio.to_thread(load)
        config = (
            json.loads((Path(self.model_path) / "generation_config.json").read_text())
            if (Path(self.model_path) / "generation_config.json").is_file()
            else {}
        )
        eos = config.get("eos_token_id", [])
        self._eos = set(eos if isinstance(eos, list) else [eos]) | {self.tokenizer.eos_token_id} - {None}
        self._seeder = torch.Generator().manual_seed(self.seed)
        if self._initial_adapter is not None:
            from rlgate.rollout.lora import Adapter

            await self._load_weights(await asyncio.to_thread(Adapter.read, self._initial_adapter))
        self._loop_task = asyncio.create_task(self._run())

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None
        self.model = None

    async def check_alive(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            raise RuntimeError("HFEngine's batching loop is not running")

    def running_requests(self) -> int:
        return len({row.request_id for row in self._waiting + self._active if not row.done})

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None, whole: bool = False
    ) -> AsyncIterator[TokenChunk]:
        import torch

        if self.model is None:
            raise RuntimeError("HFEngine used before ready()")
        params = self.check_request(prompt_ids, params)
        request_id = request_id or uuid.uuid4().hex
        queue: asyncio.Queue = asyncio.Queue()
        rows = []
        for index in range(params.n):
            seed = (
                params.seed + index
                if params.seed is not None
                else int(torch.randint(0, 2**62, (1,), generator=self._seeder))
            )
            rows.append(_Row(request_id, index, list(prompt_ids), params, queue, torch.Generator().manual_seed(seed)))
        self._waiting.extend(rows)
        self._wake.set()
        remaining = params.n
        try:
            while remaining:
                chunk = await queue.get()
                if isinstance(chunk, BaseException):
                    raise chunk
                remaining -= chunk.finish_reason is not None
                yield chunk
        finally:
            for row in rows:
                row.cancelled = True

    async def _set_paused(self, paused: bool) -> None:
        if paused:
            self._unpaused.clear()
            async with self._step_lock:  # let the step in flight finish
                pass
        else:
            self._unpaused.set()

    async def _load_weights(self, weights: Mapping[str, torch.Tensor] | str) -> int:
        from safetensors.torch import load_file

        from rlgate.rollout.lora import Adapter

        self._weights_loaded += 1  # paused: no step runs until the load is done
        if isinstance(weights, Adapter):
            return await asyncio.to_thread(self._merge, weights)
        if isinstance(weights, str):
            weights = await asyncio.to_thread(load_file, weights)
        self._pristine = None  # new base weights: merge later adapters into these
        names = check_update({name: tuple(t.shape) for name, t in weights.items()}, self._expected, self._tied)
        state = {name: weights[name] for name in names}
        # strict=False only because a tied lm_head is the embedding; check_update
        # has already verified the names are exactly the checkpoint's.
        await asyncio.to_thread(self.model.load_state_dict, state, strict=False)
        return len(state)

    def _merge(self, adapter) -> int:
        """Merge a LoRA adapter into the weights it adapts, over the weights as
        they were before any adapter (PEFT's ``merge_and_unload``, one version at a time)."""
        import torch

        deltas = adapter.deltas_for(self.model)
        params = dict(self.model.named_parameters())
        if self._pristine is None:
            self._pristine = {}
        for name in deltas:
            self._pristine.setdefault(name, params[name].detach().clone())
        with torch.no_grad():
            for name, base in self._pristine.items():
                delta = deltas.get(name)
                params[name].copy_(base if delta is None else (base.float() + delta).to(base.dtype))
        return len(deltas)

    # --- the batching loop ---------------------------------------------------

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            await asyncio.sleep(0.005)  # let a burst of concurrent requests arrive together
            self._wake.clear()
            self._waiting = [row for row in self._waiting if not row.cancelled]
            if not self._waiting:
                continue
            batch, self._waiting = self._waiting[: self.max_batch_size], self._waiting[self.max_batch_size :]
            if self._waiting:
                self._wake.set()
            try:
                await self._generate_batch(batch)
            except Exception as err:  # fail the batch's requests, keep serving
                for row in batch:
                    if not row.done:
                        row.queue.put_nowait(err)

    async def _generate_batch(self, rows: list[_Row]) -> None:
        import torch
        from transformers import DynamicCache

        self._active = rows
        live = list(range(len(rows)))  # batch position -> index into rows
        input_ids, mask, positions = self._prefill([row.prompt for row in rows])
        cache, cached = DynamicCache(), self._weights_loaded
        try:
            while True:
                await self._unpaused.wait()
                async with self._step_lock:
                    if not self._unpaused.is_set():
                        continue
                    if self._weights_loaded != cached:  # new weights: the cache is the old ones'
                        input_ids, mask, positions = self._prefill([rows[i].prompt + rows[i].generated for i in live])
                        cache, cached = DynamicCache(), self._weights_loaded
                    logits = await asyncio.to_thread(self._forward, input_ids, mask, positions, cache)
                    version = self.version
                next_tokens = []
                for slot, row_index in enumerate(live):
                    row, token = rows[row_index], None
                    if not row.cancelled:
                        try:
                            token = self._sample_and_emit(row, logits[slot], version)
                        except Exception as err:  # one bad row fails its own request, not the batch
                            row.done = True
                            row.queue.put_nowait(err)
                    next_tokens.append(token)
                keep = [slot for slot, token in enumerate(next_tokens) if token is not None]
                if not keep:
                    return
                if len(keep) < len(live):
                    index = torch.tensor(keep)
                    cache.reorder_cache(index)
                    mask, positions = mask[index], positions[index]
                    live = [live[slot] for slot in keep]
                input_ids = torch.tensor([[next_tokens[slot]] for slot in keep])
                mask = torch.cat([mask, torch.ones(len(keep), 1, dtype=mask.dtype)], dim=-1)
                positions = positions[:, -1:] + 1
        finally:
            self._active = []

    def _prefill(self, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input ids, attention mask and positions of ``sequences``, left-padded."""
        import torch

        width = max(len(sequence) for sequence in sequences)
        pad = self.tokenizer.pad_token_id or 0
        input_ids = torch.tensor([[pad] * (width - len(s)) + s for s in sequences])
        mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences])
        return input_ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)

    def _forward(self, input_ids, mask, positions, cache):
        import torch

        with torch.inference_mode():
            out = self.model(
                input_ids=input_ids.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=positions.to(self.device),
                past_key_values=cache,
                use_cache=True,
            )
        return out.logits[:, -1, :].float().cpu()

    def _sample_and_emit(self, row: _Row, logits: torch.Tensor, version: int) -> int | None:
        """Sample one token for ``row``, stream it, and return it (None when the row ends)."""
        import torch

        params = row.params
        logprobs = processed_logprobs(logits, params.temperature, params.top_k, params.top_p)
        if params.temperature == 0:
            token = int(torch.argmax(logprobs))
        else:
            token = int(torch.multinomial(logprobs.exp(), 1, generator=row.generator))
        row.generated.append(token)
        top = None
        if params.top_logprobs:
            values, ids = torch.topk(logprobs, params.top_logprobs)
            top = [{int(i): float(v) for i, v in zip(ids, values)}]
        finish, stop_reason = self._finish(row, token)
        row.done = finish is not None
        row.queue.put_nowait(
            TokenChunk(
                index=row.index,
                token_ids=[token],
                logprobs=[float(logprobs[token])],
                versions=[version],
                top_logprobs=top,
                finish_reason=finish,
                stop_reason=stop_reason,
            )
        )
        return None if row.done else token

    def _finish(self, row: _Row, token: int) -> tuple[str | None, str | int | None]:
        params = row.params
        if token in self._eos and not params.ignore_eos:
            return "stop", None
        if token in params.stop_token_ids:
            return "stop", token
        if params.stop:
            text = self.tokenizer.decode(row.generated, skip_special_tokens=True)
            for stop in params.stop:
                if stop in text:
                    return "stop", stop
        if len(row.generated) >= params.max_tokens or len(row.prompt) + len(row.generated) >= self.max_model_len:
            return "length", None
        return None, None


def processed_logprobs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Log-probabilities of the distribution sampled from: logits scaled by
    temperature (none when greedy), then top-k, then top-p masking.

    ``logits``: [vocab] float32. Masked entries are ``-inf``.
    """
    import torch

    scaled = logits / temperature if temperature > 0 else logits.clone()
    if top_k and top_k < scaled.numel():
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        order = torch.argsort(scaled, descending=True)
        probs = torch.softmax(scaled[order], dim=-1)
        # drop a token when the mass before it already reaches top_p
        drop = (probs.cumsum(-1) - probs) >= top_p
        scaled[order[drop]] = float("-inf")
    return torch.log_softmax(scaled, dim=-1)
