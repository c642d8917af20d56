"""LoRA adapters between the trainer and the engines.

With ``[training.lora]`` the trainer trains a PEFT adapter (:func:`attach`)
and, after each step, publishes an :class:`Adapter` (the adapter's tensors and
its PEFT config: megabytes, not the model) instead of a full state dict. The
engines serve it without touching the base weights:

* vLLM loads each version as a ``LoRARequest`` named ``v<version>``: a request
  keeps the adapter it started with, new requests take the newest one, and an
  adapter is unloaded once no request uses it;
* the HF engine merges it into a pristine copy of the adapted weights,
  ``W + alpha / r * B @ A``, as PEFT's ``merge_and_unload`` does.

Adapters are written as PEFT writes them (``adapter_config.json`` and
``adapter_model.safetensors``), so a checkpoint's ``adapter/`` folder loads
with ``peft.PeftModel.from_pretrained`` and with vLLM's ``LoRARequest``.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from rlgate.config import LoraSettings

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass
class Adapter:
    """One version of a LoRA adapter: PEFT's ``adapter_config.json`` and its
    tensors under PEFT's saved names (``base_model.model.<module>.lora_A.weight``)."""

    config: dict
    tensors: dict[str, torch.Tensor]

    @property
    def rank(self) -> int:
        return int(self.config["r"])

    @property
    def scale(self) -> float:
        return float(self.config["lora_alpha"]) / self.rank

    def write(self, folder: str | Path) -> Path:
        """The adapter as a PEFT folder at ``folder`` (written whole, then renamed into place)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
        tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in self.tensors.items()}
        save_file(tensors, str(partial / WEIGHTS_FILE), metadata={"format": "pt"})
        (partial / CONFIG_FILE).write_text(json.dumps(self.config, indent=2))
        os.replace(partial, folder)
        return folder

    @classmethod
    def read(cls, folder: str | Path) -> Adapter:
        """A PEFT adapter folder (as :meth:`write` or PEFT's ``save_pretrained`` leaves it)."""
        from safetensors.torch import load_file

        folder = Path(folder)
        if not (folder / CONFIG_FILE).is_file() or not (folder / WEIGHTS_FILE).is_file():
            raise FileNotFoundError(f"{folder} is not a LoRA adapter folder: it needs {CONFIG_FILE} and {WEIGHTS_FILE}")
        config = json.loads((folder / CONFIG_FILE).read_text())
        if config.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"{folder}: a {config['peft_type']} adapter; only LoRA adapters are served")
        return cls(config, load_file(str(folder / WEIGHTS_FILE)))

    def deltas(self) -> dict[str, torch.Tensor]:
        """What the adapter adds to each adapted weight: ``{"<module>.weight": alpha / r * B @ A}``."""
        if self.config.get("use_dora") or self.config.get("use_rslora"):
            raise ValueError("DoRA and rsLoRA adapters cannot be merged here; train a plain LoRA adapter")
        if self.config.get("fan_in_fan_out") or self.config.get("rank_pattern") or self.config.get("alpha_pattern"):
            raise ValueError(
                "adapters with fan_in_fan_out (Conv1D layers) or per-module ranks or alphas cannot be merged "
                "here; serve them with vLLM"
            )
        out = {}
        for name, a in self.tensors.items():
            if not name.endswith(".lora_A.weight"):
                continue
            module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = self.tensors[name.replace(".lora_A.", ".lora_B.")]
            out[f"{module}.weight"] = self.scale * (b.float() @ a.float())
        return out

    def deltas_for(self, model) -> dict[str, torch.Tensor]:
        """:meth:`deltas`, checked against ``model``'s parameters (ValueError naming any it lacks)."""
        deltas = self.deltas()
        unknown = sorted(set(deltas) - {name for name, _ in model.named_parameters()})
        if unknown:
            raise ValueError(f"the adapter adapts weights this model does not have: {unknown[:3]}")
        return deltas


def merged_model(base: str | Path, adapter: Adapter):
    """The base model in ``base`` (a Hugging Face folder) with ``adapter`` merged into
    its weights, on the CPU in float32: a plain model that serves alone."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, delta in adapter.deltas_for(model).items():
            params[name].add_(delta)
    return model


def rank_of(folder: str | Path) -> int:
    """The rank ``r`` of the adapter in ``folder`` (from its config alone)."""
    return int(json.loads((Path(folder) / CONFIG_FILE).read_text())["r"])


def peft_config(settings: LoraSettings):
    """The ``peft.LoraConfig`` for ``[training.lora]``."""
    from peft import LoraConfig

    return LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=settings.target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )


def attach(model: torch.nn.Module, settings: LoraSettings, adapter: str | Path | None = None):
    """``model`` with a trainable LoRA adapter: a new one by ``settings`` (B = 0, so
    it starts as the base model), or the one in the folder ``adapter``."""
    from peft import PeftModel, get_peft_model

    if adapter is not None:
        return PeftModel.from_pretrained(model, str(adapter), is_trainable=True)
    return get_peft_model(model, peft_config(settings))


def adapter_of(model) -> Adapter:
    """The current adapter of a PEFT ``model`` (its tensors copied to the CPU)."""
    from peft import get_peft_model_state_dict

    with tempfile.TemporaryDirectory(prefix="rlgate-lora-config-") as folder:
        model.peft_config["default"].save_pretrained(folder)  # PEFT's own adapter_config.json
        config = json.loads((Path(folder) / CONFIG_FILE).read_text())
    config["inference_mode"] = True
    tensors = {name: tensor.detach().to("cpu").clone() for name, tensor in get_peft_model_state_dict(model).items()}
    return Adapter(config, tensors)


class WithoutAdapter:
    """The base model under a PEFT ``model``, called like a model: the frozen
    reference for the KL term at no memory cost (the adapter is switched off
    for the call)."""

    def __init__(self, model) -> None:
        self.model = model

    def __call__(self, *args, **kwargs):
        with self.model.disable_adapter():
            return self.model(*args, **kwargs)

    def eval(self) -> WithoutAdapter:
        return self
