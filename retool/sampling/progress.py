"""Progress of a sampling call, in sequences and tokens: a tqdm bar on a terminal; in a log file or a pipe,
one plain line every LOG_EVERY_SECONDS once the call has run that long."""

from __future__ import annotations

import io
import sys

from tqdm import tqdm

LOG_EVERY_SECONDS = 30.0  # between progress lines when stderr is not a terminal (and before the first one)
LOG_FORMAT = "{desc}: {n_fmt}/{total_fmt} sequences, {elapsed} elapsed{postfix}"


class _WholeLines(io.TextIOBase):
    """tqdm redraws its bar in place with carriage returns, which a log file shows as one endless line:
    this writes each redraw as a line of its own."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        line = text.replace("\r", "").strip()
        if line:
            self.stream.write(line + "\n")
            self.stream.flush()
        return len(text)


class _LogBar(tqdm):
    """Quiet until `delay` has passed, even when the caller forces a refresh (vLLM does so once its count
    reaches the number of requests), so that a short call leaves no line in the log."""

    def refresh(self, *args, **kwargs):
        if self.delay > 0 and self._time() < self.start_t + self.delay:
            return False
        return super().refresh(*args, **kwargs)


def sampling_progress(total_sequences: int, what: str = "sampling") -> tqdm:
    """A bar to `update(sequences)` as sequences finish; `set_tokens(bar, n)` adds the tokens sampled so far."""
    if sys.stderr.isatty():
        return tqdm(total=total_sequences, desc=what, unit="seq", leave=False, dynamic_ncols=True)
    return _LogBar(
        total=total_sequences,
        desc=what,
        file=_WholeLines(sys.stderr),
        mininterval=LOG_EVERY_SECONDS,
        delay=LOG_EVERY_SECONDS,
        bar_format=LOG_FORMAT,
    )


def set_tokens(bar: tqdm, tokens: int) -> None:
    bar.set_postfix_str(f"{tokens} tokens", refresh=False)
