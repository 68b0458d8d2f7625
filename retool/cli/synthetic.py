"""`python -m retool synthetic --out data`: writes the shipped synthetic data sets."""

from __future__ import annotations

import argparse
from pathlib import Path

from retool.data.examples import write_examples
from retool.data.synthetic import evaluation_questions, training_questions, write_traces


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m retool synthetic", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("data"), help="folder for the data files (default: data)")
    parser.add_argument("--traces", type=int, default=600, help="worked solutions in synthetic_sft.jsonl")
    parser.add_argument("--train", type=int, default=1024, help="questions in synthetic_train.jsonl")
    parser.add_argument("--eval-per-sft-family", type=int, default=7, help="evaluation questions per sft family")
    # 25 x the 4 rl families: the rl row group of the before/after table has 100 questions
    parser.add_argument("--eval-per-rl-family", type=int, default=25, help="evaluation questions per rl family")
    parser.add_argument(
        "--eval-per-held-out-family", type=int, default=24, help="evaluation questions per held-out family"
    )
    parser.add_argument(
        "--mistake-share", type=float, default=0.25, help="share of solutions that correct a wrong first call"
    )
    args = parser.parse_args()
    sft = write_traces(args.out / "synthetic_sft.jsonl", args.traces, args.mistake_share)
    training = training_questions(args.train)
    write_examples(training, args.out / "synthetic_train.jsonl")
    trained = frozenset([c.question for c in sft] + [e.question for e in training])
    evaluation = evaluation_questions(
        args.eval_per_sft_family, args.eval_per_rl_family, args.eval_per_held_out_family, trained
    )
    write_examples(evaluation, args.out / "synthetic_eval.jsonl")
    print(
        f"wrote {args.traces} worked solutions, {args.train} training and {len(evaluation)} evaluation questions "
        f"under {args.out}/"
    )


if __name__ == "__main__":
    main()
