"""Verify's check of partial rollouts: every decided sample built on segments is exactly their concatenation.

A worker that generated a slot in segments (`streamgrp.store.segments`) records in the sample's meta how
many segments it is built on and the tokens they hold; this reads each partition's segments stream back
(every `SlotSegment`, as one chain per slot), and for each decided member with segments compares its
payload against the chain (`streamgrp.store.segments.check_sample`): the sample's generated token ids and
log-probabilities, in order, must be the chain's. Kinds of `Difference`:

    segments_differ     a decided sample is not the concatenation of the segments it names (``recorded``:
                        what differs), or names more segments than the stream holds (trimmed: verify with
                        the run's archive)
"""

from __future__ import annotations

from typing import Any

from streamgrp.core import codec
from streamgrp.core.events import SamplePayload, SlotSegment
from streamgrp.errors import DecodeError
from streamgrp.store.segments import chain_of, check_sample
from streamgrp.store.sources import decode_all, partition_streams


def check_segments(source: Any, recorded: list, report: Any, difference: type) -> int:
    """Compare every decided member of ``recorded`` ((decision ref, `GroupDecided`) pairs) that has segments
    against them, adding a ``difference`` to ``report`` per mismatch; the number of members checked."""
    from streamgrp.core.manifest import split_decision_ref

    checked = 0
    payloads = dict(partition_streams(source, "payloads"))
    for partition, name in partition_streams(source, "segments"):
        found: dict[tuple[str, int], list[SlotSegment]] = {}
        try:
            for _, event in decode_all(source, name):
                if isinstance(event, SlotSegment):
                    found.setdefault((event.task_id, event.slot), []).append(event)
        except ValueError:  # a run recorded before segments existed has no such stream
            continue
        if not found:
            continue
        members = [
            (decision.task_id, member)
            for ref, decision in recorded
            if split_decision_ref(ref)[0] == partition
            for member in decision.members
            if (decision.task_id, member.slot) in found
        ]
        fields = source(payloads[partition], [member.entry for _, member in members]) if members else []
        for (task_id, member), entry in zip(members, fields):
            if entry is None:
                continue  # the payload check reports a payload gone
            try:
                payload = codec.decode(entry)
            except DecodeError:
                continue  # ... and one that does not decode (its digest differs)
            if not isinstance(payload, SamplePayload):
                continue
            checked += 1
            problem = check_sample(payload.sample, chain_of(found[(task_id, member.slot)]))
            if problem is not None:
                report.differences.append(
                    difference(
                        "segments_differ",
                        f"task {task_id} slot {member.slot}",
                        f"payload {member.entry}",
                        problem,
                        "the concatenation of the slot's segments",
                    )
                )
    return checked
