"""The import rules of the package layout, checked on source text (AST; nothing is imported).

A module's *layer* is its first component below the package (``streamgrp.core.codec`` is in
``core``; ``streamgrp.config`` and its modules are the layer ``config``). `RULES` says which layers each layer may
import at module level; `LAZY` which ones it may import only inside a function (so importing the
module stays light); `BANNED` which outside packages a layer may not import at all. The examples
(``consumers/``, installed as ``streamgrp.consumers`` through the link ``streamgrp/consumers``) are a
layer of their own that may import the whole library; the library never imports them, at any depth,
and nothing imports them as a top-level ``consumers`` package, which a wheel does not install.
"""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

FOUNDATION = {"errors", "_version"}
RULES: dict[str, set[str]] = {
    "errors": set(),
    "_version": set(),
    "core": {"core", "errors"},
    "config": {"core", "errors", "config"},
    "store": {"core", "store", "errors", "config"},
    "services": {"core", "store", "services", "errors", "config"},
    "train": {"core", "store", "train", "errors", "config"},
    "replay": {"core", "store", "replay", "errors", "config"},
    "cli": {"core", "store", "services", "train", "replay", "cli", "errors", "config", "_version"},
    "__init__": {"core", "errors", "_version"},
    "__main__": {"cli"},
    # The examples use the library as any user does.
    "consumers": {
        "core",
        "store",
        "services",
        "train",
        "replay",
        "cli",
        "errors",
        "config",
        "_version",
        "__init__",
        "consumers",
    },
}
#: Imports allowed only inside a function: replay rebuilds a step's tensors only when asked.
LAZY: dict[str, set[str]] = {"replay": {"train"}, "__init__": {"train", "store"}}
HEAVY = {"redis", "torch", "prometheus_client", "numpy", "matplotlib"}
BANNED: dict[str, set[str]] = {
    # The pure core: no I/O, no clock, no randomness, no logging (time arrives as data).
    "core": HEAVY | {"time", "random", "logging", "os", "socket", "subprocess", "threading", "asyncio", "uuid"},
    "errors": HEAVY,
    "config": HEAVY,
    "store": {"torch", "prometheus_client", "numpy", "matplotlib"},
    "services": {"torch", "prometheus_client", "numpy", "matplotlib"},
    "train": {"prometheus_client", "matplotlib"},
    "replay": {"torch", "prometheus_client", "numpy"},
    "__init__": HEAVY,
}
#: ``matplotlib`` is optional for ``report --format png`` and torch for rebuilt tensors: both lazily. The core's
#: value checks bound token ids against a vocabulary with numpy (pure computation), imported on the first check so
#: that commands which check no sample do not load it.
LAZY_OUTSIDE: dict[str, set[str]] = {"replay": {"matplotlib", "torch"}, "core": {"numpy"}}


@dataclass(frozen=True)
class Violation:
    module: str
    line: int
    imported: str
    why: str

    def __str__(self) -> str:
        return f"{self.module}:{self.line} imports {self.imported}: {self.why}"


def layer_of(module: str, package: str) -> str:
    parts = module.split(".")
    if parts == [package]:
        return "__init__"
    return parts[1]


def _module_name(path: Path, root: Path) -> str:
    relative = path.relative_to(root).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(tree: ast.Module, module: str, is_package: bool) -> Iterator[tuple[str, int, bool]]:
    """(absolute module imported, line, at module level) for every import in the file."""
    top = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, id(node) in top or _in_top_block(tree, node)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            level = id(node) in top or _in_top_block(tree, node)
            for alias in node.names:
                # "from pkg import sub" names a submodule when sub is one; both spellings are checked.
                yield f"{base}.{alias.name}", node.lineno, level
                yield base, node.lineno, level


def _in_top_block(tree: ast.Module, target: ast.AST) -> bool:
    """An import under a module-level ``if``/``try`` still runs at import time (``if TYPE_CHECKING``
    never does: it counts as lazy)."""
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, (ast.If, ast.Try)):
            if any(child is target for child in ast.walk(node)):
                return True
    return False


def _sources(root: Path, package: str) -> list[Path]:
    """The package's ``.py`` files, through links too: ``streamgrp/consumers`` is one (``rglob`` does not follow it)."""
    return sorted(
        Path(folder, name)
        for folder, _, names in os.walk(root / package, followlinks=True)
        for name in names
        if name.endswith(".py")
    )


def check_tree(root: Path, package: str = "streamgrp", examples: str = "consumers") -> list[Violation]:
    """Every import in ``root/package`` that breaks a rule above."""
    violations = []
    sources = _sources(root, package)
    modules = {_module_name(p, root) for p in sources}
    for path in sources:
        module = _module_name(path, root)
        layer = layer_of(module, package)
        allowed, lazy = RULES.get(layer), LAZY.get(layer, set())
        if allowed is None:
            violations.append(Violation(module, 0, "-", f"layer {layer!r} has no import rule; add it to RULES"))
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        seen = set()
        for imported, line, at_top in _imports(tree, module, path.name == "__init__.py"):
            if (imported, line) in seen:
                continue
            seen.add((imported, line))
            head = imported.split(".")[0]
            in_examples = (
                head == examples or imported.startswith(f"{package}.{examples}.") or imported == f"{package}.{examples}"
            )
            if in_examples and layer != examples:
                violations.append(
                    Violation(
                        module,
                        line,
                        imported,
                        f"the library never imports {package}.{examples} "
                        "(name an example by a 'module:function' string)",
                    )
                )
            elif head == examples:
                violations.append(
                    Violation(
                        module,
                        line,
                        imported,
                        f"a wheel installs no top-level {examples} package; import {package}.{examples}",
                    )
                )
            elif head == package:
                if imported not in modules:
                    continue  # a name, not a module: "from streamgrp.core.codec import encode"
                target = layer_of(imported, package)
                if target in allowed or (not at_top and target in lazy):
                    continue
                how = "only inside a function" if target in lazy else "never"
                violations.append(Violation(module, line, imported, f"{layer} may import {target} {how}"))
            elif head in BANNED.get(layer, set()):
                if not at_top and head in LAZY_OUTSIDE.get(layer, set()):
                    continue
                violations.append(Violation(module, line, imported, f"{layer} must not import {head}"))
    return violations
