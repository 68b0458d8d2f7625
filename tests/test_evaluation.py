"""Evaluation: estimators against hand-computed values, and Evaluate on the tiny model in both modes."""

from __future__ import annotations

import re

import luigi
import pyarrow as pa
import pytest

import pipeline.tasks
import retool.sampling.engines
from retool.evaluation.scores import mean_ci, pass_at_k, summarize_eval
from retool.files.tables import TRAJECTORIES, table_from_rows
from retool.run.shared import protocol_for
from retool.sampling.scripted import ScriptedSampler
from tests.conftest import REPO
from tests.helpers import scripted, tool_call_text


def test_pass_at_k_matches_hand_computed_values():
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)
    assert pass_at_k(4, 3, 2) == 1.0  # fewer wrong samples than k
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_mean_and_interval():
    mean, half = mean_ci([0.0, 1.0, 0.0, 1.0])
    assert mean == 0.5 and half == pytest.approx(1.959964 * (1 / 3) ** 0.5 / 2)
    assert mean_ci([0.3]) == (0.3, 0.0)


def rows(correct_by_question):
    out = []
    for q, flags in enumerate(correct_by_question):
        for g, ok in enumerate(flags):
            out.append(
                {
                    "step": 0,
                    "question_index": q,
                    "group_index": g,
                    "example_id": str(q),
                    "data_source": "t",
                    "answer": "1",
                    "num_turns": 2 if ok else 1,
                    "code_calls": 1 if ok else 0,
                    "code_calls_ok": 1 if ok and q == 2 else 0,  # question 0's one call raised
                    "stop_reason": "answer",
                    "final_text": "",
                    "extracted_answer": "1" if ok else None,
                    "valid_format": ok or g == 0,
                    "correct": ok,
                    "reward": 1.0 if ok else -1.0,
                    "advantage": 0.0,
                    "trajectory_tokens": 10,
                    "sampled_tokens": 5,
                }
            )
    return table_from_rows(out, TRAJECTORIES)


def test_summary_counts_by_hand():
    summary = summarize_eval(rows([[True, False, False, False], [False] * 4, [True, True, False, True]]), n=4)
    assert summary["average_at_n"] == pytest.approx((0.25 + 0 + 0.75) / 3)
    assert summary["pass_at_n"] == pytest.approx(2 / 3)
    assert summary["pass_at_1"] == pytest.approx(summary["average_at_n"])  # pass@1 is the mean correctness
    assert summary["pass_at_2"] == pytest.approx((0.5 + 0 + 1.0) / 3)
    assert summary["pass_at_4"] == pytest.approx(summary["pass_at_n"])
    assert summary["format"] == pytest.approx(5 / 12)  # the 4 correct, plus branch 0 of question 1
    assert summary["valid_accuracy"] == pytest.approx(4 / 5)  # correct among the 5 valid answers
    assert summary["tool_use"] == pytest.approx(4 / 12) and summary["valid_tool_use"] == pytest.approx(3 / 12)
    assert summary["stop_answer"] == 12 and summary["questions"] == 3
    with pytest.raises(ValueError, match="exactly n=4"):
        summarize_eval(rows([[True, False]]), n=4)


@pytest.mark.parametrize("mode", ["retool", "text-only"])
def test_evaluate_on_the_tiny_model(configure, monkeypatch, tmp_path, mode):
    from retool.data.examples import MathExample, write_examples

    dataset = tmp_path / "aime_like.jsonl"
    write_examples([MathExample(str(i), f"What is {i} + {i}?", str(2 * i), "aime") for i in range(3)], dataset)
    settings = configure("eval")
    protocol = protocol_for(settings.model)

    def choose(question, group, turn):
        if turn == 0 and group == 0:
            return tool_call_text("print(1 + 1)", protocol.tool_format)
        return f"\\boxed{{{2 * question if group < 2 else -1}}}"

    monkeypatch.setattr(
        retool.sampling.engines,
        "sampler_for",
        lambda s, policy=None, shard=0, in_memory=None: ScriptedSampler(scripted(protocol_for(s.model), choose)),
    )
    task = pipeline.Evaluate(step=-1, dataset=str(dataset), n=3, eval_mode=mode)
    assert luigi.build([task], local_scheduler=True, workers=1, log_level="WARNING")
    summary = pa.parquet.read_table(task.output().path).to_pylist()[0]
    prompt = pa.parquet.read_table(folder_of(settings, mode) / "prompts.parquet").column("prompt_tokens")[0].as_py()
    assert ("code_interpreter" in protocol.tokenizer.decode(prompt)) == (mode == "retool")  # text-only declares no tool
    folder = folder_of(settings, mode)
    assert task.output().path == str(folder / "summary.parquet")
    assert not (settings.run_dir / "step=-001").exists() and not list(settings.run_dir.glob("step=*"))
    assert summary["questions"] == 3 and summary["generations"] == 9 and summary["n"] == 3
    if mode == "retool":  # branch 0 calls the tool, then answers correctly
        assert summary["average_at_n"] == pytest.approx(2 / 3) and summary["code_calls"] == pytest.approx(1 / 3)
        assert summary["stop_answer"] == 9
    else:  # one turn, no tool: branch 0's call ends it
        assert summary["average_at_n"] == pytest.approx(1 / 3) and summary["code_calls"] == 0
        assert summary["stop_max_turns"] == 3 and summary["turns"] == 1
    assert summary["pass_at_n"] == 1.0


def folder_of(settings, mode):
    (folder,) = settings.run_dir.glob(f"eval/aime_like-*/{mode}-n3/checkpoint=base")
    return folder


def test_one_hive_glob_reads_every_evaluated_checkpoint_apart(tmp_path):
    """Folders checkpoint=base|sft|stepNNNN: the label does not clash with the files' integer `step` column (base and
    the cold start both -1), and the docs' question-by-question comparison runs as written."""
    import polars as pl

    from retool.files.layout import RunFolder

    run = RunFolder(tmp_path / "run")
    for step, sft, correct in ((-1, False, [False, False]), (-1, True, [True, False]), (3, False, [True, True])):
        folder = run.evaluation("synthetic_eval-0123/retool-n2", step, sft).path
        folder.mkdir(parents=True)
        rows = {"step": [step, step], "example_id": ["a", "b"], "data_source": ["x", "y"], "correct": correct}
        pl.DataFrame(rows).write_parquet(folder / "trajectories.parquet")
    page = (REPO / "docs/evaluation.md").read_text()
    snippet = re.search(r"Two\ncheckpoints, question by question:\n\n```python\n(.*?)```", page, re.DOTALL).group(1)
    namespace = {"print": lambda *_: None}
    exec(snippet.replace("runs/cpu-default", str(run.path)).replace("print(", "result = ("), namespace)
    assert sorted(namespace["evaluated"]["checkpoint"].unique()) == ["base", "sft", "step0003"]
    assert namespace["result"]["gain"].to_list() == [0.0, 1.0]  # a: right after SFT and RL; b: only after RL
