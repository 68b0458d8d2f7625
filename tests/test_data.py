import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from retool.data.examples import (
    DataError,
    MathExample,
    read_examples,
    shuffled,
    strip_dapo_wrapper,
    take_batch,
    write_examples,
)
from retool.data.synthetic import generate

DAPO_CONTENT = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\nWhat is $1+1$?\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)


def test_jsonl_round_trip(tmp_path):
    examples = [MathExample("a", "What is 1+1?", "2", "mine"), MathExample("b", "Q2", "3", "mine")]
    write_examples(examples, tmp_path / "set.jsonl")
    assert read_examples(tmp_path / "set.jsonl") == examples


def test_dapo_layout_from_parquet(tmp_path):
    rows = [
        {
            "data_source": "math_dapo",
            "prompt": [{"role": "user", "content": DAPO_CONTENT}],
            "reward_model": {"ground_truth": "2", "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": "abc-1"},
        }
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "dapo.parquet")
    (example,) = read_examples(tmp_path / "dapo.parquet")
    assert example == MathExample("abc-1", "What is $1+1$?", "2", "math_dapo")


def test_dapo_wrapper_is_stripped_and_plain_text_kept():
    assert strip_dapo_wrapper(DAPO_CONTENT) == "What is $1+1$?"
    assert strip_dapo_wrapper("Just a question?") == "Just a question?"


def test_aime_layout_with_integer_answers(tmp_path):
    path = tmp_path / "aime.jsonl"
    path.write_text(json.dumps({"id": 7, "problem": "Find x.", "answer": 204}) + "\n")
    assert read_examples(path) == [MathExample("7", "Find x.", "204", "aime")]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"id": "a", "question": "Q"}', "line 2: field 'answer' is missing"),
        ('{"id": "a", "question": ["Q"], "answer": "1"}', "line 2: field 'question' must be a string"),
        ('{"id": "a", "question": "  ", "answer": "1"}', "line 2: field 'question' is empty"),
        ("{not json", "line 2: not valid JSON"),
    ],
)
def test_malformed_row_names_file_and_row(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": "ok", "question": "Q", "answer": "1"}\n' + line + "\n")
    with pytest.raises(DataError, match=message) as error:
        read_examples(path)
    assert str(path) in str(error.value)


def test_empty_missing_and_foreign_files_are_clear_errors(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="has no examples"):
        read_examples(tmp_path / "empty.jsonl")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        read_examples(tmp_path / "broken.parquet")
    with pytest.raises(DataError, match="unsupported data file type"):
        read_examples(tmp_path / "data.csv")
    with pytest.raises(DataError, match="does not exist"):
        read_examples(tmp_path / "missing.jsonl")


def test_shuffle_is_deterministic_and_a_permutation():
    examples = generate(20, seed=0, prefix="t")
    assert shuffled(examples, 3) == shuffled(examples, 3)
    assert shuffled(examples, 3) != shuffled(examples, 4)
    assert sorted(shuffled(examples, 3), key=lambda e: e.id) == examples


def test_take_batch_cycles_through_the_data():
    examples = generate(5, seed=0, prefix="t")
    assert [e.id for e in take_batch(examples, 0, 3)] == ["t-00000", "t-00001", "t-00002"]
    assert [e.id for e in take_batch(examples, 1, 3)] == ["t-00003", "t-00004", "t-00000"]
    with pytest.raises(DataError):
        take_batch([], 0, 3)
