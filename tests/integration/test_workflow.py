"""An AReaL-style workflow (`areal_like`: written like AReaL's RLVR example, a fake engine) as the rollout
of a real worker loop, folded by the real assembler on a real server (`streamgrp.services.workflow`).

Each slot runs one episode: a returned dict is a sample whose version is its oldest token's, None is a
rejected slot, an exception a failed one; the assembler then decides the groups AReaL's grouped
workflow would have gathered in memory, partial ones included.
"""

from __future__ import annotations

import inspect
from collections import Counter

import areal_like
from stored_payloads import payload_entries

from streamgrp.config import load_callable
from streamgrp.core import codec
from streamgrp.core.events import GroupDecided, SamplePayload, SlotResult
from streamgrp.core.policy import NormSpec

PROMPT = {"messages": [{"role": "user", "content": "say abc"}], "answer": "abc"}


def test_episodes_become_samples_rejections_and_failures_and_groups_fold(client, make_run, issuer, drain):
    rollout = load_callable("areal_like:rollout")  # what `streamgrp worker --rollout areal_like:rollout` loads
    assert inspect.iscoroutinefunction(rollout)
    workflow, engine = areal_like.workflow, areal_like.engine
    workflow.outcomes.clear()
    run = make_run(n_samples=4, reward_norm=NormSpec("group", "group"), group_timeout_s=60.0)
    issuer(run).issue([PROMPT] * 10)
    drain(client, run, rollout)

    slots = {eid.decode(): codec.decode(f) for eid, f in client.xrange(run.keys.slots)}
    results = [e for e in slots.values() if isinstance(e, SlotResult)]
    assert len(results) == 40
    assert Counter(r.outcome for r in results) == Counter(workflow.outcomes)
    assert {"sample", "rejected", "failed"} <= set(workflow.outcomes)
    failures = [r.error for r in results if r.outcome == "failed"]
    assert all(e.startswith("ConnectionError: inference server dropped request") for e in failures)

    # Each sample's version is the oldest version among its generated tokens (the engine's first token).
    payloads = [codec.decode(f) for _, f in payload_entries(client, run.keys)]
    samples = {(p.task_id, p.slot): p.sample for p in payloads if isinstance(p, SamplePayload)}
    prompt_len = len(workflow.tokenizer.apply_chat_template(PROMPT["messages"]))
    for result in results:
        if result.outcome != "sample":
            continue
        sample = samples[(result.task_id, result.slot)]
        completion = tuple(sample.token_ids.to_list()[prompt_len:])
        assert sample.version == result.sample.version == engine.oldest[completion]
        assert sample.loss_mask.to_list() == [0] * prompt_len + [1] * len(completion)
    assert {s.version for s in samples.values()} == {0, 1, 2}

    decisions = [codec.decode(f) for _, f in client.xrange(run.keys.decisions)]
    assert len(decisions) == 10 and all(isinstance(d, GroupDecided) for d in decisions)
    by_kind = Counter(d.decision for d in decisions)
    assert by_kind["partial"] >= 1
    for decision in decisions:
        usable = [r for r in results if r.task_id == decision.task_id and r.outcome == "sample"]
        assert decision.stats.usable_slot_count == len(usable)
        if decision.decision != "dropped":
            assert [m.slot for m in decision.members] == sorted(r.slot for r in usable)
