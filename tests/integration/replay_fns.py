"""Functions the replay tests pass to `streamgrp replay --run-fn` by ``module:function``."""


def shard_stats(batch):
    """What a debugging function might return: a few numbers about the replayed shard."""
    return {"rows": batch.rows, "groups": len(batch.task_ids), "loss_tokens": int(batch.loss_mask.sum())}


def explode(batch):
    raise FloatingPointError(f"replayed fault at step {batch.step} on rank {batch.rank}")


def commit_it(batch):
    batch.commit()
