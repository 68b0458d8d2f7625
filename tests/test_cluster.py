"""Several nodes through one central scheduler: a real luigid on 127.0.0.1 and real Luigi commands in separate
processes, configured by configs/cluster.cfg as docs/multi-node.md says."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from bench.cluster import command, finished, free_port, luigid, write_config
from tests.helpers import assert_verifies

pytestmark = pytest.mark.slow
STAGE_LINE = re.compile(r"^(\w+\([^)]*\)): .* -> ", re.MULTILINE)  # one per stage a command ran, then the last


@pytest.fixture
def scheduler(tmp_path, tiny_model_dir):
    """A central scheduler on a free port of 127.0.0.1, with the test's retry policy."""
    port = free_port()
    config = write_config(tmp_path / "luigid.cfg", tiny_model_dir, tmp_path / "runs", "unused", port)
    with luigid(config, port, tmp_path / "luigid.pickle"):
        yield port


def wait_for(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def rollout_tables(run: Path) -> dict[str, list[dict]]:
    """Every rollout and training table of a run, by path, without the columns that time things."""
    tables = {}
    for path in sorted(run.glob("step=*/**/*.parquet")):
        if path.name == "metrics.parquet":
            continue
        table = pq.read_table(path)
        kept = [name for name in table.column_names if name != "exec_seconds"]
        tables[str(path.relative_to(run))] = table.select(kept).to_pylist()
    return tables


@pytest.fixture
def reference(tmp_path, tiny_model_dir):
    """The same run in one process with Luigi's local scheduler."""

    def run(target: str, step: int) -> dict:
        config = write_config(tmp_path / "reference.cfg", tiny_model_dir, tmp_path / "runs", "one", 0, central=False)
        code, stdout, stderr = finished(
            command(config, tmp_path / "one", target, "--step", str(step), "--workers", "2")
        )
        assert code == 0, stderr[-3000:]
        return rollout_tables(tmp_path / "runs" / "one")

    return run


def test_two_nodes_that_join_at_different_times_share_the_shards_and_both_exit_0(
    scheduler, tmp_path, tiny_model_dir, reference
):
    config = write_config(tmp_path / "nodes.cfg", tiny_model_dir, tmp_path / "runs", "shared", scheduler)
    first = command(config, tmp_path / "first", "TrainStep", "--step", "1", "--workers", "2")
    # The second node joins while the first trains step 0: step 1's shards are all still to come.
    wait_for(lambda: (tmp_path / "runs/shared/step=0000/datums.parquet").exists(), 180, "step 0's datums")
    second = command(config, tmp_path / "second", "TrainStep", "--step", "1", "--workers", "2")
    (code_first, out_first, err_first), (code_second, out_second, err_second) = finished(first), finished(second)
    assert code_first == 0, err_first[-3000:]
    assert code_second == 0, err_second[-3000:]
    ran_first, ran_second = (STAGE_LINE.findall(out.rstrip().rsplit("\n", 1)[0]) for out in (out_first, out_second))
    assert not set(ran_first) & set(ran_second) and len(ran_first + ran_second) == len(set(ran_first + ran_second))
    assert any(label.startswith(("SampleRound(step=1", "ExecuteRound(step=1")) for label in ran_second)
    assert any(label.startswith(("SampleRound(step=1", "ExecuteRound(step=1")) for label in ran_first)
    assert out_second.rstrip().splitlines()[-1].startswith("TrainStep(step=1): ")  # done, or already complete
    assert rollout_tables(tmp_path / "runs" / "shared") == reference("TrainStep", 1)
    assert_verifies(tmp_path / "runs" / "shared")


def test_a_node_killed_in_the_middle_of_a_shard_loses_nothing(scheduler, tmp_path, tiny_model_dir, reference):
    config = write_config(tmp_path / "nodes.cfg", tiny_model_dir, tmp_path / "runs", "shared", scheduler)
    survivor = command(config, tmp_path / "survivor", "TrainStep", "--step", "0", "--workers", "1")
    victim = command(config, tmp_path / "victim", "TrainStep", "--step", "0", "--workers", "1", debug=True)
    victim_log = victim.log.with_suffix(".err")

    def victim_runs_a_round() -> bool:  # Luigi's INFO line when a task starts
        return (
            bool(re.search(r"running +(SampleRound|ExecuteRound)\(", victim_log.read_text()))
            or victim.poll() is not None
        )

    wait_for(victim_runs_a_round, 180, "the victim to start a round")
    assert victim.poll() is None, victim_log.read_text()[-3000:]
    time.sleep(0.1)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.wait()
    code, stdout, stderr = finished(survivor)
    assert code == 0, stderr[-3000:]
    assert stdout.rstrip().splitlines()[-1].startswith("TrainStep(step=0): done -> ")
    assert not list((tmp_path / "runs/shared").rglob("*.tmp-*"))  # nothing half-written is left
    assert rollout_tables(tmp_path / "runs" / "shared") == reference("TrainStep", 0)
    assert_verifies(tmp_path / "runs" / "shared")


def test_a_target_that_fails_on_one_node_fails_every_node_with_task_failed(scheduler, tmp_path, tiny_model_dir):
    """A training step that cannot pass the policy-sync check (scripted logprobs are made up) fails, is retried,
    and is disabled: both nodes exit with [retcode] task_failed and a last line naming the failure."""
    strict = {"trainer": {"max_sampler_gap": "1e-9"}}
    config = write_config(tmp_path / "nodes.cfg", tiny_model_dir, tmp_path / "runs", "failing", scheduler, **strict)
    nodes = [command(config, tmp_path / f"node{n}", "TrainStep", "--step", "0", "--workers", "2") for n in (1, 2)]
    for code, stdout, stderr in (finished(node) for node in nodes):
        assert code == 30, stderr[-3000:]
        assert stdout.rstrip().splitlines()[-1].startswith("TrainStep(step=0): not done: ")


def test_a_scheduler_that_does_not_answer_is_one_line_naming_its_address(tmp_path, tiny_model_dir):
    port = free_port()  # nothing listens there
    config = write_config(tmp_path / "nodes.cfg", tiny_model_dir, tmp_path / "runs", "alone", port)
    code, stdout, stderr = finished(command(config, tmp_path / "alone", "Prompts", "--step", "0"), 120)
    assert code != 0
    assert f"the central scheduler at http://127.0.0.1:{port}" in stderr and "does not answer" in stderr
    assert "Traceback" not in stderr, stderr[-3000:]
