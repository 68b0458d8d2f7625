"""`python -m retool view`: a step's trajectories as one HTML page, checked as written and as a browser renders it
(headless Chromium from Debian's packages; `make test` installs it where it can)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from retool.evaluation.viewer import token_view
from tests.conftest import REPO
from tests.pipeline_helpers import TRAIN, build_train, step_dir, tool_policy

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# No sandbox (tests may run as root), and none of the background connections a closed network refuses.
HEADLESS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


def test_tokens_take_their_role_and_only_a_trained_trajectory_s_sampled_tokens_carry_the_loss():
    turns = [
        {"prompt_tokens": [1, 2], "completion_tokens": [3, 4], "logprobs": [-0.5, -0.25]},
        {"prompt_tokens": [1, 2, 3, 4, 5, 6], "completion_tokens": [7], "logprobs": [-1.0]},
    ]
    tokens = token_view([1, 2], turns, True, str)
    assert [(t.text, t.role, t.loss, t.logprob) for t in tokens] == [
        ("1", "prompt", False, None), ("2", "prompt", False, None), ("3", "sampled", True, -0.5),
        ("4", "sampled", True, -0.25), ("5", "observation", False, None), ("6", "observation", False, None),
        ("7", "sampled", True, -1.0),
    ]  # fmt: skip
    assert not any(t.loss for t in token_view([1, 2], turns, False, str))


BUILT: dict[str, Path] = {}  # the fixture's run as built


@pytest.fixture
def viewed(configure, monkeypatch, tmp_path, tmp_path_factory):
    """One trained step of a run whose branches call the tool (q + g) % 3 times; its page, written by the command."""
    settings = configure("viewed", trainer=TRAIN)
    if "run" in BUILT:  # built once per session: each test gets its own copy
        shutil.copytree(BUILT["run"], settings.run_dir)
    else:
        assert build_train(settings, 0, tool_policy(settings), monkeypatch)
        BUILT["run"] = tmp_path_factory.mktemp("viewed-run") / "viewed"
        shutil.copytree(settings.run_dir, BUILT["run"])
    page = tmp_path / "step0.html"
    command = [sys.executable, "-m", "retool", "view", str(settings.run_dir), "--step", "0", "--out", str(page)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "trajectories" in done.stdout, done.stderr[-2000:]
    return settings, page


def test_the_page_shows_each_trajectory_s_turns_tool_output_and_loss_tokens(viewed):
    import pyarrow.parquet as pq

    settings, page = viewed
    text = page.read_text()
    trajectories = pq.read_table(step_dir(settings, 0) / "trajectories.parquet").to_pylist()
    assert text.count('<section class="trajectory') == len(trajectories)
    # Question 1, branch 0 calls the tool once: its code and the sandbox's output (1 * 10 + 0 = 10) are shown.
    block = re.search(r'<section [^>]*id="q1-b0".*?</section>', text, re.DOTALL).group(0)
    assert "print(1 * 10 + 0)" in block and '<pre class="tool-output ok"' in block and ">10\n" in block
    trained = {
        (row["question_index"], row["group_index"])
        for row in pq.read_table(step_dir(settings, 0) / "datums.parquet").to_pylist()
    }
    for row in trajectories:
        block = re.search(
            rf'<section [^>]*id="q{row["question_index"]}-b{row["group_index"]}".*?</section>', text, re.DOTALL
        ).group(0)
        marked = block.count('class="tok sampled loss"')
        assert (marked > 0) == ((row["question_index"], row["group_index"]) in trained)
    missing = subprocess.run(
        [sys.executable, "-m", "retool", "view", str(settings.run_dir), "--step", "7"], cwd=REPO, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert missing.returncode == 2 and "no scored trajectories of step 7; scored: 0" in missing.stderr


@pytest.mark.skipif(
    CHROMIUM is None, reason="Chromium is not installed (make test installs Debian's chromium where apt can)"
)
def test_a_browser_renders_the_page_filters_it_and_draws_it(viewed, tmp_path):
    from PIL import Image

    _, page = viewed
    profile = ["--user-data-dir=" + str(tmp_path / "profile")]
    dump = subprocess.run(
        [CHROMIUM, *HEADLESS, *profile, "--dump-dom", f"file://{page}#correct=false"], capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    dom = dump.stdout
    assert "print(1 * 10 + 0)" in dom and 'class="tok sampled loss"' in dom, dump.stderr[-2000:]
    sections = re.findall(r"<section ([^>]*)>", dom)
    hidden = [s for s in sections if "hidden" in s]
    assert hidden and all('data-correct="true"' in s for s in hidden)  # the link's filter, applied by the script
    assert all('data-correct="false"' in s for s in sections if "hidden" not in s)
    shot = tmp_path / "page.png"
    subprocess.run(
        [CHROMIUM, *HEADLESS, *profile, f"--screenshot={shot}", "--window-size=1200,1600", f"file://{page}"],
        capture_output=True, timeout=120, check=True,
    )  # fmt: skip
    colours = Image.open(shot).convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 20  # text, code blocks and the trajectories' borders, not a blank
