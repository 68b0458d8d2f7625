"""The layout page names every package and module of the code, so that it stays true to the tree."""

from tests.helpers import REPO


def test_the_layout_page_names_every_package_and_module():
    page = (REPO / "docs/layout.md").read_text()
    missing = []
    for package in sorted(p for p in (REPO / "retool").iterdir() if (p / "__init__.py").exists()):
        if f"{package.name}/" not in page:
            missing.append(f"retool/{package.name}/")
        for module in sorted(package.glob("*.py")):
            if module.name != "__init__.py" and module.name not in page and module.stem not in page:
                missing.append(str(module.relative_to(REPO)))
    for module in sorted([*(REPO / "pipeline").glob("*.py"), *(REPO / "jobs").glob("*.py")]):
        if module.name != "__init__.py" and module.name not in page:
            missing.append(str(module.relative_to(REPO)))
    assert not missing, f"docs/layout.md does not name {missing}"


def test_every_engine_implements_the_whole_sampler_protocol():
    from retool.sampling.contract import Sampler
    from retool.sampling.hf import HFSampler
    from retool.sampling.scripted import ScriptedSampler
    from retool.sampling.server_client import ServerSampler
    from retool.sampling.vllm_engine import VLLMSampler

    methods = [name for name in vars(Sampler) if not name.startswith("_")]
    assert set(methods) == {"sample", "use_policy", "sleep", "wake", "close"}
    for engine in (HFSampler, VLLMSampler, ServerSampler, ScriptedSampler):
        assert not [name for name in methods if not callable(getattr(engine, name, None))], engine.__name__


# Runs `python -m retool ARGS` in a process where importing luigi, pipeline or jobs raises.
WITHOUT_THE_TASK_LAYER = """
import importlib.abc, runpy, sys

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("luigi", "pipeline", "jobs"):
            raise ImportError(f"{name} imported by the library")

sys.meta_path.insert(0, Refuse())
sys.argv = ["retool", *sys.argv[1:]]
runpy.run_module("retool", run_name="__main__", alter_sys=True)
"""


def test_serve_reads_its_settings_without_the_task_layer(tmp_path):
    import subprocess
    import sys

    def serve(*arguments: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-c", WITHOUT_THE_TASK_LAYER, "serve", *arguments]
        return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)

    helped = serve("--help")
    assert helped.returncode == 0 and "--run-name" in helped.stdout, helped.stderr[-2000:]
    config = tmp_path / "bad.cfg"
    config.write_text("[TrainStep]\nstep = 1\n[rollout]\ngroup_size = abc\n")  # a task's own section is left alone
    refused = serve("--config", str(config))
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert refused.stderr.strip() == (
        "python -m retool serve: setting [rollout] group_size = 'abc': must be an integer"
    ), refused.stderr[-2000:]
    config.write_text("[sampler]\nengine = vllm-server\n[run]\nname = served\nrunz_dir = x\n")
    misspelt = serve("--config", str(config))
    assert (
        misspelt.returncode == 2
        and "unknown setting [run] runz_dir in the config files; did you mean runs_dir?" in (misspelt.stderr)
    ), misspelt.stderr[-2000:]


def test_every_function_the_rule_indexes_name_exists():
    """Both rule indexes of docs/layout.md (the rollout chapter's and the update's) point at functions that exist."""
    import ast
    import re

    page = (REPO / "docs/layout.md").read_text()
    indexes = page[page.index("## Rule index: the seed's chapter") : page.index("## Departures from the seed")]
    named = re.findall(r"`((?:retool|pipeline|jobs)/[\w/]+\.py):([\w.]+)`", indexes)
    assert len(named) > 30
    missing = []
    for path, dotted in named:
        tree = ast.parse((REPO / path).read_text())
        scope = tree.body
        for part in dotted.split("."):
            found = [
                node
                for node in scope
                if isinstance(node, ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef)
                and node.name == part
                or isinstance(node, ast.Assign)
                and any(getattr(t, "id", None) == part for t in node.targets)
            ]
            if not found:
                missing.append(f"{path}:{dotted}")
                break
            scope = getattr(found[0], "body", [])
    assert not missing, missing
