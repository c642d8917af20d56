"""Publishing weights reaches every RolloutServer replica, and a replica that
restarts serves the latest version before it takes traffic (real Serve app,
two HF-engine replicas on tiny-random)."""

from __future__ import annotations

import time

import pytest
from safetensors.torch import load_file

from rlgate.config import parse_config
from rlgate.rollout.engines import SamplingParams
from rlgate.rollout.parity import _reference_logprobs
from tests.support import publish_perturbed

RUN = "policy-test"


@pytest.fixture(scope="module")
def replicas(ray_session):
    from ray import serve

    from rlgate.serving.app import build_rollout_app

    config = parse_config(
        {
            "model": {"name": "tiny-random"},
            "rollout": {"engine": "hf", "replicas": 2, "num_cpus": 0.5, "max_model_len": 512},
            "gateway": {"run_name": RUN},
        }
    )
    handle = serve.run(build_rollout_app(config), name=RUN, route_prefix=None)
    store = ray_session.get_actor(f"rlgate-{RUN}-policy", namespace="rlgate")
    yield handle, store
    serve.delete(RUN)
    ray_session.kill(store)


def generate(handle, prompt):
    chunks = list(
        handle.options(stream=True).generate.remote(
            prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True).model_dump()
        )
    )
    return (
        [t for c in chunks for t in c.token_ids],
        [lp for c in chunks for lp in c.logprobs],
        {v for c in chunks for v in c.versions},
    )


def serving(ray_session, store) -> dict[str, int]:
    return ray_session.get(store.status.remote())["serving"]


def test_both_replicas_report_what_they_serve(replicas, ray_session):
    _, store = replicas
    deadline = time.monotonic() + 60
    while len(serving(ray_session, store)) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert sorted(serving(ray_session, store).values()) == [0, 0]


def test_a_published_version_reaches_every_replica(replicas, ray_session, reference_model, prompts, tiny_path):
    handle, store = replicas
    stepped = publish_perturbed(ray_session, store, reference_model, version=1, replicas=2)
    for _ in range(8):  # calls spread over both replicas; every one serves version 1 with the new weights
        tokens, logprobs, versions = generate(handle, prompts[0])
        assert versions == {1}
        assert logprobs == pytest.approx(_reference_logprobs(stepped, prompts[0], tokens), abs=1e-4)
    with pytest.raises(ValueError, match="not newer than the published version 1"):
        ray_session.get(store.publish.remote(1, [ray_session.put(load_file(tiny_path / "model.safetensors"))]))


def test_a_restarted_replica_catches_up_before_serving(replicas, ray_session):
    _, store = replicas
    before = serving(ray_session, store)
    victim = next(iter(before))
    ray_session.kill(_replica_actor(ray_session, victim), no_restart=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        now = serving(ray_session, store)
        fresh = set(now) - set(before)
        if fresh:
            break
        time.sleep(1)
    else:
        pytest.fail("no replacement replica registered within 180 s")
    assert {now[r] for r in fresh} == {1}  # it loaded version 1 before reporting for duty


def _replica_actor(ray_session, unique_id: str):
    """The Serve replica actor whose id is ``unique_id`` (Serve names it ...#<id>)."""
    [entry] = [
        e
        for e in ray_session.util.list_named_actors(all_namespaces=True)
        if e["name"].startswith("SERVE_REPLICA") and e["name"].endswith(unique_id)
    ]
    return ray_session.get_actor(entry["name"], namespace=entry["namespace"])


async def test_a_killed_policy_store_comes_back_and_gets_its_weights_again(ray_session, tmp_path):
    """SIGKILL the PolicyStore: Ray restarts it in place with its version and who
    serves what (from its state file); the weights' reference died with it, so a
    replica behind waits for them instead of serving an older policy, and the
    trainer's Republisher, which kept the reference, publishes them again."""
    import asyncio
    import os
    import signal
    import uuid

    import ray

    from rlgate.actors.policy_store import Republisher, get_or_create_policy_store

    store = get_or_create_policy_store(f"policy-{uuid.uuid4().hex}", "rlgate", 0, str(tmp_path / "policy.json"))
    republisher = Republisher(store, every_s=0.2)
    try:
        weights = [ray_session.put({"w": 1})]
        await store.publish.remote(1, weights)
        await store.ack.remote("replica-a", 1)

        os.kill(await store.__ray_call__.remote(lambda self: os.getpid()), signal.SIGKILL)
        while True:  # a call that met the death fails, as a follower's does (it tries again)
            try:
                status = await store.status.remote()
                break
            except ray.exceptions.RayActorError:
                await asyncio.sleep(0.2)
        # back with its version and who serves what, knowing it lost the weights
        assert status == {"version": 1, "serving": {"replica-a": 1}, "weights_lost": True}
        # a replica restarting at version 0 waits for them rather than serve version 0's
        waiting = store.newer_than.remote(0, 0)
        done, _ = await asyncio.wait([asyncio.ensure_future(waiting)], timeout=2)
        assert not done, "a replica behind was answered while the weights were lost"

        republisher.published(1, weights)  # the trainer kept the reference: it publishes it again
        version, [ref] = await asyncio.wait_for(waiting, 30)
        assert version == 1 and await ref == {"w": 1}
        status = await store.status.remote()
        assert status["serving"] == {"replica-a": 1} and not status["weights_lost"]
        with pytest.raises(ValueError, match="not newer"):  # once they are back, a version is published once
            await store.publish.remote(1, weights)
        await store.publish.remote(2, [ray_session.put({"w": 2})])
    finally:
        republisher.stop()
        ray_session.kill(store)
