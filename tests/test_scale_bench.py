"""`python -m bench scale` at its smallest sizes: the figures come out, and every Parquet table of those steps is the
one pinned in scale_tables.json, row for row: what the pipeline wrote before its stages learned to read only the
columns they need, with the seed's observation format (docs/layout.md, "Departures from the seed"). A change that
means to alter what a step writes pins the tables again (`python -m tests.test_scale_bench`) and says why."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import jobs.execute_round
from retool.run.shared import sandbox_for

pytestmark = pytest.mark.slow

# sha256 (first 16 hex digits) of each file's rows as JSON, exec_seconds aside.
PINNED_FILE = Path(__file__).with_name("scale_tables.json")
PINNED = json.loads(PINNED_FILE.read_text())


def table_digests(step_folder: Path) -> dict[str, str]:
    digests = {}
    for path in sorted(step_folder.rglob("*.parquet")):
        table = pq.read_table(path)
        rows = table.drop_columns([c for c in ("exec_seconds",) if c in table.column_names]).to_pylist()
        digests[str(path.relative_to(step_folder))] = hashlib.sha256(
            json.dumps(rows, sort_keys=True).encode()
        ).hexdigest()[:16]
    return digests


def test_the_scale_bench_reports_every_stage_and_the_tables_are_unchanged(tmp_path):
    from bench.scale import STAGE_ORDER, bench_scale

    rows = dict(bench_scale(tmp_path, sizes=((64, 1), (256, 4)), workers=(1,), luigid=False, long=False))
    steps = json.loads((tmp_path / "scale.json").read_text())
    assert [(s["trajectories"], s["shards"]) for s in steps] == [(64, 1), (256, 4)]
    for step in steps:
        assert set(step["stages"]) == set(STAGE_ORDER)
        # prompts, each shard's rounds, scores and datums, the step's scores (its datums' join is TrainStep's)
        assert step["tasks"] == 1 + 2 * 6 * step["shards"] + 2 * step["shards"] + 1
        for figures in step["stages"].values():
            assert figures["seconds"] > 0 and figures["peak_bytes"] > 0
        assert step["stages"]["SampleRound"]["output_bytes"] > 0
    assert all(f"exponent {name}" in rows for name in STAGE_ORDER)
    assert (tmp_path / "scale.png").stat().st_size > 0
    assert jobs.execute_round.sandbox_for is sandbox_for  # the bench's stand-in is gone: later tests run the real one
    for name, pinned in PINNED.items():
        digests = table_digests(tmp_path / f"{name}-320" / "step=0000")  # 320: the turns' median
        assert {path: digests.get(path) for path in pinned} == pinned, name
        shards = {path for path in digests if path.endswith(("/scored.parquet", "/datums.parquet"))}
        assert len(shards) == 2 * next(s["shards"] for s in steps if name.startswith(f"scale-{s['trajectories']}-"))


if __name__ == "__main__":  # pins the tables the two smallest steps write now
    import tempfile

    from bench.scale import bench_scale

    with tempfile.TemporaryDirectory() as workdir:
        bench_scale(Path(workdir), sizes=((64, 1), (256, 4)), workers=(1,), luigid=False, long=False)
        pinned = {name: table_digests(Path(workdir) / f"{name}-320" / "step=0000") for name in PINNED}
    PINNED_FILE.write_text(json.dumps(pinned, indent=1, sort_keys=True) + "\n")
