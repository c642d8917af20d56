"""Processes killed with SIGKILL under a live gateway (real HTTP, the official
openai client, tiny-random on the HF engine): the SessionStore and the
TrajectoryStore come back from disk; nothing acknowledged is lost or saved twice."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.support import gateway_fixture, replica_process

# room for the long answers the killed-replica test needs in flight at once
SETTINGS = {"model": {"name": "tiny-random"}, "rollout": {"engine": "hf", "max_model_len": 4096}}


faults = gateway_fixture("gw-faults", SETTINGS)


def kill_actor(ray_session, name: str) -> int:
    """SIGKILL the process of the run's named actor; returns its pid."""
    actor = ray_session.get_actor(f"rlgate-gw-faults-{name}", namespace="rlgate")
    pid = ray_session.get(actor.__ray_call__.remote(lambda self: os.getpid()))
    os.kill(pid, signal.SIGKILL)
    return pid


def killed_under(ray_session, name: str, flag: str, call):
    """``call()``'s answer when the run's actor ``name`` is SIGKILLed while the call is
    in it: once the actor's attribute ``flag`` (set by a patch the test put there) is true."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        in_flight = pool.submit(call)
        deadline = time.monotonic() + 60
        while not in_actor(ray_session, name, lambda actor: getattr(actor, flag)):
            assert time.monotonic() < deadline and not in_flight.done(), f"the call never reached the {name} actor"
            time.sleep(0.2)
        kill_actor(ray_session, name)
        return in_flight.result()


def session(app, key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def retrying(call, seconds: float = 120):
    """Call until it stops answering 503 (the actor behind it is being restarted)."""
    deadline = time.monotonic() + seconds
    while True:
        response = call()
        if response.status_code != 503 or time.monotonic() > deadline:
            return response
        assert "unavailable" in response.json()["error"]["message"] or "could not save" in response.text
        time.sleep(0.5)


def test_a_killed_session_store_resumes_every_open_session_from_its_journal(faults, ray_session):
    app = faults
    done, open_a, open_b = app.start_session("done"), app.start_session("a"), app.start_session("b")
    messages = [{"role": "user", "content": "hi"}]
    with openai.OpenAI(base_url=f"{app.url}/v1", api_key=open_a["api_key"], max_retries=0) as client:
        first = client.chat.completions.create(model="tiny-random", messages=messages, max_tokens=4)
    assert httpx.post(f"{app.url}/rl/set_reward", json={"reward": 0.25}, headers=session(app, open_a["api_key"]))
    for key in (done["api_key"], open_b["api_key"]):
        with openai.OpenAI(base_url=f"{app.url}/v1", api_key=key, max_retries=0) as client:
            client.chat.completions.create(model="tiny-random", messages=messages, max_tokens=4)
    assert httpx.post(f"{app.url}/rl/end_session", headers=session(app, done["api_key"])).status_code == 200

    # a call in flight at the kill: B's next turn, held inside the store as it records
    def hold_records(store):
        async def held(*args, **kwargs):
            store.holding = True
            await asyncio.sleep(3600)

        store.holding, store.owned.record = False, held

    in_actor(ray_session, "sessions", hold_records)
    refused = killed_under(ray_session, "sessions", "holding", lambda: chat(app, open_b["api_key"], "in flight"))
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["message"].startswith("session service unavailable: ")

    # A goes on where it was: the continuation of its first turn, a reward, the end
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "on"}]
    body = {"model": "tiny-random", "messages": messages, "max_tokens": 4}
    second = retrying(
        lambda: httpx.post(f"{app.url}/v1/chat/completions", json=body, headers=session(app, open_a["api_key"]))
    )
    assert second.status_code == 200, second.text
    assert httpx.post(
        f"{app.url}/rl/set_reward", json={"reward": 1.0}, headers=session(app, open_a["api_key"])
    ).is_success
    status = httpx.get(f"{app.url}/rl/status", headers=app.admin).json()
    assert status["sessions"]["open_sessions"] == 2 and status["capacity"]["running"] == 2  # A and B hold their slots
    # the ended session stays ended
    assert httpx.post(f"{app.url}/rl/end_session", headers=session(app, done["api_key"])).status_code == 410
    for key in (open_a["api_key"], open_b["api_key"]):
        assert httpx.post(f"{app.url}/rl/end_session", headers=session(app, key)).status_code == 200

    records = app.trajectories()
    by_session = {}
    for record in records:
        by_session.setdefault(record["task_id"], []).append(record)
    # B's turn that was in flight at the kill recorded nothing: B has its one turn from before
    assert sorted(by_session) == ["a", "b", "done"] and len(by_session["done"]) == 1 and len(by_session["b"]) == 1
    first_turn, second_turn = by_session["a"]  # a record per turn ("individual" export)
    # the second turn continued the first verbatim, across the crash
    assert second_turn["input_ids"][: len(first_turn["input_ids"])] == first_turn["input_ids"]
    # the reward set before the crash and the one after both count: 0.25 + 1.0 flows back to the first turn
    assert (first_turn["reward"], second_turn["reward"]) == (1.25, 1.0)
    status = httpx.get(f"{app.url}/rl/status", headers=app.admin).json()
    assert status["capacity"]["running"] == 0 and status["sessions"]["open_sessions"] == 0


def test_a_killed_trajectory_store_loses_nothing_and_saves_nothing_twice(faults, ray_session):
    app = faults
    before = len(app.trajectories())
    keys = [app.start_session(f"t{i}")["api_key"] for i in range(3)]
    for key in keys:
        with openai.OpenAI(base_url=f"{app.url}/v1", api_key=key, max_retries=0) as client:
            client.chat.completions.create(
                model="tiny-random", messages=[{"role": "user", "content": "x"}], max_tokens=4
            )
    assert httpx.post(f"{app.url}/rl/end_session", headers=session(app, keys[0])).status_code == 200

    kill_actor(ray_session, "trajectories")

    # an end while it is down answers 503 and keeps the session open; retried, it is saved once
    for key in keys[1:]:
        ended = retrying(lambda key=key: httpx.post(f"{app.url}/rl/end_session", headers=session(app, key)))
        assert ended.status_code == 200, ended.text
    records = app.trajectories()[before:]
    assert sorted(r["task_id"] for r in records) == ["t0", "t1", "t2"]
    assert [r["seq"] for r in records] == list(range(before + 1, before + 4))


def in_actor(ray_session, name: str, change):
    """Run ``change(actor_instance)`` inside the run's named actor."""
    import ray.cloudpickle

    import tests.support

    ray.cloudpickle.register_pickle_by_value(tests.support)  # the workers cannot import tests/
    actor = ray_session.get_actor(f"rlgate-gw-faults-{name}", namespace="rlgate")
    return ray_session.get(actor.__ray_call__.remote(change))


def chat(app, key: str, content: str = "x") -> httpx.Response:
    body = {"model": "tiny-random", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    return httpx.post(f"{app.url}/v1/chat/completions", json=body, headers=session(app, key), timeout=60)


def test_a_disk_that_fills_during_a_save_corrupts_nothing(faults, ray_session):
    """The TrajectoryStore's disk fills in the middle of a save: the end answers
    503 and keeps the session, nothing of the failed write stays in the log, and
    once there is space the retried end saves it, whole and once."""
    from tests.support import Disk

    app = faults
    before = len(app.trajectories())
    keys = [app.start_session(f"full{i}")["api_key"] for i in range(2)]
    for key in keys:
        assert chat(app, key).status_code == 200

    def fill(store):
        store.disk = Disk(room=100)  # part of the first line fits
        store.files.opener = store.disk.open

    in_actor(ray_session, "trajectories", fill)
    refused = httpx.post(f"{app.url}/rl/end_session", headers=session(app, keys[0]))
    assert refused.status_code == 503 and "could not save" in refused.json()["error"]["message"]
    assert httpx.get(f"{app.url}/rl/trajectories", headers=app.admin).status_code == 200
    in_actor(ray_session, "trajectories", lambda store: setattr(store.disk, "room", None))
    for key in keys:
        assert httpx.post(f"{app.url}/rl/end_session", headers=session(app, key)).status_code == 200
    records = app.trajectories()[before:]
    assert [r["task_id"] for r in records] == ["full0", "full1"]
    assert [r["seq"] for r in records] == list(range(before + 1, before + 3))
    assert in_actor(ray_session, "trajectories", lambda store: store.files.bad_lines) == 0


def test_a_journal_on_a_full_disk_refuses_the_turn_and_loses_nothing(faults, ray_session):
    """The SessionStore's disk fills: a turn that cannot be journaled answers 503
    and changes nothing; with space again the session goes on, and a restart
    replays every acknowledged turn (no fragment merges the next line away)."""
    from tests.support import Disk

    app = faults
    key = app.start_session("journal-full")["api_key"]
    assert chat(app, key, "one").status_code == 200

    def fill(store):
        journal = store.owned.manager.journal
        store.disk = Disk(room=30)
        journal._file = store.disk.wrap(journal._file)

    in_actor(ray_session, "sessions", fill)
    refused = chat(app, key, "two")
    assert refused.status_code == 503 and "journal cannot be written" in refused.json()["error"]["message"]
    in_actor(ray_session, "sessions", lambda store: setattr(store.disk, "room", None))
    assert chat(app, key, "three").status_code == 200

    kill_actor(ray_session, "sessions")
    ended = retrying(lambda: httpx.post(f"{app.url}/rl/end_session", headers=session(app, key)))
    assert ended.status_code == 200 and ended.json()["interaction_count"] == 2, ended.text
    assert len([r for r in app.trajectories() if r["task_id"] == "journal-full"]) == 2  # a record per turn


def test_a_session_saved_while_its_store_died_takes_no_more_turns(faults, ray_session):
    """The SessionStore dies while its end's save is reaching the disk. Restarted,
    it does not let the session take new turns (they would be lost: the save is
    there already and a retried end is deduplicated), and the end saves it once."""
    app = faults
    key = app.start_session("saved-in-crash")["api_key"]
    assert chat(app, key).status_code == 200

    def slow_saves(store):
        save = store.files.append

        def append_then_stall(records):
            seqs = save(records)
            time.sleep(10)  # on disk; the answer is late
            return seqs

        store.files.append = append_then_stall

    in_actor(ray_session, "trajectories", slow_saves)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        ending = pool.submit(httpx.post, f"{app.url}/rl/end_session", headers=session(app, key), timeout=60)
        deadline = time.monotonic() + 30
        while not [r for r in app.trajectories() if r["task_id"] == "saved-in-crash"]:
            assert time.monotonic() < deadline, "the save did not reach the disk"
            time.sleep(0.2)
        kill_actor(ray_session, "sessions")
        assert ending.result().status_code == 503
    in_actor(ray_session, "trajectories", lambda store: vars(store.files).pop("append") and None)

    turn = retrying(lambda: chat(app, key, "more"))
    assert turn.status_code == 409 and "end_session again" in turn.json()["error"]["message"], turn.text
    # (the store answers once its stalled save returns)
    assert httpx.post(f"{app.url}/rl/end_session", headers=session(app, key), timeout=60).status_code == 200
    saved = [r for r in app.trajectories() if r["task_id"] == "saved-in-crash"]
    assert len(saved) == 1 and len(saved[0]["interaction_ids"]) == 1


def test_a_killed_capacity_actor_comes_back_and_admission_stays_exact(faults, ray_session):
    """SIGKILL the CapacityActor with sessions open: Ray restarts it from its state
    file; the SessionStore reconciles its count on its next call, so a new session
    starts, and the books (sessions open = slots held) agree throughout."""
    app = faults

    def books() -> tuple[int, int]:
        status = httpx.get(f"{app.url}/rl/status", headers=app.admin, timeout=60).json()
        return status["sessions"]["open_sessions"], status["capacity"]["running"]

    before = books()
    keys = [app.start_session(f"cap{i}")["api_key"] for i in range(2)]

    # a call in flight at the kill: a start waiting for a slot (the actor admits nothing until it dies)
    def admit_nothing(capacity):
        def admits(*args):
            capacity.waiting = True
            return False

        capacity.waiting, capacity._admits = False, admits

    # the replica gives back the slots it leases (/rl/status has it do so): the next start asks the actor
    assert books() == (before[0] + 2, before[1] + 2)
    in_actor(ray_session, "capacity", admit_nothing)
    body = {"task_id": "cap2", "wait_s": 120}
    start = lambda: httpx.post(f"{app.url}/rl/start_session", json=body, headers=app.admin, timeout=180)  # noqa: E731
    started = killed_under(ray_session, "capacity", "waiting", start)
    assert started.status_code == 200, started.text  # it waited for the restart; nothing failed
    keys.append(started.json()["api_key"])
    assert books() == (before[0] + 3, before[1] + 3)
    for key in keys:
        assert httpx.post(f"{app.url}/rl/end_session", headers=session(app, key), timeout=60).status_code == 200
    assert books() == before


def test_a_killed_gateway_replica_loses_no_session(faults, ray_session):
    """SIGKILL the Gateway replica (split shape: sessions in the SessionStore): the
    requests that meet the dead replica get a 5xx from Serve's proxy; once Serve
    has started its successor the same session goes on verbatim and is saved whole."""
    app = faults
    started = app.start_session("gateway-kill")
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": "tiny-random", "messages": messages, "max_tokens": 4}
    url = f"{app.url}/v1/chat/completions"
    first = httpx.post(url, json=body, headers=session(app, started["api_key"]), timeout=60)
    assert first.status_code == 200, first.text

    os.kill(replica_process("gw-faults", "Gateway").pid, signal.SIGKILL)
    messages += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]}]
    body["messages"] = messages + [{"role": "user", "content": "on"}]
    seen, deadline = [], time.monotonic() + 180
    while True:
        try:
            second = httpx.post(url, json=body, headers=session(app, started["api_key"]), timeout=60)
            seen.append(second.status_code)
            if second.status_code < 500:
                break
        except httpx.TransportError as err:
            seen.append(err.__class__.__name__)
        assert time.monotonic() < deadline, f"no replica took over: {seen}"
        time.sleep(0.5)
    assert second.status_code == 200, (seen, second.text)
    before = len(app.trajectories())
    assert httpx.post(f"{app.url}/rl/end_session", headers=session(app, started["api_key"])).status_code == 200
    first_turn, second_turn = app.trajectories()[before:]
    assert second_turn["input_ids"][: len(first_turn["input_ids"])] == first_turn["input_ids"]


def stream_lines(url: str, body: dict, key: str, flowing: threading.Event) -> list[str]:
    """The stream's data lines; ``flowing`` is set once tokens arrive."""
    with httpx.stream("POST", url, json=body | {"stream": True}, headers=session(None, key), timeout=120) as response:
        assert response.status_code == 200
        lines = []
        for line in response.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
                if len(lines) >= 3:  # the role chunk, then tokens
                    flowing.set()
        return lines


def test_a_killed_rollout_replica_fails_its_requests_cleanly_and_returns_on_the_current_policy(
    faults, ray_session, tiny_path
):
    from safetensors.torch import load_file

    app = faults
    policy = ray_session.get_actor("rlgate-gw-faults-policy", namespace="rlgate")
    ray_session.get(policy.publish.remote(1, [ray_session.put(load_file(tiny_path / "model.safetensors"))]))
    assert ray_session.get(policy.wait_served.remote(1, 1, 120))  # the replica follows: it serves version 1
    streaming, whole = app.start_session("stream")["api_key"], app.start_session("whole")["api_key"]
    body = {"model": "tiny-random", "messages": [{"role": "user", "content": "go"}], "max_tokens": 4000}
    url = f"{app.url}/v1/chat/completions"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # The stream first: once its tokens flow, the HF engine's batch is the stream's alone and
        # the second request waits for it, so both are in flight when the replica dies. 4000 tokens
        # take long enough that the second one arrives first on a busy machine too (450 did not once,
        # with another test session's cluster on the same two cores); the kill ends both early
        flowing = threading.Event()
        streamed = pool.submit(stream_lines, url, body | {"ignore_eos": True}, streaming, flowing)
        assert flowing.wait(120), "the stream never started"
        answered = pool.submit(
            httpx.post, url, json=body | {"ignore_eos": True}, headers=session(app, whole), timeout=120
        )
        deadline = time.monotonic() + 60
        while app.rollout.health.remote().result()["running_requests"] < 2:
            early = answered.result() if answered.done() else None  # what it said, should it end first
            assert early is None, f"the non-streamed request ended first: {early.status_code} {early.text[:300]}"
            assert not streamed.done(), "the stream ended before the second request arrived"
            assert time.monotonic() < deadline, "the requests never ran together"
            time.sleep(0.05)
        os.kill(replica_process("gw-faults", "RolloutServer").pid, signal.SIGKILL)
        answer, lines = answered.result(), streamed.result()
    assert answer.status_code == 503 and "rollout engine" in answer.json()["error"]["message"]
    last = json.loads(lines[-1].removeprefix("data: "))
    # the stream ends cleanly
    assert last["error"]["code"] == "service_unavailable" and "rollout engine" in last["error"]["message"]

    # Serve replaces the replica (requests meanwhile wait for it, or get a 503); it catches up to
    # version 1 before it takes traffic; both sessions go on
    for key in (streaming, whole):
        again = retrying(
            lambda key=key: httpx.post(url, json=body | {"max_tokens": 4}, headers=session(app, key), timeout=300)
        )
        assert again.status_code == 200, again.text
    assert httpx.get(f"{app.url}/health").json()["policy_version"] == 1
    before = len(app.trajectories())
    for key in (streaming, whole):
        assert httpx.post(f"{app.url}/rl/end_session", headers=session(app, key)).status_code == 200
    records = app.trajectories()[before:]
    assert len(records) == 2  # the failed requests recorded nothing; the answered ones were recorded
    versions = [v for r in records for v, m in zip(r["versions"], r["loss_mask"]) if m]
    assert versions and set(versions) == {1}  # every sampled token came from version 1's weights


def test_a_restarted_application_ends_and_exports_the_sessions_it_had_open(faults, ray_session):
    """The whole application goes (its Serve app and every actor of the run) and is
    deployed again on the same run folder: the sessions it had open are ended and
    exported ("restart"), and their keys answer 410."""
    from ray import serve

    from rlgate.serving.app import build_app
    from rlgate.sessions.manager import hash_key

    app = faults
    key = app.start_session("orphan")["api_key"]
    body = {"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert httpx.post(f"{app.url}/v1/chat/completions", json=body, headers=session(app, key)).status_code == 200
    serve.delete("gw-faults")
    for name in ("sessions", "trajectories", "capacity", "policy"):
        ray_session.kill(ray_session.get_actor(f"rlgate-gw-faults-{name}", namespace="rlgate"))

    serve.run(build_app(app.config, hash_key(app.admin_key)), name="gw-faults", route_prefix="/gw-faults")
    deadline = time.monotonic() + 60
    while not [r for r in app.trajectories() if r["task_id"] == "orphan"]:  # /rl/trajectories wakes the store
        assert time.monotonic() < deadline, "the orphaned session was not exported"
        httpx.get(f"{app.url}/rl/status", headers=app.admin)
        time.sleep(0.5)
    [orphan] = [r for r in app.trajectories() if r["task_id"] == "orphan"]
    assert orphan["end_reason"] == "restart" and len(orphan["interaction_ids"]) == 1
    assert httpx.post(f"{app.url}/rl/end_session", headers=session(app, key)).status_code == 410
    status = httpx.get(f"{app.url}/rl/status", headers=app.admin).json()
    assert status["sessions"]["open_sessions"] == 0 and status["capacity"]["running"] == 0


def test_a_fresh_run_takes_over_nothing_an_earlier_run_of_its_name_left(ray_session, tmp_path, capsys):
    """A run started without --resume under an earlier run's name: the earlier
    run's PolicyStore, CapacityActor and SessionStore are gone (no weights, counts
    or sessions inherited) and its session journal is set aside, not replayed."""
    from rlgate.actors.capacity import get_or_create_capacity
    from rlgate.actors.policy_store import get_or_create_policy_store
    from rlgate.run import actor_name
    from rlgate.training.driver import forget_earlier_run

    run, run_dir = "fresh-run", tmp_path / "fresh-run"
    journal = run_dir / "sessions" / "journal.jsonl"
    journal.parent.mkdir(parents=True)
    journal.write_text('{"op": "open"}\n')

    @ray_session.remote
    class Sessions:  # stands in for the earlier run's SessionStore: what matters is its name
        pass

    earlier = [
        get_or_create_policy_store(actor_name(run, "policy"), "rlgate", 0),
        get_or_create_capacity(actor_name(run, "capacity"), "rlgate", 4),
        Sessions.options(name=actor_name(run, "sessions"), namespace="rlgate", lifetime="detached").remote(),
    ]
    ray_session.get([actor.__ray_ready__.remote() for actor in earlier])

    forget_earlier_run(run, run_dir)
    for actor, suffix in zip(earlier, ("policy", "capacity", "sessions")):  # gone, and its name freed
        with pytest.raises(ValueError):
            ray_session.get_actor(actor_name(run, suffix), namespace="rlgate")
        # and its process ends: its name is freed as it is marked dead, and a call this process sends
        # before it hears so may still be answered by the process not yet gone (seen once under load)
        deadline = time.monotonic() + 60
        with pytest.raises(ray_session.exceptions.RayActorError):
            while time.monotonic() < deadline:
                ray_session.get(actor.__ray_ready__.remote(), timeout=60)
                time.sleep(0.2)
    assert not journal.exists()
    [aside] = journal.parent.glob("journal-*.set-aside.jsonl")
    assert aside.read_text() == '{"op": "open"}\n' and str(aside) in capsys.readouterr().out
    forget_earlier_run(run, run_dir)  # nothing left to forget: nothing happens
    assert list(journal.parent.iterdir()) == [aside]
