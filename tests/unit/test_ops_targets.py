"""ops/Procfile and ops/targets/example.json describe the same processes: every process that serves metrics
is a target with its role, index and port, and every target is a process of the Procfile."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

OPS = Path(__file__).resolve().parents[2] / "ops"
#: The roles whose figures the dashboards and alerts read: each of their processes must be scraped.
SCRAPED_ROLES = ("worker", "assembler", "batcher", "trainer")


def _procfile() -> dict[str, list[str]]:
    """Process name -> its command's arguments."""
    processes = {}
    for line in (OPS / "Procfile").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, command = line.partition(":")
            processes[name.strip()] = shlex.split(command)
    return processes


def _flag(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def _role(args: list[str]) -> str:
    return next(arg for arg in args if arg in (*SCRAPED_ROLES, "server", "archiver"))


def _index(name: str, args: list[str]) -> str:
    """A trainer's index is its rank; any other process's the number its Procfile name ends with (else 0)."""
    rank = _flag(args, "--rank")
    return rank if rank is not None else (re.search(r"(\d+)$", name) or [None, "0"])[1]


def test_every_scraped_process_of_the_procfile_is_a_target_and_back():
    processes = _procfile()
    served = {}
    for name, args in processes.items():
        role, port = _role(args), int(_flag(args, "--metrics-port") or 0)
        if role in SCRAPED_ROLES:
            assert port, f"Procfile process {name!r} ({role}) serves no metrics: give it --metrics-port"
        if port:
            served[name] = (role, _index(name, args), f"127.0.0.1:{port}")
    targets = json.loads((OPS / "targets" / "example.json").read_text())
    listed = [(t["labels"]["role"], t["labels"]["index"], address) for t in targets for address in t["targets"]]
    assert sorted(listed) == sorted(served.values())
    assert len({address for _, _, address in listed}) == len(listed), "two targets share a port"
    assert {role for role, _, _ in listed} == set(SCRAPED_ROLES)
    assert all(set(t["labels"]) == {"role", "index"} for t in targets)  # `run` comes from the processes


def test_the_example_in_prometheus_yml_is_the_targets_file():
    comment = [
        line.strip().removeprefix("#").strip()
        for line in (OPS / "prometheus.yml").read_text().splitlines()
        if line.strip().startswith("#")
    ]
    start = comment.index("[")
    shown = json.loads(" ".join(comment[start : comment.index("]", start) + 1]))
    assert shown == json.loads((OPS / "targets" / "example.json").read_text())
