"""Model resolution: built-ins, local folders, the Hugging Face cache, errors."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from rlgate.models import ModelNotFoundError, load_tokenizer, prepare_model, tokenizer_class
from tests.support import needs_vllm


def _digest(folder):
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != "rlgate_model.json"
    }


def test_tiny_random_is_deterministic(tmp_path, monkeypatch):
    monkeypatch.setenv("RLGATE_CACHE_DIR", str(tmp_path / "a"))
    first = prepare_model("tiny-random")
    monkeypatch.setenv("RLGATE_CACHE_DIR", str(tmp_path / "b"))
    second = prepare_model("tiny-random")
    assert first != second
    assert _digest(first) == _digest(second)
    assert prepare_model("tiny-random") == second  # cached: same folder again


def test_tiny_random_shape_and_tokenizer(tiny_path, tiny_tokenizer):
    config = json.loads((tiny_path / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert config["hidden_size"] // config["num_attention_heads"] in (32, 64, 80, 96, 112, 128, 256)
    assert len(tiny_tokenizer) == config["vocab_size"]
    # byte-level BPE: any text round-trips, including non-ASCII
    text = 'Grüße, 世界! {"x": 1}'
    assert tiny_tokenizer.decode(tiny_tokenizer.encode(text)) == text
    assert len(tiny_tokenizer.encode("<tool_call>")) == 1
    assert tiny_tokenizer.eos_token == "<|im_end|>"


def test_a_tokenizer_loaded_by_its_class_name_is_autotokenizers_without_torch(tiny_path, tiny_tokenizer):
    """A Gateway replica loads the tokenizer by the class name AutoTokenizer picks, in a
    process that never imports torch. For tiny-random that is Qwen2Tokenizer, from the
    config's model type: its pre-tokenizer splits numbers into digits, tokenizer.json's
    (the generic class's) does not, so the two differ on " 12+3"."""
    name = tokenizer_class(tiny_path)
    assert name == type(tiny_tokenizer).__name__ == "Qwen2Tokenizer"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße: 12+3 = ?"}]
    script = (
        "import json, sys; from rlgate.models import load_tokenizer; "
        "t = load_tokenizer(sys.argv[1], sys.argv[2]); "
        "ids = t.apply_chat_template(json.loads(sys.argv[3]), add_generation_prompt=True)['input_ids']; "
        "print(json.dumps([type(t).__name__, ids, t.decode(ids), 'torch' in sys.modules]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(tiny_path), name, json.dumps(messages)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    kind, ids, text, torch_imported = json.loads(out.stdout.splitlines()[-1])
    expected = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert (kind, ids, text) == (name, expected, tiny_tokenizer.decode(expected))
    assert not torch_imported
    generic = load_tokenizer(tiny_path, "TokenizersBackend")  # what tokenizer_config.json names
    assert generic([" 12+3"])["input_ids"] != tiny_tokenizer([" 12+3"])["input_ids"]
    for unknown in ("", "NoSuchTokenizer"):  # no name, or one transformers lacks: AutoTokenizer's own choice
        assert type(load_tokenizer(tiny_path, unknown)).__name__ == name


def test_tiny_random_chat_template_renders_tools(tiny_tokenizer):
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 6*7?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"e": "6*7"}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    text = tiny_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.")
    assert '"name": "calc"' in text
    assert '<tool_call>{"name": "calc", "arguments": {"e": "6*7"}}</tool_call><|im_end|>' in text
    assert "<|im_start|>tool\n42<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_local_folder_is_used_as_is(tiny_path):
    assert prepare_model(str(tiny_path)) == tiny_path.resolve()


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        prepare_model(str(tmp_path))


def test_hugging_face_id_resolves_from_local_cache(tiny_path, tmp_path, monkeypatch):
    from transformers import AutoConfig

    hub = tmp_path / "hub"
    snapshot = hub / "models--acme--tiny-chat" / "snapshots" / "0123abcd"
    shutil.copytree(tiny_path, snapshot)
    (hub / "models--acme--tiny-chat" / "refs").mkdir()
    (hub / "models--acme--tiny-chat" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(hub))
    folder = prepare_model("acme/tiny-chat")
    assert folder == snapshot
    assert AutoConfig.from_pretrained(folder).model_type == "qwen2"


def test_uncached_hugging_face_id_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="not in the local Hugging Face cache") as err:
        prepare_model("Qwen/Qwen3-0.6B")
    assert "tiny-random" in str(err.value)


@pytest.mark.parametrize("name", ["no-such-model", "", "a/b/c", "./missing-folder"])
def test_bad_names_list_what_is_accepted(name):
    with pytest.raises(ModelNotFoundError) as err:
        prepare_model(name)
    message = str(err.value)
    assert "tiny-random" in message and "smollm2-135m-instruct" in message


def test_cli_prepare_prints_folder_and_rejects_bad_names(tiny_path):
    ok = subprocess.run(
        [sys.executable, "-m", "rlgate.cli", "model", "prepare", "tiny-random"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert ok.stdout.strip() == str(tiny_path)
    bad = subprocess.run(
        [sys.executable, "-m", "rlgate.cli", "model", "prepare", "gpt-17"], capture_output=True, text=True
    )
    assert bad.returncode == 2
    assert "unknown model 'gpt-17'" in bad.stderr and "tiny-random" in bad.stderr


def test_smollm2_from_the_wheel_loads_in_transformers():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = prepare_model("smollm2-135m-instruct")
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config  # plain weights, not a GGUF checkpoint
    assert config["tie_word_embeddings"] is True
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}], add_generation_prompt=True)
    out = model.generate(torch.tensor([ids["input_ids"]]), max_new_tokens=8, do_sample=False)
    reply = tokenizer.decode(out[0, len(ids["input_ids"]) :], skip_special_tokens=True)
    assert reply.strip()  # a real instruct model answers with text


def _capabilities() -> list[str]:
    """ATen kernel sets this CPU can run: the default (scalar) one, and the
    vector ones its flags allow."""
    flags = set(open("/proc/cpuinfo").read().split()) if sys.platform == "linux" else set()
    return ["default"] + [c for c, flag in (("avx2", "avx2"), ("avx512", "avx512f")) if flag in flags]


_BUILD_TOOLS = """
import json, sys, torch
from pathlib import Path
from rlgate.models import build_tiny_tools
build_tiny_tools(Path(sys.argv[1]), "float32")
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()}))
"""


@pytest.mark.long  # about a minute: `make test` hands this module out early, not last
@needs_vllm
async def test_tiny_tools_builds_under_every_kernel_set_and_plays_greedily_in_vllm(tmp_path, vllm_engine, tiny_path):
    """tiny-tools trains to a margin, so whichever kernels build it (ATen's
    default, AVX2 or AVX-512 kernels; one thread or two), the result decodes
    every episode greedily, token for token, in vLLM, whose kernels differ again."""
    import asyncio

    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from rlgate.models import tool_examples
    from rlgate.rollout.engines import SamplingParams, collect

    # each kernel set once, and one and two threads each at least once (every pair: 6 builds, 75 s more)
    capabilities = _capabilities()
    pairs = [(cap, 1 + i % 2) for i, cap in enumerate(capabilities)]
    if len(capabilities) == 1:
        pairs.append((capabilities[0], 2))
    builds = {(cap, threads): tmp_path / f"{cap}-{threads}" for cap, threads in pairs}

    def build(key):
        (cap, threads), folder = key, builds[key]
        folder.mkdir()
        env = os.environ | {"ATEN_CPU_CAPABILITY": cap, "OMP_NUM_THREADS": str(threads)}
        done = subprocess.run(
            [sys.executable, "-c", _BUILD_TOOLS, str(folder)], env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, f"{cap}, {threads} threads: {done.stderr[-2000:]}"
        return json.loads(done.stdout.strip().splitlines()[-1])

    with ThreadPoolExecutor(max_workers=2) as pool:  # two builds at a time on two cores
        seen = dict(zip(builds, pool.map(build, builds)))
    for (cap, threads), ran in seen.items():
        assert ran == {"capability": cap.upper(), "threads": threads}  # the build really ran on those kernels

    tokenizer = AutoTokenizer.from_pretrained(next(iter(builds.values())))
    assert len({(f / "tokenizer.json").read_bytes() for f in builds.values()}) == 1  # one tokenizer everywhere
    examples = tool_examples(tokenizer)
    greedy = [SamplingParams(max_tokens=len(target) + 4, temperature=0) for _, target in examples]
    try:
        for key, folder in builds.items():
            # tiny-tools is tiny-random's shape: the shared engine serves each build's weights in turn
            await vllm_engine.update_weights(str(folder / "model.safetensors"), vllm_engine.version + 1)
            outs = await asyncio.gather(*[collect(vllm_engine.generate(p, s)) for (p, _), s in zip(examples, greedy)])
            for (prompt, target), [out] in zip(examples, outs):
                said = tokenizer.decode(out.token_ids)
                assert out.token_ids == target, f"{key}: {tokenizer.decode(prompt)!r} -> {said!r}"
    finally:
        await vllm_engine.update_weights(load_file(tiny_path / "model.safetensors"), vllm_engine.version + 1)
