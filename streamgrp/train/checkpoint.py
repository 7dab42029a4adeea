"""Checkpoints of a trainer's weights and optimizer state: durable files first, then the event.

Owns the checkpoint files: ``DIR/step-NNNNNNNN-aA/`` holding ``model.safetensors`` (the state dict)
and ``optimizer.safetensors`` (every tensor of the optimizer's state, its other values and its
parameter groups as JSON in the file's metadata). No pickle. A checkpoint is written into a
temporary directory, each file fsynced, renamed into place and the parent fsynced; only then does
`streamgrp.train.trainer.TrainerClient.record_checkpoint` record it (`CheckpointSaved`, with each
file's size). A write killed halfway leaves a temporary directory no event names: never loaded, and
removed by the next save. Loading checks each file's recorded size before reading it. Weights that
share memory (a language model's embedding tied to its output layer) are stored once.

Retention (`prune_checkpoints`, run by `Checkpoints.save` right after a checkpoint is recorded): the
newest ``keep`` checkpoints up to the recorded one stay, older ones go, and so do directories of a
lost attempt (a step after the recorded one, or the same step of another attempt: written, never
recorded, never loadable). Nothing is removed before a newer checkpoint is recorded, so the one a
trainer resumed from stays until then.

Deliberately ignores which ranks hold which parameters: a data-parallel group's ranks hold the same
weights, so one rank writes the whole checkpoint.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import orjson
import torch

from streamgrp.core.events import CheckpointSaved
from streamgrp.errors import StreamgrpError
from streamgrp.store.segment_file import fsync_dir

if TYPE_CHECKING:
    from streamgrp.train.trainer import Batch, TrainerClient

log = logging.getLogger(__name__)

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
#: Prefix of a checkpoint being written; such a directory is never loaded.
PARTIAL = ".partial-"
#: A checkpoint directory's name (`checkpoint_name`): its step and the attempt that wrote it.
NAME = re.compile(r"^step-(\d{8,})-a(\d+)$")


class CheckpointError(StreamgrpError):
    """A recorded checkpoint's files are missing, of another size than recorded, or unreadable."""


def checkpoint_name(step: int, attempt: int) -> str:
    return f"step-{step:08d}-a{attempt}"


def save_training_state(
    directory: Path,
    *,
    step: int,
    attempt: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    halfway: Callable[[], None] | None = None,
) -> tuple[Path, dict[str, int]]:
    """Write the model's and the optimizer's state durably under ``directory``; returns the checkpoint's
    path and each file's size, for the `CheckpointSaved` event. ``halfway`` is called between the two
    files (fault injection: a crash there must leave nothing loadable)."""
    from safetensors.torch import save_file, save_model

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob(f"{PARTIAL}*"):  # a write that a crash cut off
        shutil.rmtree(stale, ignore_errors=True)
    final = directory / checkpoint_name(step, attempt)
    partial = directory / f"{PARTIAL}{final.name}"
    partial.mkdir()
    save_model(model, str(partial / MODEL_FILE))  # a tensor shared by several names is written once
    if halfway is not None:
        halfway()
    if optimizer is not None:
        tensors, metadata = optimizer_tensors(optimizer)
        save_file(tensors, partial / OPTIMIZER_FILE, metadata=metadata)
    files = {}
    for path in sorted(partial.iterdir()):
        with open(path, "rb") as written:
            os.fsync(written.fileno())
        files[path.name] = path.stat().st_size
    fsync_dir(partial)
    if final.exists():  # the same step saved by a lost attempt: this one replaces it
        shutil.rmtree(final)
    os.rename(partial, final)
    fsync_dir(directory)
    return final, files


def load_training_state(
    saved: CheckpointSaved, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> None:
    """Load a recorded checkpoint into ``model`` and ``optimizer``, its file sizes checked first."""
    from safetensors.torch import load_model, safe_open

    path = Path(saved.path)
    for name, size in saved.files.items():
        found = path / name
        if not found.is_file() or found.stat().st_size != size:
            actual = found.stat().st_size if found.is_file() else "missing"
            raise CheckpointError(
                f"checkpoint of step {saved.step} at {path}: {name} is {actual}, recorded as {size} "
                "bytes; it was changed or removed after it was recorded"
            )
    load_model(model, path / MODEL_FILE)  # strict: every name of the model, tied ones from their one copy
    if optimizer is not None and OPTIMIZER_FILE in saved.files:
        with safe_open(path / OPTIMIZER_FILE, framework="pt") as opened:
            metadata = opened.metadata()
            tensors = {key: opened.get_tensor(key) for key in opened.keys()}
        optimizer.load_state_dict(optimizer_state(tensors, metadata))


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """An optimizer's state dict as safetensors' tensors and string metadata: ``state.P.NAME`` for
    each tensor of parameter P's state, the rest as JSON."""
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, dict[str, object]] = {}
    for param, entries in state["state"].items():
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{param}.{name}"] = value.detach().cpu().contiguous()
            else:
                values.setdefault(str(param), {})[name] = value
    return tensors, {
        "values": orjson.dumps(values).decode(),
        "param_groups": orjson.dumps(state["param_groups"]).decode(),
    }


def optimizer_state(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> dict:
    """The inverse of `optimizer_tensors`."""
    state: dict[int, dict[str, object]] = {}
    for key, tensor in tensors.items():
        _, param, name = key.split(".", 2)
        state.setdefault(int(param), {})[name] = tensor
    for param, entries in orjson.loads(metadata.get("values", "{}")).items():
        state.setdefault(int(param), {}).update(entries)
    return {"state": state, "param_groups": orjson.loads(metadata["param_groups"])}


def prune_checkpoints(directory: Path, *, newest: CheckpointSaved, keep: int) -> list[Path]:
    """Remove what retention lets go once ``newest`` is the run's newest recorded checkpoint: checkpoints
    older than the ``keep`` newest up to it, and any after it or beside it (same step, another attempt),
    which a lost attempt wrote and never recorded. Returns the removed directories."""
    if keep < 1:
        raise ValueError(f"keep={keep}: at least the newest checkpoint is kept")
    found = []
    for path in Path(directory).iterdir():
        match = NAME.match(path.name)
        if match and path.is_dir() and not path.is_symlink():
            found.append((int(match[1]), int(match[2]), path))
    recorded = Path(newest.path).name
    stale = [path for step, _, path in found if step > newest.step or (step == newest.step and path.name != recorded)]
    older = sorted(((step, attempt, path) for step, attempt, path in found if step < newest.step), reverse=True)
    removed = stale + [path for _, _, path in older[keep - 1 :]]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    if removed:
        fsync_dir(Path(directory))
        log.info(
            "removed %d checkpoint(s) (keeping the newest %d): %s",
            len(removed),
            keep,
            ", ".join(path.name for path in removed),
        )
    return removed


class Checkpoints:
    """A trainer's checkpoints under one directory: loading the newest recorded one on start, writing and
    recording one every ``every`` steps, and retention (``keep``). Used by both reference trainers."""

    def __init__(self, trainer: TrainerClient, directory: Path, *, every: int, keep: int) -> None:
        if every < 1 or keep < 1:
            raise ValueError(f"checkpoints every {every} steps, keeping {keep}: both must be at least 1")
        self.trainer = trainer
        self.directory = Path(directory)
        self.every = every
        self.keep = keep

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
        """Load the newest recorded checkpoint; returns the step it holds (``resume_after``), -1 for the
        initial weights when none is recorded yet."""
        saved = self.trainer.latest_checkpoint()
        if saved is None:
            return -1
        load_training_state(saved, model, optimizer)
        log.info("loaded the checkpoint of step %d (version %d) from %s", saved.step, saved.version, saved.path)
        return saved.step

    def due(self, batch: Batch) -> bool:
        return (batch.step + 1) % self.every == 0

    def save(
        self,
        batch: Batch,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        ranks: tuple[int, ...] = (0,),
        halfway: Callable[[], None] | None = None,
    ) -> CheckpointSaved:
        """Write, record (call it once every rank committed ``batch``'s step), then apply retention."""
        path, files = save_training_state(
            self.directory, step=batch.step, attempt=batch.attempt, model=model, optimizer=optimizer, halfway=halfway
        )
        saved = self.trainer.record_checkpoint(batch, path, files, ranks=ranks)
        prune_checkpoints(self.directory, newest=self.trainer.latest_checkpoint() or saved, keep=self.keep)
        return saved
