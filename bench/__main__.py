"""`python -m bench [names]`: runs the benchmarks and prints their figures."""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
from pathlib import Path

from bench.async_steps import bench_async
from bench.benchmarks import (
    bench_pipeline_vs_memory,
    bench_round_barrier,
    bench_sampler,
    bench_sandbox,
    bench_stage_overhead,
    bench_trainer,
)
from bench.cluster import bench_cluster
from bench.learning import LEARNING_SAMPLES, LEARNING_STEPS, bench_learning
from bench.scale import bench_scale
from bench.server import bench_server
from bench.train_io import bench_train_io
from bench.verify_cost import bench_verify
from retool.weights.models import build_default_model

BENCHMARKS = {
    "pipeline": bench_pipeline_vs_memory,
    "barrier": bench_round_barrier,
    "overhead": bench_stage_overhead,
    "sandbox": bench_sandbox,
    "trainer": bench_trainer,
    "sampler": bench_sampler,
    "learning": bench_learning,
    "server": bench_server,
    "cluster": bench_cluster,
    "train-io": bench_train_io,
    "async": bench_async,
    "scale": bench_scale,
    "verify": bench_verify,
}


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description="Benchmarks: figures, and the configuration behind them."
    )
    parser.add_argument("names", nargs="*", help=f"benchmarks to run, of {', '.join(BENCHMARKS)} (default: all)")
    learning = parser.add_argument_group("learning", "options of the learning benchmark")
    learning.add_argument(
        "--set", action="append", default=[], metavar="SECTION.NAME=VALUE", help="a setting other than cpu.cfg's"
    )
    learning.add_argument("--steps", type=int, default=LEARNING_STEPS, help="RL steps (default: %(default)s)")
    learning.add_argument("--samples", type=int, default=LEARNING_SAMPLES, help="evaluation samples per question")
    learning.add_argument(
        "--reuse",
        type=Path,
        help="an earlier learning run whose cold start to reuse, and its SFT scores where no "
        "[rollout], [sampler], [sandbox] or [model] setting changes",
    )
    learning.add_argument(
        "--against", type=Path, help="an earlier learning run (<its --out>/learning) whose final policy to pair with"
    )
    parser.add_argument("--out", type=Path, help="keep the benchmarks' run folders here (default: a temporary folder)")
    args = parser.parse_args()
    BENCHMARKS["learning"] = functools.partial(
        bench_learning,
        overrides=args.set,
        steps=args.steps,
        samples=args.samples,
        reuse=args.reuse,
        against=args.against,
    )
    unknown = [name for name in args.names if name not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmarks {unknown}; choose from {', '.join(BENCHMARKS)}")
    build_default_model()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="retool-bench-", dir=args.out) as temporary:
        workdir = args.out or temporary
        for name in args.names or BENCHMARKS:
            started = time.perf_counter()
            rows = BENCHMARKS[name](Path(workdir))
            print(f"\n== {name} ({time.perf_counter() - started:.0f} s)")
            width = max(len(label) for label, _ in rows)
            for label, value in rows:
                print(f"  {label:<{width}}  {value}")


if __name__ == "__main__":
    main()
