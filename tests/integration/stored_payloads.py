"""Reading and removing a run's stored payloads in tests, whichever layout the run records
(`streamgrp.store.payloads`): a keys run's payload keys, or a stream run's payloads stream."""

from __future__ import annotations

from streamgrp.store import payloads
from streamgrp.store.runs import recorded_layout
from streamgrp.store.streams import entry_id_str, read_entries


def _keyed(client, part) -> bool:
    from streamgrp.store.keys import RunKeys

    return recorded_layout(client, RunKeys(part.run)) == payloads.KEYS


def payload_entries(client, part) -> list[tuple[bytes, dict]]:
    """(entry id, fields) of every stored payload of the partition (or run) ``part``, in slot-log order: what
    ``client.xrange(part.payloads)`` gave for a stream run."""
    if not _keyed(client, part):
        return client.xrange(part.payloads)
    ids = [entry_id_str(raw) for raw, _ in client.xrange(part.slots)]
    return [
        (entry_id.encode(), fields)
        for entry_id, fields in zip(ids, payloads.read(client, part.payloads, ids))
        if fields is not None
    ]


def payload_at(client, part, entry_id: str) -> dict | None:
    """The payload of slot entry ``entry_id``; None without one."""
    if not _keyed(client, part):
        return read_entries(client, part.payloads, [entry_id])[0]
    return payloads.read(client, part.payloads, [entry_id])[0]


def delete_payload(client, part, entry_id: str) -> int:
    """Delete the payload of slot entry ``entry_id`` (what a credential that may delete payloads could do)."""
    if not _keyed(client, part):
        return client.xdel(part.payloads, entry_id)
    return client.unlink(payloads.key(part.payloads, entry_id))
