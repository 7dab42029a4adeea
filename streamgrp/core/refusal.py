"""What the fold takes for a sample refused where it entered: a failed slot saying why.

Owns the one definition both the assembler (which refuses a foreign sample whose payload cannot
train, `streamgrp.core.codec.payload_problem`, and dead-letters its slot entry as `INVALID_SAMPLE`)
and `verify` (which folds such a dead-lettered entry the same way) use, so the two never disagree.
"""

from __future__ import annotations

from streamgrp.core.events import SlotResult

#: The dead-letter reason of a slot entry whose sample the assembler refused.
INVALID_SAMPLE = "invalid_sample"
#: The dead-letter reason of a task entry in the group log that no issue wrote: its queue entry (field
#: ``q``, written by the same call) is missing or holds another header. Never opens a group.
TASK_NOT_ISSUED = "task_not_issued"
#: The dead-letter reason of a tick whose time was after the server's clock when the assembler read it
#: (the assembler writes its ticks at the server's time, so only a foreign writer's can be): never folded.
TICK_FROM_FUTURE = "tick_from_future"
#: Reasons of group-log entries the assembler dead-lettered without folding them (`verify` skips them too).
NOT_FOLDED = (TASK_NOT_ISSUED, TICK_FROM_FUTURE)
#: The longest refusal text a failed slot stands in with (the dead letter keeps more of it).
MAX_REFUSAL_CHARS = 1000


def refused(result: SlotResult, problem: str) -> SlotResult:
    """``result`` as a failed slot whose error says what is wrong with its sample."""
    return SlotResult(
        task_id=result.task_id,
        slot=result.slot,
        outcome="failed",
        producer=result.producer,
        seq=result.seq,
        error=f"invalid sample: {problem}"[:MAX_REFUSAL_CHARS],
    )
