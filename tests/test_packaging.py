"""What users get from `pip install .`, and turning the cold start off from the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig

import pytest

from retool.config.cold_start import ColdStartConfig
from tests.helpers import REPO

LUIGI = (sys.executable, "-m", "luigi", "--module", "pipeline")  # a command line of the pipeline


@pytest.mark.slow
def test_the_wheel_holds_every_module_and_the_task_module_imports_from_it(tmp_path):
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path / "dist"), str(REPO)],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    assert "discover" not in built.stderr.lower()  # packages are listed by discovery, without warnings
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(site), str(wheel)], check=True
    )
    sources = sorted(REPO.glob("retool/**/*.py")) + sorted(REPO.glob("pipeline/*.py"))
    modules = [".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__") for p in sources]
    templates = [p.name for p in (REPO / "retool/protocol/templates").glob("*.jinja")]
    # -S: no site-packages processing, so the editable install of the source tree is not on the path; the
    # dependencies come from this environment's site-packages, after the installed wheel.
    probe = (
        "import importlib, json, sys\n"
        f"sys.path[:0] = [{str(site)!r}, {sysconfig.get_paths()['purelib']!r}]\n"
        f"modules = {modules!r}\n"
        "for name in modules:\n"
        "    importlib.import_module(name)\n"
        "import pipeline, retool.protocol.chat as chat\n"
        "templates = sorted(p.name for p in chat.BUNDLED_TEMPLATE.parent.glob('*.jinja'))\n"
        "task = pipeline.TrainStep.__name__\n"
        "print(json.dumps({'pipeline': pipeline.__file__, 'templates': templates, 'task': task}))\n"
    )
    shown = subprocess.run(
        [sys.executable, "-S", "-c", probe],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert shown.returncode == 0, shown.stderr[-3000:]
    report = json.loads(shown.stdout.splitlines()[-1])
    assert report["pipeline"].startswith(str(site)) and report["templates"] == sorted(templates)
    assert report["task"] == "TrainStep"


def test_none_turns_the_cold_start_off():
    assert ColdStartConfig(data="none").data == "" and ColdStartConfig(data="None").data == ""
    assert ColdStartConfig(data="data/synthetic_sft.jsonl").data == "data/synthetic_sft.jsonl"


def test_the_cold_start_is_turned_off_on_the_command_line(tmp_path, tiny_model_dir):
    """configs/cpu.cfg sets a cold start; --cold-start-data none samples step 0 from the model itself."""
    run = ("--run-runs-dir", str(tmp_path), "--model-name", str(tiny_model_dir))
    policy = ("--sampler-engine", "scripted:tests.policies:branching_tools")
    command = [*LUIGI, "SampleRound", "--step", "0", "--round", "0", *run, *policy, "--cold-start-data", "none"]
    result = subprocess.run(
        command,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "LUIGI_CONFIG_PATH": "configs/cpu.cfg"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "SampleRound(step=0, round=0, shard=0): done -> " in result.stdout
    run = tmp_path / "cpu-default"
    assert not (run / "sft").exists()  # no cold start ran
    assert json.loads((run / "config.json").read_text())["cold_start"]["data"] == ""
