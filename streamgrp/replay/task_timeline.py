"""One task's story, read after the fact: `inspect_task` and `format_timeline` (SPEC section 6).

Owns the timeline of one task: its issue, each slot result (with its worker, outcome, error and the completion
text the payload recorded), its rewards, its agent sessions' turns (`streamgrp.replay.session_lines`), the
decision, and the step and rank it trained in or why it was discarded. Reads through an entry source
(`streamgrp.store.sources`) and changes nothing; listing and replaying steps are `streamgrp.replay.steps`'.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis

from streamgrp.core import codec
from streamgrp.core.events import (
    GroupDecided,
    GroupDiscarded,
    SlotResult,
    SlotRewarded,
    StepManifest,
    TaskIssued,
)
from streamgrp.core.shown import printable
from streamgrp.errors import ConfigError, DecodeError
from streamgrp.replay.session_lines import session_lines
from streamgrp.store.keys import RunKeys, task_partition
from streamgrp.store.sources import RedisSource, decode_all, partition_streams, server_source
from streamgrp.store.streams import entry_time


@dataclass(frozen=True)
class TimelineEvent:
    """One line of a task's story: when (server seconds, None if unknown), what, and the details."""

    at: float | None
    what: str
    text: str
    entry: str | None = None
    data: dict[str, Any] = field(default_factory=dict)


def inspect_task(
    client: redis.Redis | None, keys: RunKeys, task_id: str, *, source: RedisSource | None = None
) -> list[TimelineEvent]:
    """The task's timeline in server-clock order: issued, each slot result (with its worker, outcome and
    error), the decision, then the step and rank it trained in, or its discard."""
    source = source or server_source(client, keys)
    # In a partitioned run only the task's own partition's streams hold it.
    slots, decisions = (partition_streams(source, name) for name in ("slots", "decisions"))
    mine = task_partition(task_id, len(slots))
    needle = b'"task_id":' + orjson.dumps(task_id)
    found: list[tuple[str, Any]] = []  # (entry id, event or the DecodeError) of this task, in log order
    for entry_id, fields in source.scan(slots[mine][1]):
        if needle in (fields.get(codec.HEADER) or b""):
            try:
                event = codec.decode(fields)
            except DecodeError as exc:
                found.append((entry_id, exc))
                continue
            if isinstance(event, (TaskIssued, SlotResult, SlotRewarded)) and event.task_id == task_id:
                found.append((entry_id, event))
    if not found:
        raise ConfigError(f"task {task_id!r} is not in the slot log of run {keys.run!r} (wrong run? trimmed?)")
    decision_entry, decision = _find_decision(source, task_id, decisions[mine][1])
    sessions = partition_streams(source, "sessions")[mine][1]
    first_per_slot: dict[int, str] = {}
    timeline: list[TimelineEvent] = []
    for entry_id, event in found:
        if isinstance(event, DecodeError):
            timeline.append(
                TimelineEvent(entry_time(entry_id), "invalid", f"entry does not decode ({event.reason})", entry_id)
            )
        elif isinstance(event, TaskIssued):
            timeline.append(
                TimelineEvent(
                    event.issued_at,
                    "issued",
                    f"version {event.version} by {event.producer}, prompt {_short(event.prompt, 160)}",
                    entry_id,
                    {"version": event.version, "prompt": event.prompt},
                )
            )
        elif isinstance(event, SlotRewarded):
            said = (
                f"rewards {list(event.rewards)}"
                if event.rewards is not None
                else f"rejected: {_short(event.reason, 300)}"
                if event.reason is not None
                else f"failed: {_short(event.error, 300)}"
            )
            timeline.append(
                TimelineEvent(
                    entry_time(entry_id),
                    "rewarded",
                    f"slot {event.slot} scored by {event.scorer or '?'}: {said}",
                    entry_id,
                    {"slot": event.slot, "outcome": event.outcome, "scorer": event.scorer},
                )
            )
        else:
            first = first_per_slot.setdefault(event.slot, entry_id) == entry_id
            text, data = _slot_text(entry_id, event, first, decision)
            if event.sample is not None:
                [payload] = source(slots[mine][1].replace("slots", "payloads"), [entry_id])
                completion = recorded_text(payload)
                if completion is not None:  # what the worker recorded the model wrote
                    text += f"; text {_short(completion, 200)}"
                    data["text"] = completion
            timeline.append(TimelineEvent(entry_time(entry_id), "slot", text, entry_id, data))
    timeline += session_lines(source.scan(sessions), task_id, TimelineEvent)
    if decision is None:
        timeline.append(TimelineEvent(None, "open", "no decision yet: the group is still open (or never folded)"))
        return sorted(timeline, key=lambda event: (event.at is None, event.at or 0.0))
    assert decision_entry is not None  # found together with the decision
    members = ", ".join(str(m.slot) for m in decision.members) or "none"
    text = (
        f"{decision.decision}"
        + (f" ({decision.reason})" if decision.reason else "")
        + f", members [{members}], closed by {decision.closed_by}, usable {decision.stats.usable_slot_count}"
        f"/{decision.stats.target_slot_count}"
    )
    if decision.decided_at is not None:
        text += f", decided_at {_clock(decision.decided_at).strip()}"
    if decision.error:
        text += f"; {decision.error}"
    # Recorded at: the entry's server time, the clock every other line uses (decided_at may be another host's).
    timeline.append(
        TimelineEvent(entry_time(decision_entry), "decided", text, decision_entry, _decision_detail(decision))
    )
    timeline.extend(_placement(source, task_id))
    return sorted(timeline, key=lambda event: (event.at is None, event.at or 0.0))


def _find_decision(source: RedisSource, task_id: str, stream: str) -> tuple[str | None, GroupDecided | None]:
    entry_id = source.hash("decided").get(task_id)
    if entry_id is not None:
        (fields,) = source(stream, [entry_id])
        if fields:
            return entry_id, codec.decode(fields)
    for entry_id, event in decode_all(source, stream):
        if isinstance(event, GroupDecided) and event.task_id == task_id:
            return entry_id, event
    return None, None


def recorded_text(payload: Mapping[bytes, bytes] | None) -> str | None:
    """The completion text a sample's payload entry recorded in its meta (``text``, kept by inference
    rollouts unless ``keep_text`` is off), None without one."""
    if not payload or codec.HEADER not in payload:
        return None
    try:
        text = orjson.loads(payload[codec.HEADER]).get("sample", {}).get("meta", {}).get("text")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return text if isinstance(text, str) else None


def _slot_text(
    entry_id: str, event: SlotResult, first: bool, decision: GroupDecided | None
) -> tuple[str, dict[str, Any]]:
    text = f"slot {event.slot} {event.outcome} from {event.producer or '?'}"
    data: dict[str, Any] = {"slot": event.slot, "outcome": event.outcome, "producer": event.producer}
    if event.sample is not None:
        sample = event.sample
        text += f": {sample.rows} row(s), {sample.tokens} loss tokens, version {sample.version}, " + (
            "reward pending" if event.reward_pending else f"reward {sample.reward:.4g}"
        )
        data.update(rows=sample.rows, tokens=sample.tokens, version=sample.version)
    if event.error:
        text += f": {_short(event.error, 300)}"
        data["error"] = event.error
    if not first:
        text += " [repeat: ignored as a duplicate or late result]"
    elif decision is not None and decision.slot_outcomes.get(str(event.slot)) == "timeout":
        text += " [late: the deadline had already closed the group]"
    elif decision is not None and any(m.entry == entry_id for m in decision.members):
        text += " [member]"
    return text, data


def _placement(source: RedisSource, task_id: str) -> list[TimelineEvent]:
    out = []
    for entry_id, manifest in decode_all(source, "steps"):
        if not isinstance(manifest, StepManifest):
            continue
        for shard in manifest.shards:
            for position, group in enumerate(shard.groups):
                if group.task_id == task_id:
                    out.append(
                        TimelineEvent(
                            manifest.created_at,
                            "trained",
                            f"step {manifest.step} rank {shard.rank} (group {position + 1} of "
                            f"{len(shard.groups)}, policy version {manifest.version})",
                            entry_id,
                            {"step": manifest.step, "rank": shard.rank},
                        )
                    )
    for entry_id, event in decode_all(source, "discarded"):
        if isinstance(event, GroupDiscarded) and event.task_id == task_id:
            out.append(
                TimelineEvent(
                    entry_time(entry_id),
                    "discarded",
                    f"{event.reason}" + (f": {event.detail}" if event.detail else ""),
                    entry_id,
                    {"reason": event.reason},
                )
            )
    if not out:
        out.append(TimelineEvent(None, "waiting", "not in any step and not discarded (buffered by the batcher?)"))
    return out


def _decision_detail(decision: GroupDecided) -> dict[str, Any]:
    """A decision as plain JSON values, its members as records where the header has columns."""
    detail: dict[str, Any] = {}
    for name, value in decision.to_builtins().items():
        if name == "members":
            detail[name] = [member.to_builtins() for member in decision.members]
        elif not name.startswith("member_") and name not in ("producer", "seq", "schema_version"):
            detail[name] = value
    return detail


# -- text for the CLI -----------------------------------------------------------------------------


def _short(value: Any, limit: int = 200) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _clock(at: float | None) -> str:
    if at is None:
        return " " * 23
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) + f".{int(at % 1 * 1000):03d}"


def format_timeline(events: Sequence[TimelineEvent]) -> str:
    # A line's text quotes producers, prompts and error texts: whatever was written to the streams.
    return "\n".join(
        f"{_clock(e.at)}  {e.what:<9} {printable(e.text)}" + (f"  [{e.entry}]" if e.entry else "") for e in events
    )
