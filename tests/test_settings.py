"""Settings by section: the config files, the command line, config.json, and the code's shape."""

from __future__ import annotations

import ast
import configparser
import json
import subprocess
import sys

import pytest

from pipeline.config import SECTIONS
from retool.config.settings import RunConfig, RunSettings, SettingsError, frozen, setting_fields
from retool.run.setup import freeze
from tests.helpers import REPO


@pytest.mark.parametrize("path", ["luigi.cfg", "configs/cpu.cfg"])
def test_every_shipped_setting_names_a_field_of_its_section(path):
    parser = configparser.ConfigParser()
    parser.read(REPO / path)
    for name in set(parser.sections()) & set(SECTIONS):
        known = {f.name for f in setting_fields(name, SECTIONS[name][0])}
        assert set(parser[name]) <= known, (path, name, set(parser[name]) - known)


def test_the_shipped_config_runs_without_a_central_scheduler_and_retries_transient_failures():
    parser = configparser.ConfigParser()
    parser.read(REPO / "luigi.cfg")
    assert parser["core"].getboolean("local_scheduler") and parser["scheduler"].getint("retry_count") == 2


def test_a_misspelt_setting_is_refused_with_the_section_s_settings(configure):
    import luigi

    configure("typo")
    config = luigi.configuration.get_config()
    config.set("rollout", "grop_size", "4")
    from pipeline.config import current_settings

    try:
        with pytest.raises(
            SettingsError,
            match=r"unknown setting \[rollout\] grop_size in the config files; did you mean group_size\?",
        ):
            current_settings()
    finally:
        config.remove_option("rollout", "grop_size")


def test_a_misspelt_section_is_refused_with_the_closest_one(configure):
    import luigi

    from pipeline.config import current_settings

    configure("section-typo")
    config = luigi.configuration.get_config()
    config.add_section("rollouts")
    config.set("rollouts", "group_size", "4")
    try:
        with pytest.raises(
            SettingsError, match=r"unknown section \[rollouts\] in the config files; did you mean \[rollout\]\?"
        ):
            current_settings()
    finally:
        config.remove_section("rollouts")
    config.add_section("TrainStep")  # a task's own section, and Luigi's, are known
    config.add_section("logging")
    try:
        current_settings()
    finally:
        config.remove_section("TrainStep")
        config.remove_section("logging")


def test_a_section_setting_on_the_command_line_reaches_its_use(tmp_path):
    probe = (
        "import luigi.cmdline_parser as c, pipeline\n"
        "from pipeline.config import current_settings\n"
        "with c.CmdlineParser.global_instance(['Prompts', '--step', '0', '--rollout-group-size', '5',"
        " '--cold-start-steps', '3', '--model-use-tools', 'false']):\n"
        "    s = current_settings()\n"
        "    print(s.rollout.group_size, s.cold_start.steps, s.run.device, s.model.use_tools)\n"
        "with c.CmdlineParser.global_instance(['Prompts', '--step', '0', '--sampler-sleep-while-training', 'true']):\n"
        "    print(current_settings().sampler.sleep_while_training)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["5", "3", "cuda", "False", "True"], result.stderr[-2000:]


def test_config_json_nests_by_section_and_refuses_other_settings_once_a_stage_has_finished(tmp_path):
    settings = RunSettings().changed(run={"name": "old", "runs_dir": str(tmp_path), "device": "cpu"})
    recorded = frozen(settings)
    assert recorded["rollout"]["group_size"] == 8 and "name" not in recorded["run"]
    assert recorded["trainer"]["dtype"] == "float32"  # `auto` recorded as what it chose
    freeze(settings)
    written = (tmp_path / "old" / "config.json").read_text()
    (tmp_path / "old" / "step=0000").mkdir()
    (tmp_path / "old" / "step=0000" / "prompts.parquet").write_bytes(b"")  # a stage has finished
    with pytest.raises(SettingsError, match=r"differing: \[rollout\] group_size = 4 \(frozen: 8\)"):
        freeze(settings.changed(rollout={"group_size": 4}))
    freeze(settings.changed(run={"keep_last": 9}, sandbox={"max_workers": 1}))  # operational: free to differ
    assert (tmp_path / "old" / "config.json").read_text() == written  # never rewritten


def test_vllm_in_process_and_its_server_may_sample_for_one_run_but_not_another_engine(tmp_path):
    settings = RunSettings().changed(run={"name": "engines", "runs_dir": str(tmp_path), "device": "cpu"})
    freeze(settings.changed(sampler={"engine": "vllm"}))
    (tmp_path / "engines" / "prompts.parquet").write_bytes(b"")  # a stage has finished
    freeze(settings.changed(sampler={"engine": "vllm-server"}, run={"tracker": "wandb"}))  # same tokens, other place
    with pytest.raises(SettingsError, match=r"\[sampler\] engine = 'hf' \(frozen: 'vllm'\)"):
        freeze(settings.changed(sampler={"engine": "hf"}))
    with pytest.raises(SettingsError, match=r"\[sampler\] engine = 'hf' \(frozen: 'vllm'\)"):
        freeze(settings.changed(sampler={"engine": "auto"}))  # auto on a CPU is hf
    config = tmp_path / "engines" / "config.json"  # a run frozen before: its engine as given then
    config.write_text(config.read_text().replace('"engine": "vllm"', '"engine": "vllm-server"'))
    freeze(settings.changed(sampler={"engine": "vllm"}))


def test_a_new_run_freezes_nested_settings(tmp_path):
    settings = RunSettings(run=RunConfig(name="new", runs_dir=str(tmp_path), device="cpu"))
    freeze(settings)
    assert json.loads((tmp_path / "new" / "config.json").read_text()) == frozen(settings)


def code_files():
    return sorted(path for folder in ("retool", "pipeline", "jobs", "bench") for path in (REPO / folder).rglob("*.py"))


def test_modules_and_functions_stay_small():
    """Modules of at most 400 lines and functions of at most 60 (lines of at most 120: ruff)."""
    too_long = []
    for path in code_files():
        source = path.read_text()
        if len(source.splitlines()) > 400:
            too_long.append(f"{path.relative_to(REPO)}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 60:
                too_long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}")
    assert not too_long


def test_each_job_is_a_short_function_of_its_files():
    """A stage's job reads its files, calls the library and writes its output: at most 60 lines a module (the
    torchrun worker and the rules of where a step trains live in retool/training/)."""
    sizes = {path.name: len(path.read_text().splitlines()) for path in (REPO / "jobs").glob("*.py")}
    assert max(sizes.values()) <= 60, sizes


def test_no_job_shares_its_name_with_a_library_function():
    """A search for a rule finds one definition: a job and the library functions it calls are named apart."""

    def functions(folder: str) -> set[str]:
        return {
            node.name
            for path in (REPO / folder).rglob("*.py")
            for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.FunctionDef)
        }

    assert not functions("jobs") & functions("retool")


def test_making_a_task_has_no_effect_and_the_run_is_set_up_once_when_luigi_first_asks(configure):
    from pipeline import TrainStep

    settings = configure("setup")
    config_json = settings.run_dir / "config.json"
    task = TrainStep(step=1)
    assert not settings.run_dir.exists()  # made, not yet asked: nothing written, nothing started
    assert not task.complete()
    assert config_json.exists()  # frozen as Luigi first asked, before it schedules anything
    config_json.unlink()
    before = sorted(settings.run_dir.rglob("*"))
    assert not TrainStep(step=0).complete()
    assert sorted(settings.run_dir.rglob("*")) == before  # once per process: asked again, nothing is written


def test_the_recipe_and_the_cpu_configuration_state_the_seeds_rules():
    """The CPU run takes the recipe's prompt (measured against the short built-in one: docs/training.md)."""
    parser = configparser.ConfigParser()
    parser.read([REPO / "luigi.cfg"])
    recipe = parser["model"]["system_prompt"]
    assert "do not read or write files" in recipe and "Never call the tool and give the final" in recipe
    parser.read([REPO / "configs/cpu.cfg"])  # layered on top, as make run does
    assert parser["model"]["system_prompt"] == recipe
