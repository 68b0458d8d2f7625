"""`python -m retool sandbox FILE`: runs a Python file in the sandbox and prints what the model would see."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from retool.config.rollout import RolloutConfig
from retool.config.sandbox import OBSERVATIONS, SandboxConfig
from retool.protocol.tool_calls import PROTOCOL_TAGS, neutralise
from retool.sandbox.call import Sandbox

DESCRIPTION = """Run a Python file in the sandbox and print the tool message the model would see (in the
--observation format: by default what the code prints, or on an error its stderr), with the model's special tokens
neutralised and, with --tokenizer, cut to its last --max-tokens tokens as the rollout cuts it. Exits 0 when the code
ran without error, 1 otherwise."""


def parse_arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m retool sandbox", description=DESCRIPTION)
    parser.add_argument("file", type=Path, help="Python file to run")
    parser.add_argument("--json", action="store_true", help="print status, stdout, stderr and seconds as JSON")
    parser.add_argument(
        "--timeout", type=float, default=SandboxConfig.timeout_seconds, help="wall-clock limit in seconds"
    )
    parser.add_argument("--memory-mb", type=int, default=SandboxConfig.memory_mb, help="address-space limit in MB")
    parser.add_argument(
        "--observation",
        choices=OBSERVATIONS,
        default=SandboxConfig.observation,
        help="the format of the tool message ([sandbox] observation, %(default)s)",
    )
    parser.add_argument(
        "--tokenizer",
        help="model folder (or 'default') whose tokenizer counts the message and whose special tokens are "
        "neutralised; without it the message is printed whole",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=RolloutConfig.max_tool_response_tokens,
        help="with --tokenizer: tokens the message may hold ([rollout] max_tool_response_tokens, %(default)s)",
    )
    args = parser.parse_args(argv)
    if not args.file.is_file():
        parser.error(f"{args.file}: no such file")
    if args.max_tokens < 1:
        parser.error(f"--max-tokens {args.max_tokens}: must be at least 1")
    return args


def model_view(text: str, tokenizer: str | None, max_tokens: int) -> str:
    """The tool message as the rollout makes it: special tokens neutralised, then cut to its tail."""
    if not tokenizer:
        return neutralise(text, PROTOCOL_TAGS)
    from retool.protocol.chat import ChatProtocol, load_tokenizer
    from retool.rollout.state import cut_to_fit
    from retool.weights.models import resolve_model

    protocol = ChatProtocol(load_tokenizer(resolve_model(tokenizer)))
    content = neutralise(text, protocol.forbidden_strings)
    fitted = cut_to_fit(content, protocol, lambda cut: protocol.count_tokens(cut) - max_tokens)
    return fitted if fitted is not None else f"(not even the truncation marker fits in {max_tokens} tokens)"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_arguments(argv)
    sandbox = Sandbox(
        SandboxConfig(timeout_seconds=args.timeout, memory_mb=args.memory_mb, observation=args.observation)
    )
    result = sandbox.run_code(args.file.read_text(encoding="utf-8"))
    if args.json:
        print(json.dumps(asdict(result), ensure_ascii=False, indent=2))
    else:
        shown = model_view(sandbox.observation(result), args.tokenizer, args.max_tokens)
        print(shown, end="" if shown.endswith("\n") else "\n")
    return 0 if result.status == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
