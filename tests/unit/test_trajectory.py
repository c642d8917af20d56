"""SessionTrajectory: the interaction tree, discounted returns and both export styles."""

from __future__ import annotations

import math
import random

import pytest

from rlgate.sessions.trajectory import NO_VERSION, Interaction, SessionTrajectory


def make(id, prompt, completion, parent=None, reward=None, key=None, logprobs=None, versions=None, finish="stop"):
    return Interaction(
        id=id,
        prompt_ids=list(prompt),
        completion_ids=list(completion),
        logprobs=logprobs if logprobs is not None else [-0.5] * len(completion),
        versions=versions if versions is not None else [0] * len(completion),
        finish_reason=finish,
        parent=parent,
        reward=reward,
        key=key,
    )


def linear_session() -> SessionTrajectory:
    """Three turns; rewards on turns 2 and 3 only."""
    t = SessionTrajectory("s1", "task-a")
    t.add(make("a", [1, 2, 3], [10, 11], logprobs=[-0.1, -0.2], versions=[1, 1]))
    t.add(make("b", [1, 2, 3, 10, 11, 4, 5], [12], parent="a", reward=1.0, logprobs=[-0.3], versions=[2]))
    t.add(
        make(
            "c",
            [1, 2, 3, 10, 11, 4, 5, 12, 6],
            [13, 14],
            parent="b",
            reward=4.0,
            logprobs=[-0.4, -0.5],
            versions=[2, 3],
            finish="length",
        )
    )
    return t


def test_linear_individual_export():
    samples = linear_session().export("individual", turn_discount=0.5)
    # c = 4; b = 1 + 0.5 * 4 = 3; a = 0 (no reward) + 0.5 * 3 = 1.5
    assert [s.interaction_ids for s in samples] == [["a"], ["b"], ["c"]]
    assert [s.rewards for s in samples] == [[1.5], [3.0], [4.0]]
    assert [s.reward for s in samples] == [1.5, 3.0, 4.0]
    a = samples[0]
    assert (a.session_id, a.task_id, a.style) == ("s1", "task-a", "individual")
    assert a.input_ids == [1, 2, 3, 10, 11]
    assert a.loss_mask == [0, 0, 0, 1, 1]
    assert a.logprobs == [0.0, 0.0, 0.0, -0.1, -0.2]
    assert a.versions == [NO_VERSION, NO_VERSION, NO_VERSION, 1, 1]
    c = samples[2]
    assert c.input_ids == [1, 2, 3, 10, 11, 4, 5, 12, 6, 13, 14]
    assert c.loss_mask == [0] * 9 + [1, 1]
    assert c.finish_reasons == ["length"]


def test_linear_concat_export():
    [sample] = linear_session().export("concat", turn_discount=0.5)
    assert sample.style == "concat"
    assert sample.interaction_ids == ["a", "b", "c"]
    assert sample.rewards == [1.5, 3.0, 4.0]
    assert sample.reward == 1.5
    assert sample.input_ids == [1, 2, 3, 10, 11, 4, 5, 12, 6, 13, 14]
    #                           p  p  p  a   a   p  p  b   p  c   c
    assert sample.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1]
    assert sample.logprobs == [0.0, 0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.3, 0.0, -0.4, -0.5]
    assert sample.versions == [-1, -1, -1, 1, 1, -1, -1, 2, -1, 2, 3]
    assert sample.finish_reasons == ["stop", "stop", "length"]


def test_each_sampled_token_keeps_its_sampling_temperature():
    t = SessionTrajectory("s3", "task-t")
    first = make("a", [1, 2], [3, 4])
    first.temperature = 0.7
    t.add(first)
    second = make("b", [1, 2, 3, 4, 5], [6], parent="a")
    second.temperature = 1.3
    t.add(second)
    [concat] = t.export("concat")
    assert concat.temperatures == [1.0, 1.0, 0.7, 0.7, 1.0, 1.3]
    individual = t.export("individual")
    assert [s.temperatures for s in individual] == [[1.0, 1.0, 0.7, 0.7], [1.0] * 5 + [1.3]]


def branching_session() -> SessionTrajectory:
    """Root r, then two continuations x and y of the same exchange; y has no reward."""
    t = SessionTrajectory("s2", "task-b")
    t.add(make("r", [1, 2], [3], reward=0.5, logprobs=[-1.0], versions=[0]))
    t.add(make("x", [1, 2, 3, 7], [8], parent="r", reward=2.0, logprobs=[-2.0], versions=[1]))
    t.add(make("y", [1, 2, 3, 9], [10, 11], parent="r", logprobs=[-3.0, -4.0], versions=[1, 2]))
    return t


def test_branching_individual_averages_over_branches():
    samples = branching_session().export("individual", turn_discount=0.5)
    returns = {s.interaction_ids[0]: s.reward for s in samples}
    # x = 2, y = 0 (unset reward counts 0), r = 0.5 + 0.5 * mean(2, 0) = 1.0
    assert returns == {"r": 1.0, "x": 2.0, "y": 0.0}


def test_branching_concat_has_per_branch_returns():
    samples = branching_session().export("concat", turn_discount=0.5)
    assert [s.interaction_ids for s in samples] == [["r", "x"], ["r", "y"]]
    # branch x: r = 0.5 + 0.5 * 2 = 1.5; branch y: r = 0.5 + 0.5 * 0 = 0.5
    assert [s.rewards for s in samples] == [[1.5, 2.0], [0.5, 0.0]]
    assert [s.reward for s in samples] == [1.5, 0.5]
    x, y = samples
    assert x.input_ids == [1, 2, 3, 7, 8] and x.loss_mask == [0, 0, 1, 0, 1]
    assert y.input_ids == [1, 2, 3, 9, 10, 11] and y.loss_mask == [0, 0, 1, 0, 1, 1]
    assert y.logprobs == [0.0, 0.0, -1.0, 0.0, -3.0, -4.0]
    assert y.versions == [-1, -1, 0, -1, 1, 2]


def test_no_rewards_at_all_gives_zero_returns():
    t = SessionTrajectory("s", "t")
    t.add(make("a", [1], [2]))
    t.add(make("b", [1, 2, 3], [4], parent="a"))
    assert t.returns(0.9) == {"a": 0.0, "b": 0.0}
    assert t.export("concat")[0].rewards == [0.0, 0.0]


def test_unknown_export_style():
    with pytest.raises(ValueError, match="unknown export style"):
        linear_session().export("flat")


def test_discounted_return_loop_matches_closed_form():
    rng = random.Random(1234)
    for _ in range(200):
        n = rng.randint(1, 8)
        gamma = rng.choice([0.0, 0.5, 0.9, 1.0, rng.random()])
        rewards = [rng.choice([None, round(rng.uniform(-3, 3), 3)]) for _ in range(n)]
        t, prompt = SessionTrajectory("s", "t"), [0]
        for i, reward in enumerate(rewards):
            completion = [100 + i]
            t.add(make(f"i{i}", prompt, completion, parent=f"i{i - 1}" if i else None, reward=reward))
            prompt = prompt + completion + [50]
        expected = [sum(gamma ** (k - i) * (rewards[k] or 0.0) for k in range(i, n)) for i in range(n)]
        individual = [s.reward for s in t.export("individual", gamma)]
        [concat] = t.export("concat", gamma)
        assert all(math.isclose(a, b, abs_tol=1e-9) for a, b in zip(individual, expected)), (rewards, gamma)
        assert all(math.isclose(a, b, abs_tol=1e-9) for a, b in zip(concat.rewards, expected)), (rewards, gamma)
        assert len(individual) == len(concat.rewards) == n


def test_add_refuses_a_continuation_that_does_not_extend_its_parent():
    t = SessionTrajectory("s", "t")
    t.add(make("a", [1, 2], [3, 4]))
    for prompt in ([1, 2, 3, 5, 9], [1, 2, 3], [9, 2, 3, 4, 5]):  # wrong token, too short, wrong start
        with pytest.raises(ValueError, match="parent's prompt and completion"):
            t.add(make("b", prompt, [6], parent="a"))
    assert list(t.interactions) == ["a"]
    t.add(make("b", [1, 2, 3, 4], [6], parent="a"))  # exactly the parent's sequence is fine
    assert len(t) == 2


def test_add_refuses_duplicate_ids():
    t = SessionTrajectory("s", "t")
    t.add(make("a", [1], [2], reward=1.0))
    with pytest.raises(ValueError, match="already recorded"):
        t.add(make("a", [5], [6]))
    assert t.interactions["a"].prompt_ids == [1]


def test_interaction_refuses_mismatched_lengths():
    with pytest.raises(ValueError, match="same length"):
        Interaction("a", [1], [2, 3], logprobs=[-0.1], versions=[0, 0], finish_reason="stop")
    with pytest.raises(ValueError, match="same length"):
        Interaction("a", [1], [2], logprobs=[-0.1], versions=[], finish_reason="stop")


def test_find_returns_the_latest_matching_key():
    t = SessionTrajectory("s", "t")
    t.add(make("a", [1], [2], key="k1"))
    t.add(make("b", [1, 2, 3], [4], parent="a", key="k2"))
    assert t.find(["k1", "k2"]).id == "b"
    assert t.find(["k1", "k2", "k-unknown"]).id == "b"
    assert t.find(["k2", "k1"]).id == "a"  # "latest" is the last in the list given
    assert t.find(["k1"]).id == "a"
    assert t.find(["nope"]) is None and t.find([]) is None
    t.add(make("c", [1, 2, 3], [5], parent="a", key="k2"))  # same key again: the newer interaction wins
    assert t.find(["k2"]).id == "c"


def test_set_reward():
    t = SessionTrajectory("s", "t")
    with pytest.raises(LookupError, match="no completions"):
        t.set_reward(1.0)
    t.add(make("a", [1], [2]))
    t.add(make("b", [1, 2, 3], [4], parent="a"))
    assert t.set_reward(3) == "b"  # default: the latest
    assert t.interactions["b"].reward == 3.0 and isinstance(t.interactions["b"].reward, float)
    assert t.set_reward(-1.5, "a") == "a"
    assert t.interactions["a"].reward == -1.5
    with pytest.raises(LookupError, match="'zzz'"):
        t.set_reward(1.0, "zzz")
    assert t.returns(1.0) == {"a": 1.5, "b": 3.0}


def long_session(turns: int, system: int = 2000, grow: int = 400, out: int = 200, seed: int = 0) -> SessionTrajectory:
    """An agent's session: each turn's prompt is the whole conversation so far, tokenised
    anew (new int objects, as a tokenizer returns), with 150k-vocabulary ids."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(150_000) for _ in range(n)]

    t, prompt, parent = SessionTrajectory("long", "task"), ids(system), None
    for turn in range(turns):
        completion = ids(out)
        logprobs = [-rng.random() for _ in completion]
        t.add(make(f"t{turn}", [int(str(x)) for x in prompt], completion, parent=parent, logprobs=logprobs))
        parent, prompt = f"t{turn}", prompt + completion + ids(grow)
    return t


def test_a_long_session_holds_each_token_once_and_exports_every_token():
    """Each turn's prompt repeats every earlier one: held as lists, ten turns on a 2,000-token
    prompt growing by 400 took ~1.8 MB (47,000 prompt ids at ~36 bytes); held as the tokens
    after the parent's (4 bytes each), ~60 KB. Measured by tracemalloc, which counts what
    Python allocates, not the machine: the bound has a 2x margin and is 15x below lists."""
    import tracemalloc

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        sessions = [long_session(10, seed=seed) for seed in range(4)]
        held = (tracemalloc.get_traced_memory()[0] - before) / len(sessions)
    finally:
        tracemalloc.stop()
    assert held < 120 * 1024, f"{held / 1024:.0f} KiB per session"

    # and nothing is lost: the same session built again exports what its prompts and completions were
    rng = random.Random(0)
    prompt = [rng.randrange(150_000) for _ in range(2000)]
    completions = []
    for _ in range(10):
        completions.append([rng.randrange(150_000) for _ in range(200)])
        [rng.random() for _ in range(200)]  # its logprobs
        prompt += completions[-1] + [rng.randrange(150_000) for _ in range(400)]
    (branch,) = sessions[0].export("concat")
    leaf = sessions[0].interactions["t9"]
    assert branch.input_ids == prompt[:-400] and len(leaf.prompt_ids) == len(prompt) - 600
    assert sum(branch.loss_mask) == 2000 and branch.logprobs[2000] == sessions[0].interactions["t0"].logprobs[0]
    individual = sessions[0].export("individual")
    assert [s.input_ids for s in individual][-1] == branch.input_ids


def test_held_prompts_read_as_lists_and_pickle_as_their_ids():
    import pickle

    t = linear_session()
    c = t.interactions["c"]
    assert c.prompt_ids == [1, 2, 3, 10, 11, 4, 5, 12, 6] and [1, 2, 3, 10, 11, 4, 5, 12, 6] == c.prompt_ids
    assert c.prompt_ids != [1, 2, 3, 10, 11, 4, 5, 12, 7] and c.prompt_ids != [1, 2, 3]
    assert len(c.prompt_ids) == 9 and c.prompt_ids[3:6] == [10, 11, 4] and c.prompt_ids[-1] == 6
    assert list(c.prompt_ids) == [1, 2, 3, 10, 11, 4, 5, 12, 6] and c.sequence[-2:] == [13, 14]
    assert c.prompt_ids + [7] == [1, 2, 3, 10, 11, 4, 5, 12, 6, 7] and [0] + t.interactions["a"].prompt_ids == [
        0,
        1,
        2,
        3,
    ]
    again = pickle.loads(pickle.dumps(c))
    assert again.prompt_ids == c.prompt_ids and list(again.completion_ids) == [13, 14]
    assert list(again.logprobs) == [-0.4, -0.5] and list(again.versions) == [2, 3]


def test_the_choices_of_one_request_share_their_held_prompt():
    t = SessionTrajectory("s", "task")
    t.add(make("a", [1, 2], [3]))
    shared = [1, 2, 3, 4]
    for choice in "xyz":
        t.add(Interaction(choice, shared, [5], [-0.1], [0], "stop", parent="a"))
    x, y, z = (t.interactions[c].prompt_ids for c in "xyz")
    assert x is y is z and x == shared
    t.add(make("w", [1, 2, 3, 9], [5], parent="a"))  # another prompt after the same parent: its own
    assert t.interactions["w"].prompt_ids is not x and t.interactions["w"].prompt_ids == [1, 2, 3, 9]
