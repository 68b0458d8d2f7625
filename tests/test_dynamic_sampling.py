"""Dynamic sampling (DAPO): a step draws more questions than it trains on and keeps only groups whose
answers differ in correctness, the first questions_per_step of them; the same seed gives the same rows."""

from __future__ import annotations

import pyarrow.parquet as pq

from retool.data.examples import MathExample
from retool.files.tables import TRAJECTORIES, read_table
from retool.rollout.scoring import keep_groups
from retool.rollout.state import Trajectory
from tests.pipeline_helpers import TRAIN, build_train, step_dir
from tests.policies import some_groups_agree


def group(question: int, correct: list[bool]) -> list[Trajectory]:
    example = MathExample(f"q{question}", "?", "1", "test")
    return [Trajectory(example, question, g, [], correct=c) for g, c in enumerate(correct)]


def test_only_groups_of_mixed_correctness_are_kept_until_the_step_is_full():
    trajectories = [
        t
        for q, correct in enumerate(
            [[True, True], [False, True], [False, False], [True, False], [False, True], [True, False]]
        )
        for t in group(q, correct)
    ]
    keep_groups(trajectories, limit=2)
    assert sorted({t.question_index for t in trajectories if t.kept}) == [1, 3]  # mixed, in order, until full
    keep_groups(trajectories, limit=None)
    assert all(t.kept for t in trajectories)  # without dynamic sampling every group trains


def test_a_step_with_dynamic_sampling_trains_on_kept_groups_only_and_reruns_identically(configure, monkeypatch):
    runs = []
    for name in ("dynamic", "again"):
        settings = configure(name, data={"questions_per_step": 2, "questions_drawn": 8}, trainer=TRAIN)
        assert build_train(settings, 0, some_groups_agree(settings), monkeypatch)
        runs.append(settings)
    folder = step_dir(runs[0], 0)
    trajectories = read_table(folder / "trajectories.parquet", TRAJECTORIES).to_pylist()
    assert len({t["question_index"] for t in trajectories}) == 8  # every drawn question was rolled out
    assert sorted({t["question_index"] for t in trajectories if t["kept"]}) == [2, 3]  # 6 and 7 mixed, too late
    datums = pq.read_table(folder / "datums.parquet").to_pylist()
    assert {d["question_index"] for d in datums} == {2, 3}
    (metrics,) = pq.read_table(folder / "metrics.parquet").to_pylist()
    assert (metrics["groups_drawn"], metrics["groups_kept"], metrics["train_datums"]) == (8, 2, len(datums))
    for name in ("trajectories.parquet", "datums.parquet"):
        assert pq.read_table(folder / name).equals(pq.read_table(step_dir(runs[1], 0) / name))


def test_a_step_in_shards_writes_the_rows_of_a_step_in_one(configure, monkeypatch):
    """Each shard is scored and turned into datums in its own task; which groups train is decided over the whole
    step, so the step's files are those of the same step in one shard (seeds follow questions, not shards)."""
    folders = []
    for name, shards in (("one", 1), ("three", 3)):
        sections = {"data": {"questions_per_step": 2, "questions_drawn": 8}, "rollout": {"shards": shards}}
        settings = configure(name, **sections, trainer=TRAIN)
        assert build_train(settings, 0, some_groups_agree(settings), monkeypatch)
        folders.append(step_dir(settings, 0))
    one, three = folders
    assert len(list(three.glob("shard=*/scored.parquet"))) == len(list(three.glob("shard=*/datums.parquet"))) == 3
    for name in ("trajectories.parquet", "datums.parquet"):
        assert pq.read_table(one / name).equals(pq.read_table(three / name)), name
    kept = [
        row["kept"] for path in sorted(three.glob("shard=*/scored.parquet")) for row in pq.read_table(path).to_pylist()
    ]
    assert all(kept)  # a shard's scores keep every group: the step's file decides
