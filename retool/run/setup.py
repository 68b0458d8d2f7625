"""What happens once per run and command before any stage: the machine checked against the settings, the data
files read, the settings frozen into runs/<run>/config.json (a later command with different settings is
refused), and what every worker process then shares started (the tracker's run, the vLLM server, the
tokenizer, the sandbox's pre-warmed servers)."""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import fields, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from retool.config.precision import bfloat16_native, bfloat16_slowdown, why
from retool.config.sampler import engine_dtype
from retool.config.settings import PRECISION, RunSettings, SettingsError, check_training, frozen, sampling_engine
from retool.data.conversations import read_conversations
from retool.evaluation.tracking import Tracker, check_tracker
from retool.files.atomic import publish_once, write_text_atomically
from retool.files.layout import RunFolder
from retool.run.shared import protocol_for, sandbox_for, step_examples
from retool.sampling.server import server_urls
from retool.weights.checkpoint import MARKER
from retool.weights.models import resolve_model

log = logging.getLogger(__name__)


@lru_cache(maxsize=None)
def open_run(settings: RunSettings, workers: int = 1) -> None:
    """Once per process and run, before anything is scheduled (Luigi forks its worker processes later, and they
    inherit what is loaded here): fail early on settings this machine cannot run, freeze them, and load what
    every task of the run shares (`workers`: the command's worker processes)."""
    third_party_output_to(RunFolder(settings.run_dir).warnings_log)
    check_training(settings)
    check_machine(settings)
    for line in (precision_line(settings), kernels_line(settings)):
        if line:
            print(line, flush=True)
    for warning in (
        workers_warning(settings, workers),
        staleness_warning(settings, workers),
        bfloat16_warning(settings),
    ):
        if warning:
            log.warning(warning)
    check_inputs(settings)
    check_tracker(settings.run.tracker)
    freeze(settings)
    if settings.run.tracker != "none":
        Tracker(settings.run.tracker, RunFolder(settings.run_dir), settings.run.name).run_id()  # before workers fork
    if settings.sampler.engine == "vllm-server":
        server_urls(settings)  # found or started before Luigi forks workers, which then share it
    protocol_for(settings.model)
    if settings.model.use_tools:
        sandbox_for(settings.sandbox).prewarm()


def third_party_output_to(path: Path) -> None:
    """The libraries' Python warnings go to `path`, their progress bars and adverts nowhere, so that the terminal
    shows the run's own lines (vLLM's go to the engine's log: retool/sampling/vllm_engine.py); all of them stay on
    the terminal with RETOOL_DEBUG=1."""
    if os.environ.get("RETOOL_DEBUG"):
        return
    os.environ["WANDB_SILENT"] = "true"  # W&B's banner, links and advert
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # transformers' and the Hub's bars, read when they load
    if "transformers" in sys.modules:  # loaded already: its bars ("Writing model shards") are switched off here
        sys.modules["transformers"].utils.logging.disable_progress_bar()
    logging.captureWarnings(True)
    warnings_logger = logging.getLogger("py.warnings")
    if any(getattr(handler, "baseFilename", None) == str(path.resolve()) for handler in warnings_logger.handlers):
        return
    for handler in list(warnings_logger.handlers):
        warnings_logger.removeHandler(handler)
    to_file = logging.FileHandler(path, delay=True)  # created by the first warning
    to_file.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    warnings_logger.addHandler(to_file)
    warnings_logger.propagate = False


def check_inputs(settings: RunSettings) -> None:
    """Reads the run's data files once, so that a bad row fails the command at once with the file and
    line, instead of failing a stage that the scheduler would retry."""
    step_examples(settings, 0)
    if settings.cold_start.data:
        read_conversations(settings.cold_start.data)


def visible_gpus() -> int:
    """The GPUs this process sees, counted through NVML. CUDA's own count (what torch.cuda.is_available asks by
    default) makes a later fork's CUDA fail ("Cannot re-initialize CUDA in forked subprocess"), and this process
    forks later: Luigi's worker processes, vLLM's engine core."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # is_available() through NVML too, in any library
    import torch

    return torch.cuda.device_count()


def check_machine(settings: RunSettings) -> None:
    """Fails at once when the settings cannot run here, naming the setting to change."""
    if settings.run.device == "cuda":
        gpus = visible_gpus()
        if not gpus:
            raise SettingsError(
                "setting [run] device = cuda, but this machine has no GPU: run the CPU configuration "
                "(LUIGI_CONFIG_PATH=configs/cpu.cfg, as `make run` does) or set device = cpu in the [run] section"
            )
        if settings.run.train_processes > gpus:
            raise SettingsError(
                f"setting [run] train_processes = {settings.run.train_processes}, but this machine has "
                f"{gpus} visible GPU(s): one training process per GPU"
            )
        sampler = settings.sampler
        engines = sampler.engines if sampler.engine == "vllm-server" and not sampler.servers else 1
        if engines * sampler.tensor_parallel_size > gpus:
            raise SettingsError(
                f"setting [sampler] engines = {engines} with tensor_parallel_size = {sampler.tensor_parallel_size} "
                f"needs {engines * sampler.tensor_parallel_size} GPUs, but this machine has "
                f"{gpus} visible: each engine has its own GPUs"
            )
    if settings.sampler.engine == "vllm-server" and (limit := cpu_server_limit(settings)):
        raise SettingsError(limit)
    resolve_model(settings.model.name)
    files = {
        "[model] chat_template": settings.model.chat_template,
        "[data] train": settings.data.train,
        "[cold_start] data": settings.cold_start.data,
    }
    for name, path in files.items():
        if path and not Path(path).is_file():
            raise SettingsError(f"setting {name} = {path!r}: no such file")


def cpu_server_limit(settings: RunSettings) -> str | None:
    """Why a vLLM server cannot serve this run's policies on a CPU (the CPU engine keeps the weights its kernels
    packed at start: it serves its own weights and LoRA adapters over them, never another full checkpoint)."""
    if settings.run.device != "cpu" or settings.trainer.lora_rank:
        return None
    return (
        "setting [sampler] engine = vllm-server on a CPU serves only its own weights and LoRA adapters over them, "
        "but [trainer] lora_rank = 0 trains full weights, which it cannot load: sample in-process ([sampler] engine "
        "= vllm, a fresh engine per policy) or train a LoRA ([trainer] lora_rank > 0)"
    )


LOCAL_ENGINES = ("auto", "hf", "vllm")  # engines that every worker process loads for itself


def staleness_warning(settings: RunSettings, workers: int) -> str | None:
    """Why [rollout] max_staleness > 0 would not overlap sampling and training here: the lag lets step N+1 sample
    while step N trains only in another worker process, on a sampler the training step does not put to sleep."""
    lag, sampler = settings.rollout.max_staleness, settings.sampler
    if not lag:
        return None
    if workers < 2:
        return (
            f"[rollout] max_staleness = {lag} with --workers {workers}: one worker runs one task at a time, so "
            "sampling still waits for training (the samples are off-policy for nothing); run --workers 2 or more"
        )
    colocated = sampler.engine in LOCAL_ENGINES or (settings.run.device == "cuda" and sampler.sleep_while_training)
    if colocated:
        return (
            f"[rollout] max_staleness = {lag} with a sampler that shares the trainer's {settings.run.device} "
            f"([sampler] engine = {sampler.engine}, sleep_while_training = {sampler.sleep_while_training}): "
            "sampling and training take turns on the same hardware; overlap needs a vllm-server on other GPUs or "
            'nodes (docs/training.md, "When a lag pays")'
        )
    return None


def workers_warning(settings: RunSettings, workers: int) -> str | None:
    """Why `--workers K` would slow this run down: K worker processes each load their own local engine,
    and K engines share the machine's cores (or GPU) instead of one engine using them all."""
    engine, engines, shards = settings.sampler.engine, settings.sampler.engines, settings.rollout.shards
    if engine == "vllm-server" and shards < engines:
        return (
            f"[rollout] shards = {shards} with [sampler] engines = {engines}: shard s samples on server s mod "
            f"{engines}, so {engines - shards} server(s) get no work; set shards to a multiple of engines"
        )
    if engine == "vllm-server" and workers < engines and shards > workers:
        return (
            f"--workers {workers} with [sampler] engines = {engines}: at most {workers} of the run's servers sample "
            f"at once (one shard per worker); run --workers {engines} to keep every engine busy"
        )
    if workers <= 1 or engine not in LOCAL_ENGINES:
        return None
    if settings.run.device == "cuda":
        share = f"each taking [sampler] gpu_memory_utilization = {settings.sampler.gpu_memory_utilization} of the GPU"
    else:
        share = f"all on this machine's {os.cpu_count()} CPU cores (2 workers on 2 cores sampled 6x slower than 1)"
    return (
        f"--workers {workers} with [sampler] engine = {engine}: every worker process loads its own engine, {share}. "
        "--workers helps when the workers share one sampler ([sampler] engine = vllm-server) and when rounds wait "
        "on slow tool calls; with a local engine, run --workers 1."
    )


def precision_line(settings: RunSettings) -> str:
    """The command's first line: 'dtype: sampler float32, trainer float32 (auto: this CPU (AVX2) has no native
    bfloat16)'."""
    trainer = settings.trainer_on_device()
    products = (
        " with bfloat16 matrix products" if trainer.autocast_bfloat16 == "true" and trainer.dtype != "bfloat16" else ""
    )
    line = f"dtype: sampler {engine_dtype(settings.sampler, settings.run.device)}, trainer {trainer.dtype}{products}"
    return f"{line} (auto: {why(settings.run.device)})"


def kernels_line(settings: RunSettings) -> str | None:
    """On a GPU: which of the linear-attention kernels the trainer can use (retool/run/kernels.py)."""
    if settings.run.device != "cuda":
        return None
    from retool.run.kernels import LINEAR_ATTENTION_KERNELS, kernel_states

    states = kernel_states()
    listed = ", ".join(f"{name} {states[name]}" for name in LINEAR_ATTENTION_KERNELS)
    if all(state == "active" for state in states.values()):
        return f"kernels: {listed}"
    hint = "a linear-attention model such as Qwen3.5 trains slower: make gpu-venv; pip uninstall a broken one first"
    return f"kernels: {listed} ({hint})"


def precision_settings(settings: RunSettings) -> list[tuple[str, str]]:
    """('[sampler] dtype', its value as set) for each setting that chooses a precision."""
    return [
        (f"[{section}] {name}", getattr(getattr(settings, section), name))
        for section, names in PRECISION.items()
        for name in names
    ]


def bfloat16_warning(settings: RunSettings) -> str | None:
    """One line when a setting forces bfloat16 on a CPU that only emulates it, with what that costs here."""
    if bfloat16_native(settings.run.device):
        return None
    forced = [
        f"{setting} = {value}" for setting, value in precision_settings(settings) if value in ("bfloat16", "true")
    ]
    if not forced:
        return None
    return (
        f"{', '.join(forced)}: {why(settings.run.device)}, so torch emulates it and a matrix product runs "
        f"{bfloat16_slowdown():.0f}x slower than in float32 (measured now); auto chooses float32 here"
    )


def upgraded(recorded: dict[str, dict[str, Any]], device: str) -> dict[str, dict[str, Any]]:
    """A config.json written by an earlier version, read as this version records the same settings."""
    sampler, trainer = recorded.get("sampler", {}), recorded.get("trainer", {})
    if "engine" in sampler:  # frozen before vLLM's server counted as vLLM
        sampler["engine"] = sampling_engine(sampler["engine"], device)
    if sampler.get("dtype") == "auto":  # frozen before `auto` was recorded as what it chose
        sampler["dtype"] = "bfloat16" if device == "cuda" else "float32"
    if "tis_cap" in trainer:  # frozen when truncated importance sampling was a cap alone (0: off)
        cap = trainer.pop("tis_cap")
        trainer.update({"correction": "tis", "correction_cap": cap} if cap > 0 else {"correction": "none"})
    if isinstance(trainer.get("autocast_bfloat16"), bool):  # frozen when the setting was true or false
        trainer["autocast_bfloat16"] = str(trainer["autocast_bfloat16"]).lower()
    return recorded


def differences(recorded: dict[str, dict[str, Any]], wanted: dict[str, dict[str, Any]]) -> list[str]:
    """The settings whose frozen value differs; one added after the run was frozen counts at its default."""
    defaults = frozen(RunSettings())
    differing = []
    for section in sorted(set(recorded) | set(wanted)):
        old, new = recorded.get(section, {}), wanted.get(section, {})
        for name in sorted(set(old) | set(new)):
            was = old.get(name, defaults.get(section, {}).get(name))
            if was != new.get(name):
                differing.append(f"[{section}] {name} = {new.get(name)!r} (frozen: {was!r})")
    return differing


def auto_hint(settings: RunSettings, differing: list[str]) -> str:
    """Why a run frozen on another machine may differ: its `auto` precision settings chose for that machine."""
    automatic = [
        setting
        for setting, value in precision_settings(settings)
        if value == "auto" and any(line.startswith(f"{setting} =") for line in differing)
    ]
    if not automatic:
        return ""
    return (
        f" ({', '.join(automatic)}: auto decides by the processor, and here {why(settings.run.device)}; machines of "
        "different CPU kinds share a run when these settings are given explicitly)"
    )


def has_results(run_dir: Path) -> bool:
    """Whether any stage of the run has written its output (a Parquet table or a finished checkpoint)."""
    return any(path.suffix == ".parquet" or path.name == MARKER for path in run_dir.rglob("*"))


def freeze(settings: RunSettings) -> None:
    """Writes runs/<run>/config.json on first use; afterwards refuses different settings."""
    path = RunFolder(settings.run_dir).config
    wanted = frozen(settings)
    if path.exists():
        recorded = json.loads(path.read_text())
        recorded = upgraded(recorded, recorded.get("run", {}).get("device", settings.run.device))
        differing = differences(recorded, wanted)
        if differing and has_results(settings.run_dir):
            raise SettingsError(
                f"{path}: this run was started with other settings; differing: {', '.join(differing)}. Use the "
                "frozen values, another run name, or delete the run's folder to start it again"
                + auto_hint(settings, differing)
            )
        if not differing:
            return
        # No stage of the run has finished (its first command failed): the new settings replace the old.
        log.warning("%s: no stage of this run has finished; its settings are replaced (%s)", path, ", ".join(differing))
        write_text_atomically(path, json.dumps(wanted, indent=2, sort_keys=True) + "\n")
        return
    if not publish_once(path, json.dumps(wanted, indent=2, sort_keys=True) + "\n"):
        freeze(settings)  # another command froze the run first


def recorded_settings(run_dir: Path) -> RunSettings:
    """The settings a run folder was frozen with (config.json), for commands that read a finished run; those
    that only change speed or place are at their defaults."""
    path = RunFolder(run_dir).config
    if not path.is_file():
        raise SettingsError(f"{run_dir}: not a run folder (a run folder holds the config.json its first command wrote)")
    recorded = json.loads(path.read_text())
    sections = {}
    for name, config in RunSettings().sections().items():
        known = {f.name for f in fields(config)}
        sections[name] = replace(config, **{k: v for k, v in recorded.get(name, {}).items() if k in known})
    run = replace(sections["run"], name=Path(run_dir).name, runs_dir=str(Path(run_dir).parent))
    return RunSettings(**{**sections, "run": run})
