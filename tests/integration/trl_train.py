"""TRL's async GRPO trainer on a tiny random model, fed by a streamgrp run (run by test_trl.py as a process).

    python trl_train.py URL RUN WORKDIR MAX_STEPS OUT_JSON [SAVE_STEPS [RESUME_CHECKPOINT]]

Builds a 2-layer Llama from a config (random weights) and a word-level tokenizer locally (nothing
downloaded), trains up to MAX_STEPS optimizer steps with `StreamgrpRollouts` and `StreamgrpWeights`
(a TRL checkpoint every SAVE_STEPS, 0: none; resuming from RESUME_CHECKPOINT when given), and
writes what the test checks: every sample TRL took (in order), the samples of the micro-batches
whose optimizer step completed (seen at TRL's collator and counted at its training step, apart from
the feed's own bookkeeping), the published weight versions, the logged losses and how far the
weights moved.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import orjson  # noqa: E402
import torch  # noqa: E402
import trl_cpu  # noqa: E402
from datasets import Dataset  # noqa: E402
from rollouts import TINY_VOCAB  # noqa: E402
from tokenizers import Tokenizer, models  # noqa: E402
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    TrainerCallback,
)
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer  # noqa: E402

from streamgrp.store.runs import connect, open_run  # noqa: E402
from streamgrp.train.trainer import TrainerClient  # noqa: E402
from streamgrp.train.trl_async import StreamgrpRollouts, StreamgrpWeights  # noqa: E402


def tiny_model(directory: str) -> PreTrainedTokenizerFast:
    vocab = {f"t{i}": i for i in range(TINY_VOCAB)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0")),
        pad_token="t0",
        eos_token="t1",
        bos_token="t2",
        unk_token="t0",
        padding_side="left",
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return tokenizer


class Losses(TrainerCallback):
    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append({k: v for k, v in (logs or {}).items() if isinstance(v, (int, float))})


class Trained(TrainerCallback):
    """The rows of every micro-batch TRL packed (its collator), in order, and how many micro-batches had gone
    through TRL's training step when each optimizer step completed."""

    def __init__(self, trainer) -> None:
        self.packed: list[list[list[int]]] = []
        self.steps = 0
        self.through = 0
        original = trainer.training_step

        def training_step(*args, **kwargs):
            out = original(*args, **kwargs)
            self.steps += 1
            return out

        trainer.training_step = training_step

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        loader = train_dataloader.base_dataloader
        collate = loader.collate_fn

        def packed(examples):
            self.packed.append([s["input_ids"].tolist() for rows in examples for row in rows for s in row.samples])
            return collate(examples)

        loader.collate_fn = packed

    def on_step_end(self, args, state, control, **kwargs):
        self.through = self.steps

    def trained(self) -> list[list[int]]:
        return [ids for batch in self.packed[: self.through] for ids in batch]


def main(
    url: str, run_name: str, workdir: str, max_steps: int, out: str, save_steps: int = 0, resume: str | None = None
) -> None:
    trl_cpu.install()
    model_dir = os.path.join(workdir, "model")
    tokenizer = tiny_model(model_dir)
    client = connect(url)
    run = open_run(client, run_name)
    rollouts = StreamgrpRollouts(TrainerClient(client, run, poll_s=0.1), decode=tokenizer.decode)
    taken: list[list[int]] = []
    get = rollouts.rollout_buffer.get

    def recording_get(*args, **kwargs):  # what TRL's dataset takes, in order
        sample = get(*args, **kwargs)
        taken.append(sample.input_ids.tolist())
        return sample

    rollouts.rollout_buffer.get = recording_get
    weights = StreamgrpWeights(client, run.keys)
    args = AsyncGRPOConfig(
        output_dir=os.path.join(workdir, "out"),
        max_steps=max_steps,
        per_device_train_batch_size=4,
        token_budget=0,
        bf16=False,
        use_cpu=True,
        activation_checkpointing=False,
        report_to=[],
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        learning_rate=1e-2,
        logging_steps=1,
        disable_tqdm=True,
    )
    losses = Losses()
    trainer = AsyncGRPOTrainer(
        model=model_dir,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["-"]}),
        processing_class=tokenizer,
        rollout_worker=rollouts,
        weight_transfer=weights,
        callbacks=[rollouts.callback, losses],
    )
    trained = Trained(trainer)
    trainer.add_callback(trained)  # after the feed's callback: it wraps the collator the feed already watches
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train(resume_from_checkpoint=resume)
    moved = sum(float((p.detach() - before[n]).abs().sum()) for n, p in trainer.model.named_parameters())
    result = {
        "global_step": trainer.state.global_step,
        "taken": taken,
        "published": weights.published,
        "skipped": weights.skipped,
        "logs": losses.logs,
        "moved": moved,
        "committed_by_feed": rollouts.committed_steps,
        "trained": trained.trained(),
        "retrained_rows": rollouts.retrained_rows,
        "model_version": trainer.model_version,
    }
    with open(out, "wb") as handle:
        handle.write(orjson.dumps(result))


if __name__ == "__main__":
    url, run_name, workdir, max_steps, out = sys.argv[1:6]
    main(
        url,
        run_name,
        workdir,
        int(max_steps),
        out,
        int(sys.argv[6]) if len(sys.argv) > 6 else 0,
        sys.argv[7] if len(sys.argv) > 7 else None,
    )
