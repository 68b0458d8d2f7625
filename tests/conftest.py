"""Shared fixtures: the real SmolLM2 tokenizer (built once by the Makefile, or here if missing), a
tiny random-weight model, protocols for both tool formats, and a scripted tool-calling policy."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from jobs.models import DEFAULT_MODEL_DIR, build_default_model, build_tiny_model
from jobs.protocol import BUNDLED_TEMPLATE, ChatProtocol, load_tokenizer

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    return build_default_model(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="session")
def tiny_model_dir(default_model_dir, tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", default_model_dir)


@pytest.fixture(scope="session", params=["hermes", "xml"])
def protocol(request, tokenizer) -> ChatProtocol:
    return ChatProtocol(tokenizer, tool_format=request.param, chat_template=BUNDLED_TEMPLATE)


@pytest.fixture(scope="session")
def hermes(tokenizer) -> ChatProtocol:
    return ChatProtocol(tokenizer, tool_format="hermes", chat_template=BUNDLED_TEMPLATE)
