"""`auto` precision: bfloat16 only where the processor computes it natively, recorded as chosen, refused between
machines that chose differently, and a warning where a setting forces bfloat16 on a CPU that emulates it."""

from __future__ import annotations

import configparser
import json
import os
import subprocess
import sys

import pytest

from retool.config import precision
from retool.config.precision import Processor
from retool.config.settings import RunConfig, RunSettings, SettingsError, frozen
from retool.run.setup import bfloat16_warning, freeze, precision_line
from tests.conftest import REPO

# What torch reports on the machine kinds users have: (capability, AVX512-BF16, AMX, Arm BF16) -> native.
KINDS = {
    "Zen 4 / Cooper Lake (AVX512-BF16)": (Processor("AVX512", True, False, False), True),
    "Sapphire Rapids (AMX)": (Processor("AVX512", True, True, False), True),
    "Skylake-SP (AVX512, no BF16)": (Processor("AVX512", False, False, False), False),
    "Zen 2/3, laptops (AVX2)": (Processor("AVX2", False, False, False), False),
    "AVX512-BF16 under ATEN_CPU_CAPABILITY=avx2": (Processor("AVX2", True, False, False), False),
    "no vector unit torch knows": (Processor("DEFAULT", False, False, False), False),
    "Graviton 3 / Neoverse V1 (Arm BF16)": (Processor("SVE256", False, False, True), True),
    "Graviton 2 (Arm, no BF16)": (Processor("DEFAULT", False, False, False), False),
    "IBM Z": (Processor("ZVECTOR", False, False, False), False),
}
CPU = RunSettings(run=RunConfig(device="cpu"))


@pytest.mark.parametrize("kind", KINDS)
def test_auto_chooses_bfloat16_only_where_the_cpu_has_it(kind, monkeypatch):
    processor, native = KINDS[kind]
    monkeypatch.setattr(precision, "this_processor", lambda: processor)
    assert processor.native_bfloat16 == native
    chosen = "bfloat16" if native else "float32"
    recorded = frozen(CPU)
    assert recorded["sampler"]["dtype"] == chosen
    assert recorded["trainer"]["autocast_bfloat16"] == ("true" if native else "false")
    assert recorded["trainer"]["dtype"] == "float32"  # the weights Adam updates stay float32 on a CPU
    assert CPU.sft_trainer().autocast_bfloat16 == recorded["trainer"]["autocast_bfloat16"]  # the cold start alike
    line = precision_line(CPU)
    if native:
        assert line.startswith("dtype: sampler bfloat16, trainer float32 with bfloat16 matrix products (auto: ")
        assert line.endswith("computes bfloat16 natively)")
    else:
        reason = f"this CPU ({processor.capability}) has no native bfloat16"
        assert line == f"dtype: sampler float32, trainer float32 (auto: {reason})"
    gpu = RunSettings(run=RunConfig(device="cuda"))  # a GPU whatever its host's CPU
    assert frozen(gpu)["sampler"]["dtype"] == "bfloat16" and frozen(gpu)["trainer"]["autocast_bfloat16"] == "true"


def test_this_machines_processor_is_read_from_torch():
    import torch

    processor = precision.this_processor()
    assert processor.capability == torch.backends.cpu.get_cpu_capability()
    assert processor.describe().startswith(f"this CPU ({processor.capability}")
    assert precision.bfloat16_slowdown() > 0


@pytest.mark.parametrize(
    "path", ["luigi.cfg", *sorted(p.relative_to(REPO).as_posix() for p in REPO.glob("configs/*.cfg"))]
)
def test_no_shipped_config_forces_bfloat16_on_a_cpu(path):
    parser = configparser.ConfigParser()
    parser.read([REPO / "luigi.cfg", REPO / path])  # each file layered on luigi.cfg, as LUIGI_CONFIG_PATH does
    if parser.get("run", "device", fallback="cuda") != "cpu":
        return
    assert parser.get("sampler", "dtype", fallback="auto") in ("auto", "float32"), path
    assert parser.get("trainer", "dtype", fallback="auto") in ("auto", "float32"), path
    assert parser.get("trainer", "autocast_bfloat16", fallback="auto") in ("auto", "false"), path


def test_two_cpu_kinds_share_a_run_only_where_auto_chose_alike(tmp_path, monkeypatch):
    settings = RunSettings(run=RunConfig(device="cpu", runs_dir=str(tmp_path)))
    monkeypatch.setattr(precision, "this_processor", lambda: KINDS["Zen 4 / Cooper Lake (AVX512-BF16)"][0])
    freeze(settings)
    (settings.run_dir / "prompts.parquet").touch()  # a stage has finished: the settings are fixed
    monkeypatch.setattr(precision, "this_processor", lambda: KINDS["Zen 4 / Cooper Lake (AVX512-BF16)"][0])
    freeze(settings)  # another node of the same kind
    monkeypatch.setattr(precision, "this_processor", lambda: KINDS["Zen 2/3, laptops (AVX2)"][0])
    with pytest.raises(SettingsError) as refused:
        freeze(settings)
    message = str(refused.value)
    assert "[sampler] dtype = 'float32' (frozen: 'bfloat16')" in message
    assert "[trainer] autocast_bfloat16 = 'false' (frozen: 'true')" in message
    assert "auto decides by the processor, and here this CPU (AVX2) has no native bfloat16" in message
    explicit = settings.changed(sampler={"dtype": "bfloat16"}, trainer={"autocast_bfloat16": "true"})
    freeze(explicit)  # set explicitly, the values are the frozen ones on any kind (slowly: see the warning)
    assert bfloat16_warning(explicit).startswith(
        "[sampler] dtype = bfloat16, [trainer] autocast_bfloat16 = true: this CPU (AVX2) has no native bfloat16"
    )
    assert bfloat16_warning(settings) is None


def test_a_run_frozen_before_auto_was_resolved_still_matches(tmp_path, monkeypatch):
    monkeypatch.setattr(precision, "this_processor", lambda: KINDS["Zen 2/3, laptops (AVX2)"][0])
    settings = RunSettings(run=RunConfig(device="cpu", runs_dir=str(tmp_path)))
    recorded = frozen(settings)
    recorded["sampler"]["dtype"] = "auto"  # what runs recorded before: auto meant float32 on every CPU
    recorded["trainer"]["autocast_bfloat16"] = False  # and the switch was a boolean
    settings.run_dir.mkdir(parents=True)
    (settings.run_dir / "config.json").write_text(json.dumps(recorded))
    (settings.run_dir / "prompts.parquet").touch()
    freeze(settings)


@pytest.mark.slow
def test_a_command_on_an_emulating_cpu_says_what_auto_chose_and_warns_once_for_forced_bfloat16(
    tmp_path, tiny_model_dir
):
    """A real command on a CPU without native bfloat16, as torch and oneDNN see one when told to stop at AVX2."""
    config = tmp_path / "tiny.cfg"
    config.write_text(
        f"[run]\nname = emulated\ndevice = cpu\nruns_dir = {tmp_path / 'runs'}\n[model]\nname = {tiny_model_dir}\n"
        "[data]\nquestions_per_step = 2\n[sampler]\nengine = hf\n"
    )
    environment = {**os.environ, "LUIGI_CONFIG_PATH": str(config), "ATEN_CPU_CAPABILITY": "avx2"}
    environment["ONEDNN_MAX_CPU_ISA"] = "AVX2"
    command = [sys.executable, "-m", "luigi", "--module", "pipeline", "Prompts", "--workers", "2"]
    done = subprocess.run(
        [*command, "--step", "0"], cwd=REPO, env=environment, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        done.stdout.splitlines()[0]
        == "dtype: sampler float32, trainer float32 (auto: this CPU (AVX2) has no native bfloat16)"
    )
    recorded = json.loads((tmp_path / "runs" / "emulated" / "config.json").read_text())
    assert (recorded["sampler"]["dtype"], recorded["trainer"]["autocast_bfloat16"]) == ("float32", "false")
    assert "bfloat16" not in done.stderr

    forced = [*command, "--sampler-dtype", "bfloat16", "--run-name", "forced", "--step", "0"]
    done = subprocess.run(forced, cwd=REPO, env=environment, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    warnings = [line for line in done.stderr.splitlines() if "has no native bfloat16" in line]
    assert len(warnings) == 1, done.stderr[-3000:]  # once per command, whatever its workers
    assert "[sampler] dtype = bfloat16: this CPU (AVX2) has no native bfloat16, so torch emulates it" in warnings[0]
    slowdown = float(warnings[0].split("a matrix product runs ")[1].split("x slower")[0])
    assert slowdown > 3  # measured: tens of times on such a CPU
