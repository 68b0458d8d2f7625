"""`python -m retool verify`: a trained run verifies clean, and a copy with one file edited in one way fails the rule
that edit breaks, naming the file."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from retool.files.tables import DATUMS, OBSERVATIONS, SAMPLES, TRAJECTORIES, read_table
from retool.sampling.scripted import ScriptedSampler
from retool.verify.run import verify_run
from retool.weights.checkpoint import Checkpoint
from tests.helpers import REPO
from tests.pipeline_helpers import TRAIN, build_train, tool_policy

BUILT: dict[str, Path] = {}  # the fixture's run as built, once a session


def with_distinct_logprobs(sampler: ScriptedSampler) -> ScriptedSampler:
    """The scripted policy with a logprob of its own for every token, so that one moved off its token shows."""

    def script(request, index):
        tokens, _ = sampler.script(request, index)
        return tokens, [-(position + 1) / 64 - (request.seed % 7) / 8 for position in range(len(tokens))]

    return ScriptedSampler(script)


@pytest.fixture
def trained(configure, monkeypatch, tmp_path_factory):
    """One trained step in two shards whose branches call the tool (q + g) % 3 times; a copy for each test."""
    settings = configure("verified", trainer=TRAIN, rollout={"shards": 2})
    if "run" not in BUILT:
        assert build_train(settings, 0, with_distinct_logprobs(tool_policy(settings)), monkeypatch)
        BUILT["run"] = tmp_path_factory.mktemp("verified-run") / "verified"
        shutil.copytree(settings.run_dir, BUILT["run"])
    else:
        shutil.copytree(BUILT["run"], settings.run_dir)
    return settings.run_dir


def edit(path: Path, schema: pa.Schema, change) -> None:
    """Rewrites a Parquet file with `change(rows)` applied to its rows (a list of dicts, changed in place or
    returned)."""
    rows = read_table(path, schema).to_pylist()
    rows = change(rows) or rows
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)


def broken(run: Path) -> dict[str, list]:
    """The findings of `verify_run`, by rule."""
    report = verify_run(run)
    return {rule: tally.findings for rule, tally in report.tallies.items() if tally.broken}


def test_a_trained_run_verifies_clean_through_the_command(trained):
    done = subprocess.run(
        [sys.executable, "-m", "retool", "verify", str(trained)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert "every rule holds" in done.stdout and done.stdout.count("\nok ") + done.stdout.startswith("ok ") == 7
    assert pq.read_table(trained / "verify.parquet").num_rows == 0
    report = verify_run(trained)
    assert all(tally.rows for tally in report.tallies.values())  # every rule checked something


def first_datum_row(rows):
    return next(row for row in rows if any(row["loss_mask"]))


def mask_a_prompt_token(rows):
    row = first_datum_row(rows)
    row["loss_mask"][0] = True


def move_a_logprob(rows):
    row = first_datum_row(rows)
    positions = [i for i, masked in enumerate(row["loss_mask"]) if masked]
    values = [row["old_logprobs"][i] for i in positions]
    for i, value in zip(positions, values[1:] + values[:1], strict=True):  # each to its neighbour's token
        row["old_logprobs"][i] = value


def change_a_sampled_token(rows):
    row = next(row for row in rows if len(row["completion_tokens"]) > 3)
    row["completion_tokens"][2] += 1


def uncentre_an_advantage(rows):
    rows[0]["advantage"] += 0.5


def flip_a_reward(rows):
    rows[0]["reward"] = -rows[0]["reward"]


def double_a_row(rows):
    return rows + rows[:1]


def drop_a_row(rows):
    return rows[1:]


def contradict_a_stop_reason(rows):
    row = next(row for row in rows if row["stop_reason"] == "answer")
    row["stop_reason"] = "turn_budget"


def cut_an_observation_otherwise(rows):
    row = next(row for row in rows if row["tool_content"])
    row["tool_content"] = row["tool_content"][1:]


def step_file(name: str, shard: int | None = None, round_index: int | None = None):
    def path(run: Path) -> Path:
        folder = run / "step=0000"
        folder = folder / f"shard={shard:02d}" if shard is not None else folder
        return folder / f"round={round_index:02d}" / name if round_index is not None else folder / name

    return path


CORRUPTIONS = {
    "a loss mask on a prompt token": (step_file("datums.parquet", 0), DATUMS, mask_a_prompt_token, "datums"),
    "an old logprob moved off its token": (step_file("datums.parquet", 0), DATUMS, move_a_logprob, "datums"),
    "a sampled token changed": (step_file("samples.parquet", 0, 0), SAMPLES, change_a_sampled_token, "continuation"),
    "an advantage not centred": (step_file("trajectories.parquet"), TRAJECTORIES, uncentre_an_advantage, "reward"),
    "a reward flipped": (step_file("trajectories.parquet"), TRAJECTORIES, flip_a_reward, "reward"),
    "a row doubled": (step_file("trajectories.parquet"), TRAJECTORIES, double_a_row, "accounting"),
    "a shard's row missing": (step_file("scored.parquet", 1), TRAJECTORIES, drop_a_row, "accounting"),
    "a stop reason its tokens contradict": (
        step_file("observations.parquet", 0, 1),
        OBSERVATIONS,
        contradict_a_stop_reason,
        "stops_and_budgets",
    ),
    "an observation cut otherwise": (
        step_file("observations.parquet", 0, 0),
        OBSERVATIONS,
        cut_an_observation_otherwise,
        "observation",
    ),
}


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_a_file_edited_breaks_its_rule_and_names_the_file(trained, corruption):
    where, schema, change, rule = CORRUPTIONS[corruption]
    edit(where(trained), schema, change)
    found = broken(trained)
    assert rule in found, found.keys()
    assert str(where(trained)) in {finding.file for finding in found[rule]}, found[rule][:3]


def test_a_budget_lowered_after_the_run_is_exceeded(trained):
    """The run's frozen settings say what its budgets were: the same files under a lower max_code_calls break it."""
    config = json.loads((trained / "config.json").read_text())
    config["rollout"]["max_code_calls"] = 1
    (trained / "config.json").write_text(json.dumps(config))
    found = broken(trained)
    assert any("over max_code_calls" in finding.message for finding in found["stops_and_budgets"])


def test_a_checkpoint_whose_metrics_are_another_steps_is_named(trained):
    metrics = Checkpoint(trained / "step=0000" / "checkpoint").metrics
    recorded = json.loads(metrics.read_text())
    metrics.write_text(json.dumps({**recorded, "datums": recorded["datums"] + 1}))
    assert {finding.column for finding in broken(trained)["checkpoints"]} == {"datums"}


def test_a_run_folder_that_is_not_one_is_an_error_naming_it(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "retool", "verify", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2 and f"{tmp_path}: not a run folder" in done.stderr


def test_the_health_table_of_a_trained_run_through_the_command(trained):
    done = subprocess.run(
        [sys.executable, "-m", "retool", "verify", str(trained), "--health"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    for measure in ("answered", "budget_stops", "void_turns", "tool_call_rate", "errors_in_correct", "entropy"):
        assert measure in done.stdout
    assert done.stdout.rstrip().endswith("0 warning(s) over 1 step(s)")


def test_a_measure_that_collapses_is_warned_against_the_runs_own_best():
    import polars as pl

    from retool.evaluation.health import health_warnings

    table = pl.DataFrame(
        {
            "step": [0, 1, 2, 3],
            "answered": [0.6, 0.8, 0.7, 0.3],  # below half of 0.8 at step 3
            "budget_stops": [0.2, 0.1, 0.15, 0.3],  # over twice 0.1 and over 0.25 at step 3
            "format": [0.5, 0.6, 0.6, 0.55],  # steady
            "entropy": [0.4, 0.5, 0.45, 0.4],  # steady
        }
    )
    assert health_warnings(table) == [
        "step 3: answered 0.300 against 0.800: answered share below half its best",
        "step 3: budget_stops 0.300 against 0.100: budget stops over twice their least",
    ]
    assert health_warnings(table.head(3)) == []


def test_a_step_not_trained_yet_verifies_its_rollout_and_names_no_checkpoint(trained):
    """A step whose TrainStep has not finished has no checkpoint folder (it is written whole, then renamed): its
    rollout and datums are still checked, and nothing is said of the checkpoint it does not have yet."""
    shutil.rmtree(trained / "step=0000" / "checkpoint")
    report = verify_run(trained)
    assert report.holds and report.tallies["checkpoints"].rows == 0 and report.tallies["datums"].rows
