"""TRL's async GRPO trainer on a tiny random model, fed by a streamgrp run (run by test_trl.py as a process).

    python trl_train.py URL RUN WORKDIR MAX_STEPS OUT_JSON

Builds a 2-layer Llama from a config (random weights) and a word-level tokenizer locally (nothing
downloaded), trains MAX_STEPS optimizer steps with `StreamgrpRollouts` and `StreamgrpWeights`,
and writes what the test checks: every sample TRL took (in order), the published weight versions,
the logged losses and how far the weights moved.
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
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0")),
                                        pad_token="t0", eos_token="t1", bos_token="t2", unk_token="t0",
                                        padding_side="left")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                         eos_token_id=1, bos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return tokenizer


class Losses(TrainerCallback):
    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append({k: v for k, v in (logs or {}).items() if isinstance(v, (int, float))})


def main(url: str, run_name: str, workdir: str, max_steps: int, out: str) -> None:
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
    args = AsyncGRPOConfig(output_dir=os.path.join(workdir, "out"), max_steps=max_steps, per_device_train_batch_size=4,
                           token_budget=0, bf16=False, use_cpu=True, activation_checkpointing=False, report_to=[],
                           save_strategy="no", learning_rate=1e-2, logging_steps=1, disable_tqdm=True)
    losses = Losses()
    trainer = AsyncGRPOTrainer(model=model_dir, args=args, train_dataset=Dataset.from_dict({"prompt": ["-"]}),
                               processing_class=tokenizer, rollout_worker=rollouts, weight_transfer=weights,
                               callbacks=[losses])
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    moved = sum(float((p.detach() - before[n]).abs().sum()) for n, p in trainer.model.named_parameters())
    result = {"global_step": trainer.state.global_step, "taken": taken, "published": weights.published,
              "skipped": weights.skipped, "logs": losses.logs, "moved": moved, "committed_by_feed": rollouts.committed_steps,
              "model_version": trainer.model_version}
    with open(out, "wb") as handle:
        handle.write(orjson.dumps(result))


if __name__ == "__main__":
    url, run_name, workdir, max_steps, out = sys.argv[1:6]
    main(url, run_name, workdir, int(max_steps), out)
