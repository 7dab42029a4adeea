"""Loading a shard: a step's sample payloads in one read, into padded tensors with no per-row Python work.

Owns `build_batch`, the one place a shard becomes tensors, for trainer ranks and replay alike. It
reads every member's payload (schema 2: the payloads stream, at the member's slot entry id; a
schema-1 log: the slot entry itself, which carried the sample) through one fetch call per partition,
checks each against the manifest (the digest, when asked, and always that it is a well-formed
payload of that task and slot; without digests each as it arrives, while a streaming fetch brings
the rest), then has `streamgrp.train.shard_tensors` fill each field of the padded [rows, longest row]
tensors: each row's bytes copied once, from the entry's own bytes into its place, widened to the batch
dtype in the same pass.

Payloads were validated where they entered (the worker's publish, the assembler's check), so a header
is read here by the codec's compiled payload reader (`codec.payload_view`), without rebuilding the
`Sample` or checking its values again; a payload that does not fit its description raises
`DigestMismatch` naming the entry, never another error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import torch

from streamgrp.core import codec
from streamgrp.core.events import GroupDecided, Sample, ShardGroup, StepManifest
from streamgrp.core.fresh_tokens import sample_runs, version_runs
from streamgrp.core.values import SAMPLE_TENSORS, layout_problem
from streamgrp.errors import DecodeError, DigestMismatch
from streamgrp.train.batch import Batch, BatchOwner
from streamgrp.train.shard_tensors import SampleRows, StaleMask, mask_stale, row_runs, shard_tensors

#: ``fetch(stream, ids)``: the fields of each entry id of a run stream ("payloads", "slots"), in
#: order, None where an entry is gone: a sequence, or an iterator that yields them as they arrive (each
#: is checked as it comes). As few round trips as it can.
EntryFetch = Callable[[str, Sequence[str]], Iterable[Mapping[bytes, bytes] | None]]


class PayloadError(ValueError):
    """A payload entry does not hold what a sample payload must (raised as `DigestMismatch`)."""


def build_batch(
    manifest: StepManifest,
    rank: int,
    world_size: int,
    fetch: EntryFetch,
    *,
    run: str = "",
    client: BatchOwner | None = None,
    check_digests: bool = True,
    missing_hint: str = "replay it from the archive",
    run_config=None,
) -> Batch:
    """Rank ``rank``'s shard of ``manifest`` as a `Batch`, its payloads read through ``fetch``.

    With ``check_digests`` every group's payloads must hash to the digest the manifest recorded,
    else `DigestMismatch`. Without ``client`` the batch is read-only (`ReadOnlyBatch` on commit).
    ``run_config``: the run's recorded `RunConfig`, whose staleness policy may mask old tokens
    (`StaleMask`); the same settings give the same tensors, live or replayed.
    """
    shard = manifest.shards[rank]
    where = f"step {manifest.step} rank {rank}"
    placed = [(group, member) for group in shard.groups for member in group.members]
    arriving = _fetched(shard.groups, fetch, where, missing_hint)
    samples: list[SampleRows] = [None] * len(placed)  # type: ignore[list-item]
    # Without digests each entry is read as it arrives, while the rest of the shard is on its way.
    for at, entry in _digest_checked(shard.groups, arriving, where, fetch) if check_digests else arriving:
        group, member = placed[at]
        samples[at] = _rows(entry, group.task_id, member.slot, f"{where}: entry {member.entry}", member.rewards)
    task_ids = [group.task_id for group in shard.groups]
    sizes = [group.rows for group in shard.groups]
    batch = Batch(
        step=manifest.step,
        rank=rank,
        world_size=world_size,
        version=manifest.version,
        task_ids=task_ids,
        group_sizes=torch.tensor(sizes, dtype=torch.int64),
        step_loss_tokens=sum(s.tokens for s in manifest.shards),
        digest=shard.digest,
        run=run,
        _client=client,
        version_runs=row_runs(samples),
        **shard_tensors(samples),
    )
    stale = StaleMask.of(run_config, manifest.version)
    if stale is not None:
        batch.stale_masked_tokens = mask_stale(batch, stale)
    return batch


def _fetched(
    groups: Sequence[ShardGroup], fetch: EntryFetch, where: str, hint: str
) -> Iterator[tuple[int, Mapping[bytes, bytes]]]:
    """(position in shard order, fields) of every member's payload entry, as the fetches bring them: one
    fetch per partition the shard's groups are in, the payloads stream first, then the slot log for the
    members a schema-1 log kept there. Raises `DigestMismatch` for an entry in neither."""
    by_partition: dict[int, list[int]] = {}
    entries: list[str] = []
    for group in groups:
        for member in group.members:
            by_partition.setdefault(group.partition, []).append(len(entries))
            entries.append(member.entry)
    for partition, positions in by_partition.items():
        suffix = f"@{partition}" if partition else ""
        missing: list[int] = []
        got = iter(fetch("payloads" + suffix, [entries[at] for at in positions]))
        for at in positions:
            fields = next(got, None)
            if fields:
                yield at, fields
            else:
                missing.append(at)
        if hasattr(got, "close"):
            got.close()  # a streaming read gives its connection back now, not when collected
        if missing:
            legacy = iter(fetch("slots" + suffix, [entries[at] for at in missing]))
            for at in missing:
                fields = next(legacy, None)
                if not fields:
                    raise DigestMismatch(
                        f"{where}: slot entry {entries[at]} is gone from the slot log (trimmed?); {hint}"
                    )
                yield at, fields


def _digest_checked(
    groups: Sequence[ShardGroup], arriving: Iterable[tuple[int, Mapping[bytes, bytes]]], where: str, fetch: EntryFetch
) -> Iterator[tuple[int, Mapping[bytes, bytes]]]:
    """``arriving`` whole, in shard order, once every group's entries hash to the digest the manifest
    recorded (else `DigestMismatch`, before any entry is read)."""
    fields = dict(arriving)
    at = 0
    for group in groups:
        members = [fields[position] for position in range(at, at + len(group.members))]
        if not _group_matches(group, members, fetch):
            raise DigestMismatch(
                f"{where}: task {group.task_id}'s slot entries do not match the digest the manifest recorded"
            )
        at += len(group.members)
    yield from sorted(fields.items())


def _group_matches(group: ShardGroup, members: list[Mapping[bytes, bytes]], fetch: EntryFetch) -> bool:
    """Whether ``members`` (the group's entries, in order) hash to ``group.digest``. A manifest keeps only
    the combined digest; when neither today's digests nor those of logs written before give it, the
    decision's per-member digests say how each was made (a group published across the change)."""
    for like in (None, codec.UNTAGGED):  # today's digests, then those of a log written before the tag
        if codec.combine_digests(codec.entry_digest(f, like=like) for f in members) == group.digest:
            return True
    suffix = f"@{group.partition}" if group.partition else ""
    [entry] = fetch("decisions" + suffix, [group.decision_entry])
    try:
        decision = codec.decode(entry) if entry else None
    except DecodeError:
        return False
    if not isinstance(decision, GroupDecided):
        return False
    recorded = {member.entry: member.digest for member in decision.members}
    digests = [recorded.get(member.entry, "") for member in group.members]
    return codec.combine_digests(digests) == group.digest and all(
        codec.entry_digest(f, like=digest) == digest for f, digest in zip(members, digests)
    )


def _rows(
    fields: Mapping[bytes, bytes], task_id: str, slot: int, where: str, rewards: tuple[float, ...] | None = None
) -> SampleRows:
    """The sample in a payload entry (or a schema-1 slot entry), checked against its task and slot;
    ``rewards``: the values a `SlotRewarded` brought after the result, replacing the payload's."""
    try:
        rows = _payload_rows(fields, task_id, slot)
        if rewards is None:
            return rows
        if len(rewards) != len(rows.row_lengths):
            raise PayloadError(
                f"the manifest gives {len(rewards)} rewards for a sample of {len(rows.row_lengths)} rows"
            )
        return SampleRows(rows.data, rows.row_lengths, tuple(rewards), rows.version, rows.token_versions)
    except (PayloadError, DecodeError) as exc:
        raise DigestMismatch(
            f"{where} does not hold the sample payload the manifest names ({exc}); the entry "
            "was altered or is not streamgrp's"
        ) from None


def _payload_rows(fields: Mapping[bytes, bytes], task_id: str, slot: int) -> SampleRows:
    """A payload's header read by the codec's compiled payload reader (`codec.payload_view`: types, bounds and
    where each tensor's bytes are, checked as `codec.decode` checks them), then what the `Sample` would check
    of its shape, written out flat: this runs once per row of every shard. The tensors are views of the
    entry's bytes (any buffer), never copies; their values were checked where the sample entered."""
    header = fields.get(codec.HEADER) or b""
    blob = memoryview(fields.get(codec.BLOB) or b"")
    try:
        view = codec.payload_view(header, blob)
    except DecodeError:
        legacy = _legacy_rows(fields, task_id, slot)  # a schema-1 slot entry carries its sample itself
        if legacy is None:
            raise
        return legacy
    if view.task_id != task_id or view.slot != slot:
        raise PayloadError(f"it is the payload of task {view.task_id!r} slot {view.slot!r}")
    sample = view.sample
    refs = (sample.token_ids.raw, sample.loss_mask.raw, sample.logprobs.raw)
    problem = layout_problem(sample.row_lengths, sample.rewards, *refs)
    if problem is not None:  # the rules a `Sample` is built by: one definition (streamgrp.core.values)
        raise PayloadError(problem)
    data: dict[str, tuple[memoryview | bytes, str]] = {
        name: (blob[ref.offset : ref.offset + ref.nbytes], ref.dtype) for (name, _), ref in zip(SAMPLE_TENSORS, refs)
    }
    total = sum(sample.row_lengths)
    meta = sample.meta
    runs = version_runs(meta.get("token_versions"), total) if meta else None
    return SampleRows(data, sample.row_lengths, sample.rewards, sample.version, runs)


def _legacy_rows(fields: Mapping[bytes, bytes], task_id: str, slot: int) -> SampleRows | None:
    """A schema-1 slot entry, which carried its sample inline: fully decoded (old logs only); None when the
    entry is no schema-1 slot result."""
    try:
        event = codec.decode_v1_slot_result(fields)
    except DecodeError:
        return None
    if event.sample is None or (event.task_id, event.slot) != (task_id, slot):
        raise PayloadError(f"it is slot {event.slot} of task {event.task_id!r}, {event.outcome}")
    return sample_rows(event.sample)


def sample_rows(sample: Sample) -> SampleRows:
    """A validated `Sample` as the loader reads it (tests, and schema-1 entries)."""
    data = {name: (getattr(sample, name).data, getattr(sample, name).dtype) for name, _ in SAMPLE_TENSORS}
    runs = sample_runs(sample)
    return SampleRows(data, sample.row_lengths, sample.rewards, sample.version, runs)
