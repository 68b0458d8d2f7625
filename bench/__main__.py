"""`python -m bench [names]`: runs the benchmarks and prints their figures."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench.benchmarks import (
    bench_pipeline_vs_memory,
    bench_round_barrier,
    bench_sampler,
    bench_sandbox,
    bench_stage_overhead,
    bench_trainer,
)
from bench.learning import bench_learning
from bench.server import bench_server
from jobs.models import build_default_model

BENCHMARKS = {
    "pipeline": bench_pipeline_vs_memory,
    "barrier": bench_round_barrier,
    "overhead": bench_stage_overhead,
    "sandbox": bench_sandbox,
    "trainer": bench_trainer,
    "sampler": bench_sampler,
    "learning": bench_learning,
    "server": bench_server,
}


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description="Benchmarks: figures, and the configuration behind them."
    )
    parser.add_argument("names", nargs="*", help=f"benchmarks to run, of {', '.join(BENCHMARKS)} (default: all)")
    args = parser.parse_args()
    unknown = [name for name in args.names if name not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmarks {unknown}; choose from {', '.join(BENCHMARKS)}")
    build_default_model()
    with tempfile.TemporaryDirectory(prefix="retool-bench-") as workdir:
        for name in args.names or BENCHMARKS:
            started = time.perf_counter()
            rows = BENCHMARKS[name](Path(workdir))
            print(f"\n== {name} ({time.perf_counter() - started:.0f} s)")
            width = max(len(label) for label, _ in rows)
            for label, value in rows:
                print(f"  {label:<{width}}  {value}")


if __name__ == "__main__":
    main()
