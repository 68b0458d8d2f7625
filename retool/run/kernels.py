"""Qwen3.5's linear-attention kernels on a GPU node: each is active only when its ops import. The imports are tried
in a child process (`python -m retool.run.kernels`): fla initialises CUDA as it imports, which would break the
command's later forks, and an extension built against another torch may end the process rather than raise."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

# distribution -> (package, the imports that must succeed). transformers' Qwen3.5 and Qwen3-Next take these ops where
# they import, else a slower torch path; causal_conv1d_cuda is causal-conv1d's compiled op, built against one torch.
LINEAR_ATTENTION_KERNELS = {
    "flash-linear-attention": (
        "fla",
        ("from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule",),
    ),
    "causal-conv1d": (
        "causal_conv1d",
        ("from causal_conv1d import causal_conv1d_fn, causal_conv1d_update", "import causal_conv1d_cuda"),
    ),
}
PROBE_SECONDS = 300  # a first import may compile kernels


def kernel_states() -> dict[str, str]:
    """Each kernel's state: "active", "missing", or "installed but broken: " and why."""
    states = {
        name: "missing"
        for name, (package, _) in LINEAR_ATTENTION_KERNELS.items()
        if not importlib.util.find_spec(package)
    }
    installed = {name: imports for name, (_, imports) in LINEAR_ATTENTION_KERNELS.items() if name not in states}
    if not installed:
        return states
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}  # the child imports what this process would
    command = [sys.executable, "-m", "retool.run.kernels", json.dumps(installed)]
    try:
        child = subprocess.run(command, capture_output=True, env=environment, timeout=PROBE_SECONDS)
        output, ended = child.stdout, f"its import ended the process (exit status {child.returncode})"
    except subprocess.TimeoutExpired as timeout:
        output, ended = timeout.stdout or b"", f"its import took over {PROBE_SECONDS} s"
    for line in output.decode(errors="replace").splitlines():
        try:
            name, error = json.loads(line)
        except (ValueError, TypeError):
            continue  # a library's own output
        if name in installed:
            states[name] = "active" if error is None else f"installed but broken: {error}"
    return {name: states.get(name, f"installed but broken: {ended}") for name in LINEAR_ATTENTION_KERNELS}


def main() -> None:
    """The child's side: one JSON line [name, error or null] per kernel, as each one's imports end."""
    for name, imports in json.loads(sys.argv[1]).items():
        try:
            for statement in imports:
                exec(statement, {})
            error = None
        except BaseException as caught:  # an extension's undefined symbol, a missing op, a CUDA error
            error = f"{type(caught).__name__}: {caught}"
        print(json.dumps([name, error]), flush=True)


if __name__ == "__main__":
    main()
