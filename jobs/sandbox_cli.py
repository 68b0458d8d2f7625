"""`python -m jobs.sandbox_cli FILE`: runs a Python file in the sandbox and prints what the model would see."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from jobs.protocol import PROTOCOL_TAGS, neutralise
from jobs.sandbox import Sandbox, SandboxConfig


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run a Python file in the sandbox and print what the model would see.")
    parser.add_argument("file", type=Path, help="Python file to run")
    parser.add_argument("--json", action="store_true", help="print status, stdout, stderr and seconds as JSON")
    parser.add_argument(
        "--timeout", type=float, default=SandboxConfig.timeout_seconds, help="wall-clock limit in seconds"
    )
    parser.add_argument("--memory-mb", type=int, default=SandboxConfig.memory_mb, help="address-space limit in MB")
    parser.add_argument("--tokenizer", help="model folder whose special tokens are neutralised in the output")
    args = parser.parse_args(argv)
    if not args.file.is_file():
        parser.error(f"{args.file}: no such file")
    forbidden = PROTOCOL_TAGS
    if args.tokenizer:
        from jobs.protocol import load_tokenizer, special_token_strings

        forbidden = forbidden + special_token_strings(load_tokenizer(args.tokenizer))
    sandbox = Sandbox(SandboxConfig(timeout_seconds=args.timeout, memory_mb=args.memory_mb))
    result = sandbox.run_code(args.file.read_text(encoding="utf-8"))
    if args.json:
        print(json.dumps({key: value for key, value in asdict(result).items()}, ensure_ascii=False, indent=2))
    else:
        print(neutralise(sandbox.observation(result), forbidden))
    return 0 if result.status == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
