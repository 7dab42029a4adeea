"""A run's recorded log as a JSON-lines file, and back: the golden-log format of the replay tests.

One JSON object per line. The first is ``{"format": ..., "run": NAME}``; then one line per stream
entry, ``{"stream": "slots", "id": "1700000000000-0", "fields": [["h", "text", "{...}"], ["b", "b64",
"..."]]}`` (field values as UTF-8 text when they are, else base64, so headers stay readable and every
byte round-trips), one per run hash (``{"hash": "committed", "fields": {...}}``) and one per consumer
group position (``{"group": "assembler", "stream": "slots", "last_delivered": ID}``).

`load_run` writes a file into a fresh run namespace with the recorded entry ids (XADD with explicit
ids); run names live only in keys and in the `RunStarted` record, which is rewritten to the new
name. `MemorySource` serves a file without a server, through the same calls as
`streamgrp.store.sources.RedisSource`; `write_archive` writes it as an archive directory (the format
`streamgrp archiver` writes), for `streamgrp.store.sources.ArchiveSource`.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from streamgrp.core import codec
from streamgrp.core.events import RunStarted
from streamgrp.store import payloads
from streamgrp.store.keys import ASSEMBLER_GROUP, BATCHER_GROUP, RunKeys
from streamgrp.store.sources import RedisSource

FORMAT = "streamgrp-runlog/1"
HASHES = ("committed", "decided", "counts")
GROUPS = (("slots", ASSEMBLER_GROUP), ("decisions", BATCHER_GROUP))


def _value(raw: bytes) -> list[str]:
    try:
        return ["text", raw.decode("utf-8")]
    except UnicodeDecodeError:
        return ["b64", base64.b64encode(raw).decode()]


def _raw(kind: str, value: str) -> bytes:
    return value.encode() if kind == "text" else base64.b64decode(value)


def dump_run(client, keys: RunKeys, path: Path) -> int:
    """Write every stream entry, hash and group position of the run; returns the number of lines."""
    lines = [{"format": FORMAT, "run": keys.run}]
    server = RedisSource(client, keys)  # a keys run's payloads as the payloads stream's entries, at their ids
    for name in keys.all_streams():
        for entry_id, fields in server.scan(name):
            lines.append(
                {"stream": name, "id": entry_id, "fields": [[k.decode(), *_value(bytes(v))] for k, v in fields.items()]}
            )
    for name in HASHES:
        values = client.hgetall(getattr(keys, name))
        if values:
            lines.append({"hash": name, "fields": {k.decode(): v.decode() for k, v in sorted(values.items())}})
    for stream, group in GROUPS:
        try:
            infos = client.xinfo_groups(getattr(keys, stream))
        except Exception:  # no such stream
            continue
        for info in infos:
            if info["name"].decode() == group:
                lines.append({"group": group, "stream": stream, "last_delivered": info["last-delivered-id"].decode()})
    path.write_text("".join(json.dumps(line, sort_keys=True) + "\n" for line in lines))
    return len(lines)


def read_lines(path: Path) -> list[dict]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not lines or lines[0].get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} file")
    return lines


def entry_fields(line: dict) -> dict[bytes, bytes]:
    return {name.encode(): _raw(kind, value) for name, kind, value in line["fields"]}


Edit = Callable[[str, str, dict[bytes, bytes]], dict[bytes, bytes]]


def load_run(client, path: Path, run: str, *, edit: Edit | None = None, groups: bool = True) -> RunKeys:
    """Write the file into run namespace ``run`` (which must be new); ``edit(stream, id, fields)`` may
    change an entry on the way (tests tamper with the record this way). Returns the run's keys."""
    keys = RunKeys(run)
    streams = keys.all_streams()
    pipe = client.pipeline(transaction=False)
    layout = payloads.STREAM
    for line in read_lines(path)[1:]:
        if "stream" in line and "id" in line:
            fields = entry_fields(line)
            fields = _renamed(fields, run) if line["stream"] == "control" else fields
            if edit is not None:
                fields = edit(line["stream"], line["id"], fields)
            if line["stream"] == "control" and layout == payloads.STREAM:  # the record comes first
                layout = _layout(fields) or layout
            if line["stream"] == "payloads" and layout == payloads.KEYS:
                pipe.set(
                    payloads.key(keys.payloads, line["id"]),
                    payloads.frame(fields[codec.HEADER], fields.get(codec.BLOB, b"")),
                )
                continue
            pipe.xadd(streams[line["stream"]], fields, id=line["id"])
        elif "hash" in line:
            pipe.hset(getattr(keys, line["hash"]), mapping=line["fields"])
        elif "group" in line and groups:
            pipe.xgroup_create(streams[line["stream"]], line["group"], id=line["last_delivered"], mkstream=True)
    pipe.execute()
    return keys


def _layout(fields: dict[bytes, bytes]) -> str | None:
    """The payload layout a run record names (None for another control entry, or a record without one)."""
    try:
        event = codec.decode(fields)
    except Exception:
        return None
    return event.settings.get("payload_layout") if isinstance(event, RunStarted) else None


def _renamed(fields: dict[bytes, bytes], run: str) -> dict[bytes, bytes]:
    event = codec.decode(fields)
    if isinstance(event, RunStarted):
        return codec.encode(event.replace(run=run))
    return fields


class MemorySource:
    """A run log file served from memory with `streamgrp.store.sources.RedisSource`'s calls (no server)."""

    def __init__(self, path: Path) -> None:
        lines = read_lines(path)
        self.keys = RunKeys(lines[0]["run"])
        self.streams: dict[str, dict[str, dict[bytes, bytes]]] = {name: {} for name in self.keys.all_streams()}
        self.hashes: dict[str, dict[str, str]] = {}
        self.positions: dict[tuple[str, str], str] = {}
        for line in lines[1:]:
            if "stream" in line and "id" in line:
                self.streams[line["stream"]][line["id"]] = entry_fields(line)
            elif "hash" in line:
                self.hashes[line["hash"]] = dict(line["fields"])
            elif "group" in line:
                self.positions[(line["stream"], line["group"])] = line["last_delivered"]

    def __call__(self, stream: str, ids: Sequence[str]) -> list[dict[bytes, bytes] | None]:
        return [self.streams[stream].get(entry_id) for entry_id in ids]

    def scan(self, stream: str) -> Iterator[tuple[str, dict[bytes, bytes]]]:
        yield from self.streams[stream].items()  # the file is in stream order

    def hash(self, name: str) -> dict[str, str]:
        return dict(self.hashes.get(name, {}))

    def folded_through(self) -> str | None:
        return self.positions.get(("slots", ASSEMBLER_GROUP))


def write_archive(path: Path, directory: Path) -> RunKeys:
    """Write the file as an archive directory (segments and a snapshot), without a server."""
    from streamgrp.store.archive_writer import ArchiveWriter

    lines = read_lines(path)
    keys = RunKeys(lines[0]["run"])
    writer = ArchiveWriter(directory, run=keys.run)
    hashes: dict[str, dict[str, str]] = {}
    groups: dict[str, list[dict]] = {}
    for line in lines[1:]:
        if "stream" in line and "id" in line:
            writer.append(line["stream"], line["id"], entry_fields(line))
        elif "hash" in line:
            hashes[line["hash"]] = dict(line["fields"])
        elif "group" in line:
            groups.setdefault(line["stream"], []).append(
                {"name": line["group"], "last_delivered": line["last_delivered"], "pending": 0}
            )
    writer.write_snapshot({"hashes": hashes, "groups": groups})
    writer.close()
    return keys
