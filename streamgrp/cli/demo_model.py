"""`streamgrp demo --model FILE.gguf`: the asynchronous RL loop on a real language model, on a laptop CPU.

Owns orchestration only, like `streamgrp.cli.demo` (whose process handling it reuses): start the
server, write a dataset of arithmetic questions in the model's chat format, start one trainer rank
(``streamgrp.consumers.lm_trainer``: the GGUF's weights in torch, written back as version 0 and then
as each new version, ``weights/vNNNNNN/model.gguf``) and `streamgrp weight-sync`, which owns
llama-server and restarts it on each version the trainer writes (alias ``policy@vN``); once
llama-server answers, the batcher, the assembler and the workers (``--rollout llamacpp``). Show
progress, stop everything, and print the run's summary with the per-step mismatch between the
log-probabilities llama-server returned and the ones torch recomputes. The run keeps the default
staleness bound: the served policy follows the trained one. With ``--lm-lr`` 0 (the default) no
training step is taken, the weights stay the GGUF's and the reward cannot move; the summary says so.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

import orjson

from streamgrp.cli import children as processes
from streamgrp.cli.demo import Child, _watch, stop_children
from streamgrp.cli.server import ensure_server
from streamgrp.config import ConnectionConfig, DemoConfig, RunConfig
from streamgrp.errors import ConfigError, RoleFailed
from streamgrp.replay.summary import format_summary, run_summary
from streamgrp.store.runs import connect, join_run

MAX_TOKENS = 16


def run_model_demo(
    connection: ConnectionConfig,
    run_settings: RunConfig,
    demo: DemoConfig,
    *,
    out=sys.stdout,
    err=sys.stderr,
    stop: threading.Event | None = None,
) -> dict[str, Any]:
    """Run the model demo to the end and return its summary (also printed); raises `RoleFailed`."""
    stop_event = stop or threading.Event()
    if demo.model is None:
        raise ConfigError("the model demo needs --model: the GGUF file to serve and train")
    model = Path(demo.model).resolve()
    if not model.is_file():
        raise ConfigError(f"--model {demo.model}: no such GGUF file (ops/llama-server.sh unpacks SmolLM2-135M's)")
    if shutil.which(shlex.split(demo.llama_server)[0]) is None:
        raise ConfigError(
            f"cannot run llama-server {demo.llama_server!r}; give --llama-server PATH "
            '(eval "$(ops/llama-server.sh)" builds one and sets LLAMA_SERVER)'
        )
    started = time.monotonic()
    run_name = connection.run or time.strftime("model-%Y%m%d-%H%M%S")
    settings = run_settings.model_copy(update={"dp_size": 1})
    with ensure_server(
        connection.redis_url, connection.data_dir, maxmemory=connection.maxmemory, cluster=connection.cluster
    ) as server:
        client = connect(server.url, cluster=connection.cluster)
        run = join_run(client, run_name, RunConfig(**settings.model_dump()))
        log_dir = Path(connection.data_dir) / "logs" / run_name
        log_dir.mkdir(parents=True, exist_ok=True)
        llama_url = f"http://127.0.0.1:{processes.free_port('127.0.0.1')}"
        dataset = _write_dataset(log_dir / "prompts.jsonl", demo.steps * run.config.batch_size * 2 + 16)
        children = _children(server.url, run_name, demo, dataset, llama_url, model, log_dir, cluster=connection.cluster)
        print(
            f"streamgrp demo: run {run_name} on {model.name} via llama-server at {llama_url} "
            f"({len(children) + 1} processes; logs in {log_dir})",
            file=err,
            flush=True,
        )
        try:
            serving = [child for child in children if child.role in ("trainer", "weight-sync")]
            for child in serving:
                child.start()
            _await_llama(llama_url, serving, stop_event, started, demo.timeout_s)
            for child in children:
                if child.proc is None:
                    child.start()
            _watch(client, run.keys, children, demo, started, stop_event, err)
        finally:
            stop_children(children)
        summary = run_summary(client, run.keys)
        summary["seconds"] = round(time.monotonic() - started, 2)
        summary["logprob_mismatch"] = _mismatch(client, run.keys.trainer_metrics)
        print(format_summary(summary, summary["seconds"]), file=out)
        print(_format_mismatch(summary["logprob_mismatch"], demo.lm_lr), file=out)
        if demo.as_json:
            print(orjson.dumps(summary).decode(), file=out)
        client.close()
    return summary


def _await_llama(url: str, serving: list[Child], stop: threading.Event, started: float, timeout_s: float) -> None:
    """Wait until llama-server answers: the trainer has written version 0 and weight-sync started it on it."""
    from streamgrp.services.inference.http import InferenceError
    from streamgrp.services.inference.weight_sync import wait_healthy

    while True:
        for child in serving:
            if child.process.poll() is not None:
                raise RoleFailed(
                    f"{child.label} exited with code {child.process.returncode} before llama-server served; "
                    f"last lines of {child.log_path}:\n{child.tail()}"
                )
        if stop.is_set():
            raise KeyboardInterrupt
        if time.monotonic() - started > timeout_s:
            raise RoleFailed(f"llama-server did not serve within {timeout_s:g}s (--timeout-s); see the logs")
        try:
            wait_healthy(url, 1.0)
            return
        except InferenceError:
            continue


def _write_dataset(path: Path, count: int) -> Path:
    with path.open("wb") as handle:
        for index in range(count):
            a, b = index * 7 % 9 + 1, index * 5 % 8 + 1
            text = f"<|im_start|>user\nWhat is {a}+{b}? Answer with one number.<|im_end|>\n<|im_start|>assistant\n"
            handle.write(orjson.dumps({"text": text, "answer": str(a + b)}) + b"\n")
    return path


def _children(
    url: str,
    run_name: str,
    demo: DemoConfig,
    dataset: Path,
    llama_url: str,
    model: Path,
    log_dir: Path,
    *,
    cluster: bool = False,
) -> list[Child]:
    common = ["--redis-url", url, "--run", run_name, *(["--cluster"] if cluster else [])]
    weights = log_dir / "weights"
    port = llama_url.rsplit(":", 1)[1]
    llama = shlex.join(
        [
            *shlex.split(demo.llama_server),
            "--host",
            "127.0.0.1",
            "--port",
            port,
            "-c",
            "4096",
            "-np",
            "4",
            "-t",
            str(_llama_threads()),
            "--poll",
            "0",
            "--no-webui",
        ]
    )
    children = [
        Child(
            "trainer",
            0,
            [
                *common,
                "--train-fn",
                "streamgrp.consumers.lm_trainer:train",
                "--model-gguf",
                str(model),
                "--lm-lr",
                str(demo.lm_lr),
                "--weights-dir",
                str(weights),
            ],
            log_dir / "trainer-0.log",
        ),
        Child(
            "weight-sync",
            0,
            [
                *common,
                "--dialect",
                "llamacpp",
                "--llama-server-cmd",
                llama,
                "--server-url",
                llama_url,
                "--weights-dir",
                str(weights),
                "--load-timeout-s",
                "180",
                "--llama-server-log",
                str(log_dir / "llama-server.log"),
            ],
            log_dir / "weight-sync.log",
        ),
        Child(
            "batcher",
            0,
            [*common, "--dataset", str(dataset), "--max-steps", str(demo.steps), "--round-s", "0.5"],
            log_dir / "batcher.log",
        ),
        Child("assembler", 0, [*common, "--tick-interval-s", "0.2"], log_dir / "assembler.log"),
    ]
    for index in range(demo.workers):
        children.append(
            Child(
                "worker",
                index,
                [
                    *common,
                    "--rollout",
                    "llamacpp",
                    "--server-url",
                    llama_url,
                    "--concurrency",
                    str(max(1, 4 // demo.workers)),
                    "--max-tokens",
                    str(MAX_TOKENS),
                    "--claim-idle-s",
                    "60",
                ],
                log_dir / f"worker-{index}.log",
            )
        )
    return children


def _mismatch(client, key: str) -> list[dict[str, Any]]:
    rows = [orjson.loads(value) for value in client.hgetall(key).values()]
    fields = ("step", "tokens_compared", "logprob_abs_diff_mean", "logprob_abs_diff_max", "kl_estimate", "reward_mean")
    return sorted(({name: row.get(name) for name in fields} for row in rows), key=lambda row: row["step"])


def _format_mismatch(rows: list[dict[str, Any]], lm_lr: float) -> str:
    lines = ["  logprobs     |llama-server - torch| per completion token, by step:"]
    for row in rows:
        if row["tokens_compared"]:
            lines.append(
                f"    step {row['step']:>3}  mean {row['logprob_abs_diff_mean']:.4f}  max "
                f"{row['logprob_abs_diff_max']:.4f}  KL~{row['kl_estimate']:.5f}  over "
                f"{row['tokens_compared']} tokens  reward {row['reward_mean']:.3f}"
            )
    if lm_lr == 0:
        lines.append(
            "  reward       flat by design: --lm-lr 0 takes no training step (the weights stay the GGUF's); "
            "--lm-lr 2e-5 trains"
        )
    return "\n".join(lines)


def _llama_threads() -> int:
    """Half the cores for llama-server, the rest for the trainer and the other roles: llama.cpp's threads
    spin-wait on each other, so one more than the cores left free multiplies generation time (a llama test
    with one core busy: 42 s at one thread, 257 s at two)."""
    return max(1, (os.cpu_count() or 2) // 2)
