"""What one call of the sandbox gives back (ExecutionResult), and the text the model reads of it: the tool message
in the format [sandbox] observation selects (docs/layout.md, "Departures from the seed")."""

from __future__ import annotations

from dataclasses import dataclass

from retool.config.sandbox import SandboxConfig


@dataclass(frozen=True)
class ExecutionResult:
    status: str  # ok | error | timeout
    stdout: str  # tail of standard output
    stderr: str  # tail of standard error (tracebacks land here)
    seconds: float  # wall time of the call
    exit_code: int | None  # the child's exit status; negative for a signal; None after a timeout


SEED_OUTPUT_CHARACTERS = 4096  # [sandbox] observation = seed: the end of the output the model reads


def observation_text(result: ExecutionResult, config: SandboxConfig) -> str:
    """The text of one call's tool message, before the protocol neutralises its special tokens, in the format of
    [sandbox] observation (docs/layout.md, "Departures from the seed")."""
    if config.observation == "notebook":
        parts = [part.rstrip("\n") for part in (result.stdout, result.stderr) if part.strip()]
        return "\n".join(parts) if parts else "(no output)"
    if result.status == "timeout":
        return f"Error: execution timed out after {config.timeout_seconds:g} seconds."
    if result.status == "ok":
        return _last_characters(result.stdout)
    if result.stderr:
        return _last_characters(result.stderr)
    return f"Error: process exited with code {result.exit_code}."


def _last_characters(text: str, limit: int = SEED_OUTPUT_CHARACTERS) -> str:
    return text if len(text) <= limit else f"[... truncated {len(text) - limit} chars ...]\n{text[-limit:]}"
