"""`streamgrp.cli.extras`: a command whose optional dependency is missing names the extra that brings it."""

from __future__ import annotations

import sys

import pytest

from streamgrp.cli.extras import EXTRAS, missing, require
from streamgrp.errors import ConfigError


def test_a_missing_torch_names_the_trainer_extra_and_the_cpu_build(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # as if not installed
    assert missing("trainer") == ["torch"]
    with pytest.raises(ConfigError) as raised:
        require("a trainer rank", "trainer")
    message = str(raised.value)
    assert message.startswith("a trainer rank needs torch, which is not installed: pip install 'streamgrp[trainer]'")
    assert "PyTorch's CPU wheel index" in message and "http" not in message


def test_several_missing_modules_are_named_together(monkeypatch):
    for name in EXTRAS["llm"]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(
        ConfigError,
        match=r"^demo --model needs transformers and gguf, which are not installed: "
        r"pip install 'streamgrp\[llm\]'$",
    ):
        require("demo --model", "llm")


def test_an_installed_extra_passes():
    pytest.importorskip("torch")
    require("a trainer rank", "trainer")
