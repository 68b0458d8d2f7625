"""The layout page names every package and module of the code, so that it stays true to the tree."""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


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
