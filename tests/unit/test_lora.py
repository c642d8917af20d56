"""LoRA without Ray: ``[training.lora]``, adapters written as PEFT writes them
and read back by PEFT, the HF engine's merge against PEFT's own, a policy step
that trains the adapter alone with the base model as its KL reference, and a
LoRA run's export."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch

from rlgate import run as runs
from rlgate.cli.export_model import export_model
from rlgate.config import ConfigError, LoraSettings, parse_config
from rlgate.rollout import lora
from rlgate.rollout.engines import SamplingParams, collect
from rlgate.training.grpo import LossConfig
from rlgate.training.policy_step import PolicyTrainer, StepSettings, collate, token_logprobs
from tests.support import lora_model

# float32 on CPU: a merged weight and PEFT's two matmuls differ by rounding only
TOLERANCE = 1e-5


@pytest.fixture
def adapted(reference_model):
    """tiny-random with a rank-4 adapter whose B is not zero (so it changes the model)."""
    return lora_model(reference_model, rank=4, seed=0)


def logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_the_lora_section_reads_as_toml_gives_it_and_says_what_is_wrong():
    settings = parse_config({"training": {"lora": {"rank": 12, "target_modules": ["q_proj", "v_proj"]}}})
    assert settings.training.lora.rank == 12 and settings.training.lora.engine_rank == 16  # vLLM's next rank
    assert settings.training.lora.alpha == 32.0 and not settings.training.lora.save_merged
    assert parse_config({}).training.lora is None  # full fine-tuning unless asked
    with pytest.raises(ConfigError, match=r"training\.lora\.rank: .*less than or equal to 512"):
        parse_config({"training": {"lora": {"rank": 1024}}})
    with pytest.raises(ConfigError, match=r"training\.lora\.ranks: unknown key"):
        parse_config({"training": {"lora": {"ranks": 8}}})
    assert parse_config({"rollout": {"max_loras": 8}}).rollout.max_loras == 8
    with pytest.raises(ConfigError, match='"fsdp" trains the full model; a LoRA adapter trains on "ddp" workers'):
        parse_config({"training": {"lora": {}}, "compute": {"strategy": "fsdp"}})


def test_an_engine_pool_takes_runs_that_ask_for_its_engines_and_says_why_not_others():
    from rlgate.rollout.pool import PoolSpec, pool_name

    lora8 = {"training": {"lora": {"rank": 8}}}
    first = parse_config({**lora8, "rollout": {"pool": "shared"}})
    spec = PoolSpec.of(first, "/models/tiny")
    assert spec.lora_rank == 8 and spec.replicas == 1 and pool_name("shared") == "enginepool-shared"
    assert spec.refusal(PoolSpec.of(parse_config({"training": {"lora": {"rank": 4}}}), "/models/tiny")) is None
    wider = parse_config({"training": {"lora": {"rank": 12}}, "rollout": {"replicas": 2}})
    assert spec.refusal(PoolSpec.of(wider, "/models/other")) == (
        "model '/models/other' (the pool's is '/models/tiny'); replicas 2 (the pool's is 1); "
        "LoRA rank up to 16 (the pool's engines take up to 8)"
    )
    for bad, why in [
        ({"rollout": {"pool": "p"}}, r"rollout\.pool: an engine pool's runs each train a LoRA adapter"),
        ({**lora8, "rollout": {"pool": "p", "engine": "hf"}}, r"adapters on vLLM; not engine \"hf\""),
        ({**lora8, "rollout": {"pool": "p"}, "gateway": {"colocate": True}}, r"set \[gateway\] colocate = false"),
        ({**lora8, "rollout": {"pool": "a pool"}}, r"rollout\.pool: String should match pattern"),
    ]:
        with pytest.raises(ConfigError, match=why):
            parse_config(bad)


def test_an_adapter_written_here_is_the_adapter_peft_loads(adapted, reference_model, tmp_path, prompts):
    from peft import PeftModel

    adapter = lora.adapter_of(adapted)
    assert adapter.rank == 4 and adapter.scale == 2.0 and adapter.config["peft_type"] == "LORA"
    assert all(".lora_A." in name or ".lora_B." in name for name in adapter.tensors)
    folder = adapter.write(tmp_path / "v3")
    assert sorted(p.name for p in folder.iterdir()) == [lora.CONFIG_FILE, lora.WEIGHTS_FILE]
    loaded = PeftModel.from_pretrained(copy.deepcopy(reference_model), str(folder)).eval()
    assert torch.allclose(logits(loaded, prompts[0]), logits(adapted, prompts[0]), atol=TOLERANCE)
    again = lora.Adapter.read(folder)
    assert again.config == adapter.config and again.tensors.keys() == adapter.tensors.keys()
    assert lora.rank_of(folder) == 4
    with pytest.raises(FileNotFoundError, match="is not a LoRA adapter folder"):
        lora.Adapter.read(tmp_path)


def test_a_merged_model_is_the_one_peft_merges(adapted, tiny_path, prompts):
    """[training.lora] save_merged: base + adapter as a plain model, merged from the base's folder."""
    merged = lora.merged_model(tiny_path, lora.adapter_of(adapted))
    peft_merged = copy.deepcopy(adapted).merge_and_unload()
    assert type(merged) is type(peft_merged)
    assert torch.allclose(logits(merged, prompts[2]), logits(peft_merged, prompts[2]), atol=TOLERANCE)
    # one matmul with the merged weight against PEFT's two: logits of size ~5 agree to float32 rounding
    assert torch.allclose(logits(merged, prompts[2]), logits(adapted, prompts[2]), atol=1e-4)


async def test_the_hf_engine_serves_an_adapter_as_peft_merges_it(adapted, tiny_path, tmp_path, prompts):
    """The HF engine merges each pushed adapter over the weights as first loaded: its
    logprobs are the PEFT model's, and a later adapter replaces (not adds to) the first."""
    from rlgate.rollout.engines.hf import HFEngine

    engine = HFEngine(tiny_path, max_model_len=512)
    await engine.ready()
    try:
        params = SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
        base = (await collect(engine.generate(prompts[1], params)))[0]
        await engine.update_weights(lora.adapter_of(adapted), version=1)
        await engine.update_weights(lora.adapter_of(adapted), version=2)  # the same adapter again: no double merge
        served = (await collect(engine.generate(prompts[1], params)))[0]
        assert served.versions == [2] * 8 and served.token_ids != base.token_ids
        expected = torch.log_softmax(logits(adapted, prompts[1] + served.token_ids), -1)
        positions = range(len(prompts[1]) - 1, len(prompts[1]) + 7)
        wanted = [float(expected[p, t]) for p, t in zip(positions, served.token_ids)]
        assert max(abs(a - b) for a, b in zip(served.logprobs, wanted)) < TOLERANCE
    finally:
        await engine.shutdown()
    # started on an adapter folder, it serves that adapter at its first version
    folder = lora.adapter_of(adapted).write(tmp_path / "start")
    started = HFEngine(tiny_path, max_model_len=512, initial_version=5, adapter=folder)
    await started.ready()
    try:
        again = (await collect(started.generate(prompts[1], params)))[0]
        assert again.token_ids == served.token_ids and again.versions == [5] * 8
    finally:
        await started.shutdown()


def test_a_lora_step_trains_the_adapter_alone_against_the_base_model(reference_model, hf_engine, prompts):
    """The base weights do not move; the KL reference is the model with its adapter off
    (the base model's logprobs, no second copy in memory)."""
    torch.manual_seed(0)
    model = lora.attach(copy.deepcopy(reference_model), LoraSettings(rank=4, alpha=8.0))
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    records = [
        {
            "input_ids": prompt + [403, 404, 405],
            "loss_mask": [0] * len(prompt) + [1, 1, 1],
            "logprobs": [0.0] * len(prompt) + [-5.0, -5.0, -5.0],
            "versions": [-1] * len(prompt) + [0, 0, 0],
        }
        for prompt in prompts
    ]
    batch = collate(records, [1.0, -1.0, 1.0, -1.0])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    trainer = PolicyTrainer(model, optimizer, StepSettings(loss=LossConfig(kl_coef=0.1)), lora.WithoutAdapter(model))
    trainer.step(batch, version=0)
    trainer.step(batch, version=0)
    assert all(torch.equal(p, frozen[name]) for name, p in model.named_parameters() if name in frozen)
    assert any("lora_B" in name and p.abs().max() > 0 for name, p in model.named_parameters())
    base = token_logprobs(reference_model, batch)
    with torch.no_grad():
        assert torch.allclose(token_logprobs(lora.WithoutAdapter(model), batch), base, atol=TOLERANCE)
        assert (token_logprobs(model, batch) - base).abs().max() > 1e-3  # the adapter moved the policy


def test_a_lora_run_exports_its_adapter_and_on_request_its_merged_model(adapted, tiny_path, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "runs" / "adapted"
    checkpoint = runs.checkpoints_dir(folder) / runs.checkpoint_name(3)
    adapted.save_pretrained(checkpoint / runs.ADAPTER)
    state = {"next_command": 3, "version": 3, "driver": {"step": 3, "buffer": {}}}
    (checkpoint / runs.STATE_FILE).write_text(json.dumps(state))
    (folder / "config.toml").write_text('[model]\nname = "org/base"\n[training.lora]\nrank = 4\n')
    assert runs.checkpoint_weights(checkpoint) == checkpoint / runs.ADAPTER

    out, step = export_model(folder, tmp_path / "adapter")
    card = (out / "README.md").read_text()
    assert step == 3 and "library_name: peft" in card and "A LoRA adapter (rank 4) over `org/base`" in card
    assert "PeftModel.from_pretrained(base" in card
    assert PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_path), str(out)) is not None
    with pytest.raises(ValueError, match=r"no merged/ model: set \[training.lora\] save_merged"):
        export_model(folder, tmp_path / "merged", merged=True)
    shutil.copytree(tiny_path, checkpoint / runs.MERGED)
    out, _ = export_model(folder, tmp_path / "merged", merged=True)
    assert "library_name: transformers" in (out / "README.md").read_text()
