"""The terminal shows the run's own lines: the libraries' Python warnings go to runs/<run>/warnings.log, and what an
engine start writes below Python (torch's C++ warnings) to the engine's log; RETOOL_DEBUG=1 keeps both on screen."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

SCRIPT = """
import os, sys, warnings
from pathlib import Path
from retool.run.setup import third_party_output_to
from retool.sampling.vllm_engine import native_stderr_to
folder = Path(sys.argv[1])
third_party_output_to(folder / "warnings.log")
warnings.warn("a library's deprecation", FutureWarning)
with native_stderr_to(folder / "engine.log"):
    os.write(2, b"[W utils.cpp:68] Warning: NUMA binding\\n")
os.write(2, b"the run's own line\\n")
print(os.environ.get("WANDB_SILENT"), os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS"))
"""


@pytest.mark.parametrize("debug", [False, True])
def test_library_warnings_and_native_lines_go_to_the_run_s_logs(tmp_path, debug):
    set_here = ("RETOOL_DEBUG", "WANDB_SILENT", "HF_HUB_DISABLE_PROGRESS_BARS")  # by this process's earlier runs too
    environment = {key: value for key, value in os.environ.items() if key not in set_here}
    if debug:
        environment["RETOOL_DEBUG"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=REPO, env=environment, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "the run's own line" in done.stderr
    if debug:
        assert "FutureWarning" in done.stderr and "NUMA" in done.stderr
        assert not (tmp_path / "warnings.log").exists() and not (tmp_path / "engine.log").exists()
        assert done.stdout.split() == ["None", "None"]
        return
    assert "FutureWarning" not in done.stderr and "NUMA" not in done.stderr
    assert "FutureWarning: a library's deprecation" in (tmp_path / "warnings.log").read_text()
    assert "NUMA binding" in (tmp_path / "engine.log").read_text()
    assert done.stdout.split() == ["true", "1"]
