"""The package layout's import rules (`tests/layers.py`), on the real tree and on synthetic ones."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from layers import check_tree

ROOT = Path(__file__).resolve().parents[2]


def test_the_package_follows_its_import_rules():
    violations = check_tree(ROOT)
    assert not violations, "\n".join(map(str, violations))


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in {"streamgrp/__init__.py": "", "streamgrp/errors.py": "", **files}.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for package in ("core", "store", "services", "train", "replay", "cli"):
        (tmp_path / "streamgrp" / package).mkdir(exist_ok=True)
        (tmp_path / "streamgrp" / package / "__init__.py").touch()
    return tmp_path


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"streamgrp/core/fold.py": "import redis\n"}, "core must not import redis"),
        ({"streamgrp/core/fold.py": "import time\n"}, "core must not import time"),
        ({"streamgrp/core/fold.py": "def f():\n    import logging\n"}, "core must not import logging"),
        (
            {"streamgrp/core/fold.py": "from streamgrp.store import keys\n", "streamgrp/store/keys.py": ""},
            "core may import store never",
        ),
        ({"streamgrp/services/batcher.py": "import prometheus_client\n"}, "services must not import prometheus_client"),
        (
            {
                "streamgrp/services/batcher.py": "from streamgrp.cli.metrics import Metrics\n",
                "streamgrp/cli/metrics.py": "",
            },
            "services may import cli never",
        ),
        (
            {
                "streamgrp/replay/steps.py": "from streamgrp.train.loader import build_batch\n",
                "streamgrp/train/loader.py": "",
            },
            "replay may import train only inside a function",
        ),
        (
            {"streamgrp/replay/steps.py": "try:\n    import torch\nexcept ImportError:\n    pass\n"},
            "replay must not import torch",
        ),
        (
            {"streamgrp/cli/demo.py": "from consumers.toy_task import prompts\n"},
            "the library never imports streamgrp.consumers",
        ),
        (
            {
                "streamgrp/cli/demo.py": "from streamgrp.consumers import toy_task\n",
                "streamgrp/consumers/__init__.py": "",
                "streamgrp/consumers/toy_task.py": "",
            },
            "the library never imports streamgrp.consumers",
        ),
        (
            {
                "streamgrp/cli/demo.py": "def f():\n    import streamgrp.consumers.toy_task\n",
                "streamgrp/consumers/__init__.py": "",
                "streamgrp/consumers/toy_task.py": "",
            },
            "the library never imports streamgrp.consumers",
        ),
        (
            {
                "streamgrp/consumers/grpo_trainer.py": "from consumers import toy_task\n",
                "streamgrp/consumers/__init__.py": "",
            },
            "a wheel installs no top-level consumers package",
        ),
        ({"streamgrp/store/keys.py": "from .. import cli\n"}, "store may import cli never"),
        ({"streamgrp/plugins/x.py": ""}, "layer 'plugins' has no import rule"),
    ],
)
def test_a_broken_rule_is_reported(tmp_path, files, expected):
    violations = check_tree(_tree(tmp_path, files))
    assert any(expected in str(v) for v in violations), violations


def test_allowed_imports_are_not_reported(tmp_path):
    tree = _tree(
        tmp_path,
        {
            "streamgrp/core/codec.py": "import hashlib\nimport orjson\nfrom streamgrp.errors import DecodeError\n",
            "streamgrp/store/keys.py": "import redis\nfrom streamgrp.core import codec\n",
            "streamgrp/replay/steps.py": "def rebuild():\n    from streamgrp.train.loader import build_batch\n",
            "streamgrp/train/loader.py": "import torch\n",
            "streamgrp/cli/main.py": "from streamgrp.services import batcher\n"
            "LOAD = 'streamgrp.consumers.toy_task:rollout'\n",
            "streamgrp/services/batcher.py": "",
            "streamgrp/consumers/__init__.py": "",
            "streamgrp/consumers/toy_task.py": "import torch\n",
            "streamgrp/consumers/grpo_trainer.py": "import torch\nfrom streamgrp.consumers import toy_task\n"
            "from streamgrp.train.loader import build_batch\n"
            "from streamgrp.cli.main import main\n",
        },
    )
    assert check_tree(tree) == []


def test_the_examples_are_checked_through_their_link(tmp_path):
    """``streamgrp/consumers`` is a link to the top-level ``consumers/`` folder; its modules are checked."""
    assert (ROOT / "streamgrp" / "consumers").resolve() == ROOT / "consumers"
    tree = _tree(tmp_path, {"consumers/__init__.py": "", "consumers/trainer.py": "from consumers import x\n"})
    (tree / "streamgrp" / "consumers").symlink_to("../consumers", target_is_directory=True)
    violations = check_tree(tree)
    assert [(v.module, v.imported) for v in violations] == [
        ("streamgrp.consumers.trainer", "consumers.x"),
        ("streamgrp.consumers.trainer", "consumers"),
    ]


def test_light_entry_points_load_nothing_heavy_at_run_time():
    """What the rules promise, observed: the pure core, the replay commands (steps, verify, inspect)
    and the curated package import none of redis' heavy neighbours: torch, prometheus_client."""
    code = (
        "import sys\n"
        "import streamgrp, streamgrp.core.group_fold, streamgrp.core.rank_split, streamgrp.core.codec\n"
        "import streamgrp.core.manifest, streamgrp.core.stall, streamgrp.replay.charts\n"
        "import streamgrp.store.archive_reader, streamgrp.store.archive_writer\n"
        "pure = sorted(m for m in ('redis', 'torch', 'prometheus_client', 'numpy', 'matplotlib') if m in sys.modules)\n"
        "import streamgrp.replay.steps, streamgrp.replay.verifier, streamgrp.cli.main\n"
        "light = sorted(m for m in ('torch', 'prometheus_client') if m in sys.modules)\n"
        "print(','.join(pure) + '|' + ','.join(light))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert result.stdout.strip() == "|"


def test_lazy_torch_exports_resolve():
    import streamgrp

    assert callable(streamgrp.normalize)
    with pytest.raises(AttributeError):
        streamgrp.does_not_exist  # noqa: B018
