"""Every command in the shell blocks of the README and of the pages about running on a CPU runs, exactly as
written, in a folder laid out like a checkout: the same command lines, with configs/cpu.cfg there setting the
tiny model and a scripted policy (the real ones take minutes a step), the input files the commands name, and
runs/cpu-default made by the command `make run` runs. Not here: `make` targets (`make run` is the main job,
whose shortened form test_default_run runs; `make test-all` runs this file) and the benchmarks."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from retool.data.examples import MathExample, write_examples
from tests.conftest import REPO
from tests.test_public_layouts import tagged_row, write

PAGES = ["README.md"] + [f"docs/{name}.md" for name in ("running", "settings", "training", "cold-start", "evaluation")]
PAGES += ["docs/run-folder.md", "docs/tools.md", "docs/safety.md"]  # the GPU and multi-node pages need those


def not_here(command: str) -> bool:
    """See the module's docstring."""
    return command.startswith("make ") or " bench" in command


TINY_CPU_CONFIG = """\
[run]
name = cpu-default
device = cpu
tracker = none
[model]
name = {model}
chat_template = retool/protocol/templates/chatml_tools.jinja
[data]
train = data/synthetic_train.jsonl
questions_per_step = 2
[rollout]
group_size = 2
max_code_calls = 2
max_assistant_turns = 3
max_trajectory_tokens = 900
max_assistant_tokens = 96
max_tool_response_tokens = 48
trainer_max_tokens = 1024
[sampler]
engine = scripted:tests.policies:branching_tools
[sandbox]
max_workers = 2
[trainer]
lora_rank = 4
lora_alpha = 8
micro_batch_items = 2
micro_batch_tokens = 4096
max_sampler_gap = 0.0
[cold_start]
data = data/synthetic_sft.jsonl
steps = 2
batch_size = 2
"""


def shown_commands(page: str) -> list[str]:
    """The lines of a page's ```bash blocks, comments cut, continuation lines joined."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / page).read_text(), re.DOTALL)
    text = re.sub(r"\\\s*(#[^\n]*)?\n", " ", "\n".join(blocks))
    lines = [line.split("  #")[0].strip() for line in text.splitlines()]
    return [" ".join(line.split()) for line in lines if line and not line.startswith("#")]


def test_the_pages_show_the_commands_this_file_runs():
    commands = shown_commands("README.md")
    assert {"make run", "make test", "make test-all"} <= set(commands)
    assert len([c for c in commands if not not_here(c)]) >= 4


@pytest.fixture
def checkout(tmp_path, tiny_model_dir):
    """A folder laid out like the repository, for the README's relative paths."""
    for name in ("luigi.cfg", "retool", ".venv"):
        (tmp_path / name).symlink_to(REPO / name)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "cpu.cfg").write_text(TINY_CPU_CONFIG.format(model=tiny_model_dir))
    (tmp_path / "data").mkdir()
    for name, lines in (("synthetic_train.jsonl", 64), ("synthetic_eval.jsonl", 24), ("synthetic_sft.jsonl", 8)):
        kept = (REPO / "data" / name).read_text().splitlines(keepends=True)[:lines]  # the shipped data, shortened
        (tmp_path / "data" / name).write_text("".join(kept))
    for name in ("retool_sft.parquet", "public.parquet"):
        write([tagged_row()] * 3, tmp_path / name)
    (tmp_path / "cell.py").write_text("print(sum(range(10)))\n")
    (tmp_path / "path" / "to").mkdir(parents=True)
    write_examples(
        [MathExample(f"aime-{i}", f"What is {i} + {i}?", str(2 * i), "aime") for i in range(4)],
        tmp_path / "path/to/aime.jsonl",
    )
    environment = {**os.environ, "PYTHONPATH": str(REPO), "LUIGI_CONFIG_PATH": ""}  # tests.policies importable
    made = subprocess.run(  # what `make run` leaves: runs/cpu-default, trained through step 3
        "LUIGI_CONFIG_PATH=configs/cpu.cfg .venv/bin/luigi --module pipeline TrainStep --step 3",
        shell=True,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=environment,
        timeout=900,
    )
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    return tmp_path, environment


@pytest.mark.slow
def test_every_command_shown_runs_as_written(checkout):
    folder, environment = checkout
    # A command shown on two pages runs once (again, it finds its outputs complete): under the first page.
    first_page = {}
    for page in PAGES:
        for command in shown_commands(page):
            first_page.setdefault(command, page)
    shown = [(page, command) for command, page in first_page.items() if not not_here(command)]
    # Writing the shipped data sets again replaces the shortened ones: last.
    shown.sort(key=lambda shown: "retool synthetic" in shown[1])
    failed = []
    for page, command in shown:
        done = subprocess.run(command, shell=True, cwd=folder, capture_output=True, text=True, env=environment)
        output = done.stdout + done.stderr
        if done.returncode != 0 or "Traceback" in output:
            failed.append(f"{page}: {command}\n  -> {done.returncode}: {output.strip().splitlines()[-1:]}")
    assert not failed, "\n".join(failed)
