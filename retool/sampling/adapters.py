"""A LoRA adapter's tensor names as the serving engine's model expects them.

PEFT names an adapter's tensors after the modules of the model transformers trained:
`base_model.model.model.layers.N...` for a causal LM. vLLM serves a checkpoint under the
architecture its config.json names, and Qwen3.5's published checkpoint is
Qwen3_5ForConditionalGeneration, whose language model vLLM maps from `model.language_model.`.
An adapter tensor whose name matches no module is skipped without an error, and the engine then
serves the base model; so an adapter is renamed for such an engine before it is served.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

ADAPTER_WEIGHTS = "adapter_model.safetensors"
DECODER_PREFIX = "base_model.model.model."  # PEFT's prefix of a causal LM's decoder modules
LANGUAGE_MODEL = "language_model."  # where a multimodal checkpoint keeps that decoder


def keeps_language_model_apart(model_dir: Path) -> bool:
    """Whether the checkpoint the engine serves is a multimodal one whose text decoder vLLM maps from
    `model.language_model.` (it has a text_config and a ...ForConditionalGeneration architecture)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    architectures = config.get("architectures") or []
    return "text_config" in config and any(a.endswith("ForConditionalGeneration") for a in architectures)


def served_name(name: str) -> str:
    """An adapter tensor's name under a multimodal checkpoint's decoder prefix."""
    if name.startswith(DECODER_PREFIX) and not name.startswith(DECODER_PREFIX + LANGUAGE_MODEL):
        return DECODER_PREFIX + LANGUAGE_MODEL + name.removeprefix(DECODER_PREFIX)
    return name


def adapter_for_engine(adapter: Path, engine_model: Path, out: Path) -> Path:
    """The adapter folder to serve with an engine built from `engine_model`: `adapter` itself, or a
    copy under `out` with its tensors renamed for the engine's architecture."""
    if not keeps_language_model_apart(engine_model):
        return adapter
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(adapter / ADAPTER_WEIGHTS))
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for item in adapter.iterdir():
        if item.name != ADAPTER_WEIGHTS and item.is_file():
            shutil.copy(item, out / item.name)
    save_file({served_name(name): tensor for name, tensor in tensors.items()}, str(out / ADAPTER_WEIGHTS))
    return out
