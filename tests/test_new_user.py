"""What a new user hits first: public data layouts without ids, input errors as one line without retries,
a first command with bad settings that can be re-pointed, and the report's command-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import luigi
import pytest

from retool.config.settings import RunSettings, SettingsError
from retool.data.examples import read_examples
from retool.run.setup import freeze, workers_warning
from tests.helpers import REPO


def test_public_layouts_read_without_ids_and_with_capitalised_fields(tmp_path):
    path = tmp_path / "aime.jsonl"
    rows = [{"problem": "What is 1 + 1?", "answer": 2}, {"ID": "2024-I-3", "Problem": "What is 2 + 2?", "Answer": "4"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    first, second = read_examples(path)
    assert (first.id, first.question, first.answer) == ("aime-1", "What is 1 + 1?", "2")  # file and line
    assert (second.id, second.question, second.answer) == ("2024-I-3", "What is 2 + 2?", "4")
    assert [e.id for e in read_examples(path)] == ["aime-1", "2024-I-3"]  # stable


def run_cli(*args, cwd=REPO):
    return subprocess.run(
        [sys.executable, "-m", "luigi", "--module", "pipeline", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )


def test_bad_data_is_one_line_at_once_not_a_retried_traceback(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"id": "1", "question": "q", "answer": "1"}) + "\n" + json.dumps({"id": "2", "question": "q"})
    )
    started = time.perf_counter()
    result = run_cli(
        "Prompts",
        "--step",
        "0",
        "--run-device",
        "cpu",
        "--model-name",
        "default",
        "--run-runs-dir",
        str(tmp_path / "runs"),
        "--data-train",
        str(bad),
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0 and time.perf_counter() - started < 60  # no 30 s retry delays
    assert output.count(f"{bad} line 2: field 'answer' is missing or null") == 1
    assert "Traceback" not in output


def test_a_run_whose_first_command_failed_can_be_pointed_elsewhere(tmp_path):
    first = RunSettings().changed(run={"name": "new", "runs_dir": str(tmp_path), "device": "cpu"})
    freeze(first)
    second = first.changed(data={"train": "data/synthetic_eval.jsonl"})
    freeze(second)  # nothing of the run exists but its config.json: the new settings replace it
    assert json.loads((tmp_path / "new" / "config.json").read_text())["data"]["train"] == "data/synthetic_eval.jsonl"
    (tmp_path / "new" / "step=0000").mkdir()
    (tmp_path / "new" / "step=0000" / "prompts.parquet").write_bytes(b"")
    with pytest.raises(SettingsError, match="another run name, or delete the run's folder"):
        freeze(first)


def test_the_report_of_a_missing_run_is_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "retool", "report", "runs/nope"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2 and "runs/nope: no such run folder" in result.stderr
    assert "Traceback" not in result.stderr


def test_counts_in_the_report_agree_with_their_nouns():
    from retool.evaluation.report import counted

    assert counted(1, "training step") == "1 training step"
    assert counted(2, "evaluation") == "2 evaluations"
    assert counted(0, "evaluation") == "0 evaluations"


def test_evaluations_are_told_apart_by_content_and_by_how_they_sample(tmp_path):
    from retool.evaluation.spec import EvalSpec, evaluation_settings

    rows = [{"id": str(i), "question": f"{i} + 1?", "answer": str(i + 1)} for i in range(3)]
    for folder, content in (("A", rows), ("B", rows[::-1]), ("C", rows)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "dapo.jsonl").write_text("".join(json.dumps(row) + "\n" for row in content))
    a, b, c = (str(tmp_path / folder / "dapo.jsonl") for folder in "ABC")
    assert EvalSpec(a, 2, "retool").name != EvalSpec(b, 2, "retool").name  # same name, other questions
    assert EvalSpec(a, 2, "retool").name == EvalSpec(c, 2, "retool").name  # same file elsewhere: reused
    spec = EvalSpec(a, 2, "retool", limit=1, temperature=1.0, top_p=0.7)
    assert spec.name.endswith("/retool-n2-t1-p0.7-first1") and [e.id for e in spec.examples()] == ["0"]
    settings = evaluation_settings(RunSettings(), spec)
    assert (settings.rollout.top_p, settings.data.questions_per_step) == (0.7, 1)


def test_a_command_ends_with_what_became_of_the_task_it_names(tmp_path):
    arguments = ["Prompts", "--step", "0", "--run-device", "cpu", "--model-name", "default"]
    arguments += ["--run-runs-dir", str(tmp_path), "--data-train", "data/synthetic_eval.jsonl"]
    first, second = run_cli(*arguments), run_cli(*arguments)
    output = tmp_path / "default" / "step=0000" / "prompts.parquet"
    assert first.stdout.splitlines()[-1] == f"Prompts(step=0): done -> {output}"
    assert second.stdout.splitlines()[-1].startswith(f"Prompts(step=0): already complete, nothing to do ({output})")
    # Luigi's execution summary comes before it, without Luigi's per-task lines.
    assert "===== Luigi Execution Summary =====" in first.stderr and "* 1 ran successfully" in first.stderr
    assert "* 1 complete ones were encountered" in second.stderr and "Informed scheduler" not in second.stderr


def test_workers_that_would_each_load_an_engine_on_one_cpu_are_warned_of(tmp_path):
    arguments = ["Prompts", "--step", "0", "--run-device", "cpu", "--model-name", "default", "--sampler-engine", "hf"]
    result = run_cli(*arguments, "--run-runs-dir", str(tmp_path), "--workers", "2")
    assert result.returncode == 0
    assert "--workers 2 with [sampler] engine = hf: every worker process loads its own engine" in result.stderr
    server = RunSettings().changed(run={"device": "cpu"}, sampler={"engine": "vllm-server"})
    assert workers_warning(server, 2) is None and workers_warning(RunSettings(), 1) is None


COMMANDS = (
    "retool serve",
    "retool sandbox",
    "retool report",
    "retool synthetic",
    "retool convert",
    "retool export-sft",
    "retool verify",
    "retool model",
    "bench",
    "bench.gpu",
)


@pytest.mark.parametrize("module", COMMANDS)
def test_every_command_line_option_is_described(module):
    shown = subprocess.run(
        [sys.executable, "-m", *module.split(), "--help"], capture_output=True, text=True, check=True
    )
    lines = shown.stdout.splitlines()
    assert lines[0].startswith(f"usage: python -m {module} ")
    for line, after in zip(lines, lines[1:] + [""]):
        option_alone = line.startswith("  -") and "  " not in line.strip()
        assert not option_alone or after.startswith(" " * 8), f"{module}: {line.strip()} has no help text"


def test_every_task_parameter_is_described():
    import pipeline

    tasks = [value for value in vars(pipeline).values() if isinstance(value, type) and issubclass(value, luigi.Task)]
    assert len(tasks) == 12
    for task in tasks:
        for name, parameter in task.get_params():
            assert parameter.description, f"{task.__name__} --{name.replace('_', '-')} has no description"


def test_no_task_option_is_an_abbreviation_of_a_setting():
    """Luigi's first pass over the command line knows only the settings: a task option that begins one of them
    (`--mode` of `--model-name`) is refused there as ambiguous."""
    import pipeline
    from pipeline.config import SECTIONS
    from retool.config.settings import setting_fields

    settings = [
        f"--{section}-{f.name}".replace("_", "-")
        for section, (config, _) in SECTIONS.items()
        for f in setting_fields(section, config)
    ]
    tasks = [value for value in vars(pipeline).values() if isinstance(value, type) and issubclass(value, luigi.Task)]
    for task in tasks:
        for name, _ in task.get_params():
            option = f"--{name}".replace("_", "-")
            assert not any(s.startswith(option) for s in settings), f"{task.__name__} {option} abbreviates a setting"
    parsed = luigi.cmdline_parser.CmdlineParser(["Evaluate", "--step", "3", "--eval-mode", "text-only"]).known_args
    assert parsed.eval_mode == "text-only"


@pytest.mark.parametrize(
    "arguments, line",
    [
        (["--rollout-group-size", "abc"], "setting [rollout] group_size = 'abc': must be an integer"),
        (["--trainer-learning-rate", "-1"], "setting [trainer] learning_rate = -1.0: must be > 0"),
        (["--rollout-top-p", "2"], "setting [rollout] top_p = 2.0: must be in (0, 1]"),
        (["--rollout-group-sise", "4"], "--rollout-group-sise: did you mean --rollout-group-size?"),
        (["--model-use-tools", "maybe"], "setting [model] use_tools = 'maybe': must be true or false"),
    ],
)
def test_a_bad_setting_on_the_command_line_is_one_line_naming_it(arguments, line, tmp_path):
    result = run_cli("Prompts", "--step", "0", "--run-device", "cpu", "--run-runs-dir", str(tmp_path), *arguments)
    output = result.stdout + result.stderr
    assert result.returncode == 2 and line in output, output[-2000:]  # bad input: 2, not a crash's code
    assert "Traceback" not in output and max(map(len, output.splitlines())) < 300


def test_a_cpu_server_for_a_full_fine_tune_is_refused_at_once(tmp_path):
    """The CPU engine cannot load another full checkpoint: said before anything runs, not after a step's retries."""
    arguments = ["Prompts", "--step", "0", "--run-device", "cpu", "--sampler-engine", "vllm-server"]
    started = time.perf_counter()
    result = run_cli(*arguments, "--trainer-lora-rank", "0", "--run-runs-dir", str(tmp_path))
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "[trainer] lora_rank = 0 trains full weights, which it cannot load" in output
    assert time.perf_counter() - started < 30 and not list(tmp_path.glob("*/step=0000"))


def test_a_bad_choice_of_a_task_option_is_one_line_with_every_choice(tmp_path):
    result = run_cli("Evaluate", "--step", "0", "--eval-mode", "textonly", "--run-runs-dir", str(tmp_path))
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "--eval-mode 'textonly': must be one of retool, text-only" in output, output
    assert "Traceback" not in output


@pytest.mark.parametrize(
    "command", [["-m", "luigi", "--module", "pipeline", "Prompts", "--step", "0"], ["-m", "retool", "serve"]]
)
@pytest.mark.parametrize(
    "section, line",
    [
        (
            "[rollout]\ngroup_sise = 4",
            "unknown setting [rollout] group_sise in the config files; did you mean group_size?",
        ),
        ("[rollouts]\ngroup_size = 4", "unknown section [rollouts] in the config files; did you mean [rollout]?"),
    ],
)
def test_a_misspelt_setting_in_a_config_file_names_the_closest_real_one(command, section, line, tmp_path):
    config = tmp_path / "bad.cfg"
    config.write_text(f"[run]\ndevice = cpu\n{section}\n")
    environment = {**os.environ, "LUIGI_CONFIG_PATH": str(config)}
    result = subprocess.run([sys.executable, *command], cwd=REPO, capture_output=True, text=True, env=environment)
    output = result.stdout + result.stderr
    assert result.returncode == 2 and line in output, output[-2000:]
    assert "Traceback" not in output


@pytest.mark.slow
def test_ctrl_c_is_one_line_saying_what_was_interrupted_and_leaves_nothing_behind(tmp_path, tiny_model_dir):
    import signal

    import psutil

    arguments = [
        "ScoreTrajectories",
        "--step",
        "0",
        "--run-runs-dir",
        str(tmp_path),
        "--model-name",
        str(tiny_model_dir),
    ]
    policy = ["--sampler-engine", "scripted:tests.policies:paced_branching_tools", "--cold-start-data", "none"]
    command = [sys.executable, "-m", "luigi", "--module", "pipeline", *arguments, *policy]
    environment = {**os.environ, "LUIGI_CONFIG_PATH": "configs/cpu.cfg", "PYTHONUNBUFFERED": "1"}
    temporary = set(Path("/tmp").glob("retool-*"))
    # Its own process group, as a terminal's foreground job: Ctrl-C reaches every process in it.
    command_process = subprocess.Popen(
        command,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=environment,
        start_new_session=True,
    )
    lines = []
    for line in command_process.stdout:
        lines.append(line)
        if line.startswith("Prompts(step=0): "):
            break
    time.sleep(2.0)  # well into the first round's sampling
    children = psutil.Process(command_process.pid).children(recursive=True)
    os.killpg(command_process.pid, signal.SIGINT)
    output = "".join(lines) + command_process.communicate(timeout=120)[0]
    assert command_process.returncode == 130, output
    assert (
        output.rstrip()
        .splitlines()[-1]
        .startswith(
            "ScoreTrajectories(step=0): interrupted (Ctrl-C) while SampleRound(step=0, round=0, shard=0) ran; "
            "finished before: Prompts(step=0)."
        )
    ), output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output
    time.sleep(1.0)
    assert not [child.pid for child in children if child.is_running() and child.status() != psutil.STATUS_ZOMBIE]
    assert set(Path("/tmp").glob("retool-*")) <= temporary
    assert not list((tmp_path / "cpu-default" / "step=0000").glob("shard=00/round=00/samples.parquet"))


def test_ctrl_c_on_a_tool_command_is_one_line(tmp_path):
    import signal

    command = [sys.executable, "-m", "retool", "synthetic", "--out", str(tmp_path / "data")]
    tool = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(3.0)  # writing the data sets takes longer
    tool.send_signal(signal.SIGINT)
    output = tool.communicate(timeout=60)[0]
    assert tool.returncode == 130 and "Traceback" not in output, output
    assert output.strip().splitlines()[-1] == (
        "python -m retool synthetic: interrupted (Ctrl-C); what it had not finished is not written"
    )
