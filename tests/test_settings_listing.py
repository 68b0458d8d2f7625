"""`python -m retool settings`: every setting with its default and the comment it is declared with."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import fields

from retool.cli.settings import declared_comments
from retool.config.settings import RunSettings, setting_fields
from tests.conftest import REPO


def test_every_setting_is_declared_with_a_comment():
    undescribed = [
        f"[{section.name}] {setting.name}"
        for section in fields(RunSettings)
        for setting in setting_fields(section.name, section.default_factory)
        if not declared_comments(section.default_factory).get(setting.name)
    ]
    assert not undescribed


def test_the_command_lists_a_section_s_settings_with_their_options_and_comments():
    done = subprocess.run(
        [sys.executable, "-m", "retool", "settings", "reward", "cold_start"], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert (
        "[reward]\n  wrong_answer_call_credit = 0.0\n      --reward-wrong-answer-call-credit  verl's ReTool"
        in done.stdout
    )
    assert "--cold-start-learning-rate  Adam's step size for the supervised steps" in done.stdout
    assert "[trainer]" not in done.stdout
    wrong = subprocess.run(
        [sys.executable, "-m", "retool", "settings", "rewards"], cwd=REPO, capture_output=True, text=True
    )
    assert wrong.returncode == 2 and "no section [rewards]; the sections are run, model" in wrong.stderr
