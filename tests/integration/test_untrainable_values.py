"""Values that cannot train are refused where they enter, on a real server (SPEC section 5, issue 31).

A worker publishes a rollout's untrainable sample as a failed slot saying why; a sample that reaches
the slot log some other way (a foreign writer: here, the publish script called by hand) is refused
by the assembler when it reads the payload, dead-lettered with the reason, and folded as a failed
slot. Either way the rest of the run trains, and its weights stay finite."""

from __future__ import annotations

import math
import struct

import msgspec
import pytest
import torch
from cluster import client_for
from stored_payloads import delete_payload

from streamgrp.cli.metrics import Metrics
from streamgrp.config import AssemblerConfig, BatcherConfig, WorkerConfig
from streamgrp.core import codec
from streamgrp.core.events import GroupDecided, RawArray, Sample, SlotResult
from streamgrp.replay.verifier import format_report, verify
from streamgrp.services.assembler import Assembler
from streamgrp.services.batcher import Batcher
from streamgrp.services.worker import WorkerClient, WorkerProcess
from streamgrp.store import payloads, scripts
from streamgrp.store.keys import ASSEMBLER_GROUP
from streamgrp.train.trainer import TrainerClient

VOCAB = 64
ASSEMBLER = AssemblerConfig(lease_ttl_s=2, tick_interval_s=0.05)


def good_sample(slot: int, *, version: int = 0, tokens=(3, 4, 5, 6)) -> Sample:
    return Sample.from_rows(
        token_ids=[list(tokens)],
        loss_mask=[[0, 1, 1, 1]],
        logprobs=[[0.0, -0.7, -1.2, -0.3]],
        rewards=[float(slot)],
        version=version,
    )


def nan_on_slot_one(request):
    """Slot 1 of every task returns NaN logprobs, built without validation (as a fast adapter might)."""
    sample = good_sample(request.slot, version=request.version)
    if request.slot != 1:
        return sample
    nan = RawArray(dtype="float32", shape=(4,), data=struct.pack("<4f", 0.0, math.nan, -1.0, math.nan))
    unchecked = sample.replace()
    msgspec.structs.force_setattr(unchecked, "logprobs", nan)  # built without its checks
    return unchecked


def train(client, redis_url, run, *, steps: int) -> torch.Tensor:
    """Batch ``steps`` steps and train them with a policy-gradient loss on a one-weight-per-token model."""
    batcher = Batcher(client, run, BatcherConfig(round_s=0.05, lease_ttl_s=5, max_steps=steps))
    assert batcher.lease.acquire()
    batcher._activate()
    batcher.round()
    weights = torch.zeros(VOCAB, requires_grad=True)
    optimizer = torch.optim.SGD([weights], lr=0.5)
    trained = 0
    trainer = TrainerClient(client_for(redis_url), run, poll_s=0.1, check_digests=True)
    with trainer.batches(rank=0, world_size=1) as batches:
        for batch in batches:
            logprobs = torch.log_softmax(weights, 0)[batch.token_ids]
            advantages = (batch.rewards - batch.rewards.mean()).unsqueeze(1)
            ratio = torch.exp(logprobs - batch.logprobs)
            loss = -(ratio * advantages * batch.loss_mask).sum() / batch.step_loss_tokens
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            trained += 1
    assert trained == steps
    return weights.detach()


def slot_results(client, run) -> dict[tuple[str, int], SlotResult]:
    events = (codec.decode(fields) for _, fields in client.xrange(run.keys.slots))
    return {(e.task_id, e.slot): e for e in events if isinstance(e, SlotResult)}


def decisions(client, run) -> dict[str, GroupDecided]:
    return {d.task_id: d for d in (codec.decode(fields) for _, fields in client.xrange(run.keys.decisions))}


def counts(client, run) -> dict[str, int]:
    return {key.decode(): int(value) for key, value in client.hgetall(run.keys.counts).items()}


def test_a_rollout_returning_nan_logprobs_is_refused_by_the_worker_and_the_run_trains_finite_weights(
    client, redis_url, make_run, issuer
):
    run = make_run(n_samples=4, batch_size=2, dp_size=1)
    issuer(run).issue([{} for _ in range(4)])
    metrics = Metrics(role="worker")
    worker = WorkerProcess(
        WorkerClient(client, run.keys),
        nan_on_slot_one,
        WorkerConfig(burst=True, concurrency=4),
        n_samples=4,
        metrics=metrics,
    )
    assert worker.run() == 4  # no slot stopped the worker
    assert metrics.registry.get_sample_value("streamgrp_slots_published_total", {"outcome": "invalid"}) == 4
    assert metrics.registry.get_sample_value("streamgrp_slots_published_total", {"outcome": "sample"}) == 12

    results = slot_results(client, run)
    for (task, slot), result in results.items():
        if slot == 1:
            assert result.outcome == "failed" and "logprobs[1] is nan" in result.error, result
        else:
            assert result.outcome == "sample"
    Assembler(client, run, ASSEMBLER).run(burst=True)
    decided = decisions(client, run)
    assert len(decided) == 4
    assert all(
        d.decision == "partial" and d.slot_outcomes["1"] == "failed" and d.slots == (0, 2, 3) for d in decided.values()
    )

    weights = train(client, redis_url, run, steps=2)
    assert torch.isfinite(weights).all()
    assert weights.abs().sum() > 0  # the usable slots trained


def test_a_token_id_beyond_the_runs_vocabulary_is_refused_by_the_worker(client, make_run, issuer):
    run = make_run(n_samples=2, vocab_size=VOCAB)
    issuer(run).issue([{}])
    worker = WorkerClient(client, run.keys)
    assert worker.vocab_size == VOCAB  # read from the run's record

    def beyond(request):
        return good_sample(request.slot, tokens=(3, 4, VOCAB if request.slot else VOCAB - 1, 6))

    assert WorkerProcess(worker, beyond, WorkerConfig(burst=True), n_samples=2).run() == 1
    by_slot = {slot: result for (_, slot), result in slot_results(client, run).items()}
    assert by_slot[0].outcome == "sample"
    assert (
        by_slot[1].outcome == "failed"
        and f"token_ids[2] is {VOCAB}, not below the run's vocab_size {VOCAB}" in by_slot[1].error
    )


def test_a_run_without_a_vocabulary_checks_only_the_sign(client, make_run):
    run = make_run(n_samples=2)
    assert run.config.vocab_size is None and WorkerClient(client, run.keys).vocab_size is None


# -- a foreign writer ------------------------------------------------------------------------------------


def foreign_publish(client, run, result: SlotResult, payload: dict[bytes, bytes]) -> str:
    """Publish a slot result and its payload as they are, through the publish function (no worker checks)."""
    pipe = client.pipeline(transaction=False)
    staged = payloads.stage(pipe, run.keys.payloads, payload[codec.HEADER], payload[codec.BLOB])
    scripts.register(client, "publish_staged.lua")(
        keys=[run.keys.slots, run.keys.payloads, run.keys.tasks, staged],
        args=["", 0, codec.encode(result)[codec.HEADER], "1"],
        client=pipe,
    )
    [entry] = pipe.execute()[-1]
    return entry.decode() if isinstance(entry, bytes) else entry


def with_blob(result: SlotResult, payload: dict[bytes, bytes], blob: bytes):
    """The payload with other bytes, and a slot result whose digest matches them (what a forger computes)."""
    forged = {codec.HEADER: payload[codec.HEADER], codec.BLOB: blob}
    digest = codec.entry_digest(forged)
    return result.replace(sample=result.sample.replace(digest=digest)), forged


def nan_logprob(result, payload):
    return with_blob(result, payload, payload[codec.BLOB][:-4] + struct.pack("<f", math.nan))


def beyond_vocabulary(result, payload):
    return with_blob(result, payload, struct.pack("<i", 5000) + payload[codec.BLOB][4:])


def tokens_disagree(result, payload):
    # "tokens of 10^12 trains the step silently at loss 0" (issue 31)
    return result.replace(sample=result.sample.replace(tokens=10**12)), payload


def rows_disagree(result, payload):
    return result.replace(sample=result.sample.replace(rows=3)), payload


FORGERIES = {
    "nan_logprob": (nan_logprob, "logprobs[3] is nan"),
    "beyond_vocabulary": (beyond_vocabulary, f"token_ids[0] is 5000, not below the run's vocab_size {VOCAB}"),
    "tokens_disagree": (tokens_disagree, "says rows, tokens, version [1, 1000000000000, 0]"),
    "rows_disagree": (rows_disagree, "says rows, tokens, version [3, 3, 0]"),
    "payload_deleted": (None, "its payload entry is not in the payloads stream"),
}


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_a_foreign_sample_that_cannot_train_is_dead_lettered_folded_as_failed_and_never_trained(
    client, redis_url, make_run, issuer, forgery
):
    forge, detail = FORGERIES[forgery]
    vocabulary = {"vocab_size": VOCAB} if forgery == "beyond_vocabulary" else {}
    run = make_run(n_samples=2, batch_size=2, dp_size=1, **vocabulary)
    [bad_task, good_task] = [task.task_id for task in issuer(run).issue([{}, {}])]
    worker = WorkerClient(client, run.keys)
    result, payload = codec.sample_result(bad_task, 1, good_sample(1), producer="forger")
    if forge is not None:
        result, payload = forge(result, payload)
    entry = foreign_publish(client, run, result, payload)
    if forge is None:
        delete_payload(client, run.keys, entry)
    worker.publish(bad_task, 0, good_sample(0))
    for slot in (0, 1):
        worker.publish(good_task, slot, good_sample(slot))

    Assembler(client, run, ASSEMBLER).run(burst=True)
    decided = decisions(client, run)
    bad = decided[bad_task]
    assert (bad.decision, bad.slot_outcomes, bad.slots, bad.closed_by) == (
        "partial",
        {"0": "sample", "1": "failed"},
        (0,),
        "all_slots",
    )  # refused at once, not by the deadline
    assert decided[good_task].decision == "complete"
    [(_, letter)] = client.xrange(run.keys.deadletter)
    assert (letter[b"reason"], letter[b"entry"].decode()) == (b"invalid_sample", entry)
    assert detail in letter[b"detail"].decode()
    assert counts(client, run)["deadletter:invalid_sample"] == 1
    assert counts(client, run)["slots:invalid"] == 1
    assert client.xpending(run.keys.slots, ASSEMBLER_GROUP)["pending"] == 0

    weights = train(client, redis_url, run, steps=1)  # neither crashes the trainer nor trains the bad sample
    assert torch.isfinite(weights).all()
    report = verify(client, run.keys)  # which folds the refused entry as the assembler did
    assert report.ok, format_report(report)


def test_a_refused_sample_stays_pending_until_its_group_is_decided_and_a_restarted_assembler_refuses_it_again(
    client, make_run, issuer
):
    run = make_run(n_samples=2)
    [task] = [issued.task_id for issued in issuer(run).issue([{}])]
    entry = foreign_publish(client, run, *nan_logprob(*codec.sample_result(task, 1, good_sample(1))))

    Assembler(client, run, ASSEMBLER).run(burst=True)  # the group is open: slot 0 has no result yet
    assert client.xrange(run.keys.deadletter) == [] and decisions(client, run) == {}
    assert client.xpending(run.keys.slots, ASSEMBLER_GROUP)["pending"] == 2  # the task and the refused slot

    WorkerClient(client, run.keys).publish(task, 0, good_sample(0))
    Assembler(client, run, ASSEMBLER).run(burst=True)  # a new process: rebuilds the group from pending entries
    [decision] = decisions(client, run).values()
    assert (decision.decision, decision.slot_outcomes) == ("partial", {"0": "sample", "1": "failed"})
    [(_, letter)] = client.xrange(run.keys.deadletter)
    assert (letter[b"reason"], letter[b"entry"].decode()) == (b"invalid_sample", entry)
    assert client.xpending(run.keys.slots, ASSEMBLER_GROUP)["pending"] == 0
