"""The one exception tree of streamgrp.

    StreamgrpError
    ├── ConfigError (also ValueError)       a setting is invalid or disagrees with the run's record
    ├── DecodeError (also ValueError)       an entry's bytes do not decode or validate; carries .reason
    ├── RunFailed                           the run reached a terminal event (stall bound, a slot that broke
    │                                       the one-sample-per-slot contract)
    ├── RunEnded                            the run finished and every step was consumed; a consumer wants more
    ├── TrainerGroupError                   a trainer group's ranks disagree on the step, or a peer never joined
    ├── LeaseLost                           another process holds the role's lease: stop committing, stand by
    ├── DigestMismatch                      a shard's slot entries no longer hash to the manifest's digest
    ├── ReadOnlyBatch                       commit or fail on a replayed or loaded batch
    ├── BatchFileError                      a file given to load_batch is not a valid batch file
    ├── ArchiveError                        the archive directory is unusable (not one, another run's, locked, damaged)
    ├── WeightsConflict                     a weights version already names another weight state
    ├── RoleFailed                          a process the demo depends on exited with an error
    ├── SessionRefused                      an agent session cannot take this turn or end so; carries .code
    ├── ServerError                         the Redis/Valkey server could not be started or reached
    │   └── OutageBudgetExceeded            the server stayed unavailable longer than the outage budget
    └── StopRequested                       a stop (SIGTERM) arrived while waiting out an outage

Every message says what to change, not only what went wrong.
"""

from __future__ import annotations


class StreamgrpError(Exception):
    """Root of every error streamgrp raises on purpose."""


class ConfigError(StreamgrpError, ValueError):
    """A configuration value is invalid, or differs from the one the run recorded."""


class DecodeError(StreamgrpError, ValueError):
    """An event's bytes failed to decode or validate.

    ``reason`` is a short stable token (``missing_field``, ``bad_header``, ``length_mismatch``, ...)
    that becomes the dead-letter reason and a metric label; ``detail`` is the human sentence.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class RunFailed(StreamgrpError):
    """The run has a terminal event; every trainer rank raises this with the same message."""


class RunEnded(StreamgrpError):
    """The run finished, every step was handed over, and a consumer that cannot stop by itself (TRL's
    trainer, bounded by its own ``max_steps``) asked for more."""


class TrainerGroupError(StreamgrpError):
    """The ranks of a trainer group cannot train the same step together: they disagree on the step, the
    attempt or the step's manifest, a peer never joined, or a newer attempt replaced this one. Raised
    with the same message on every rank that sees it."""


class LeaseLost(StreamgrpError):
    """Another process holds the lease (or a commit found its step already written); this one must stop
    committing and stand by. Raised by `streamgrp.store.scripts` from a script's ``LEASE`` or ``STEP``
    error reply, and by `streamgrp.store.lease.Lease.renew_if_due`."""


class DigestMismatch(StreamgrpError):
    """A shard's slot entries no longer hash to what the manifest recorded."""


class ReadOnlyBatch(StreamgrpError):
    """`commit` or `fail` on a batch that no trainer rank is consuming (a replay, or one loaded from a file)."""


class BatchFileError(StreamgrpError):
    """A file given to `load_batch` is not a valid streamgrp batch file."""


class ArchiveError(StreamgrpError):
    """The archive directory is unusable: not an archive, another run's, locked, or damaged."""


class WeightsConflict(StreamgrpError):
    """Weights published under a version that already names another weight state (or, in Redis, under a
    version older than the latest): samples drawn from the first state would be attributed to the second."""


class RoleFailed(StreamgrpError):
    """A process the demo depends on exited with an error."""


class SessionRefused(StreamgrpError):
    """An agent session cannot do what was asked: it is unknown, ended, past its group's deadline, or
    another writer recorded a turn first. ``code`` is the gateway function's reply code (``UNKNOWN``,
    ``ENDED``, ``EXPIRED``, ``TURN``, ``TAKEN``, ...), which the gateway maps to an HTTP status."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class ServerError(StreamgrpError):
    """The Redis/Valkey server could not be started, reached, or is too old."""


class OutageBudgetExceeded(ServerError):
    """The server did not answer for longer than ``--outage-budget-s``; the process gives up."""


class StopRequested(StreamgrpError):
    """The process was asked to stop while it waited for the server; it exits quietly."""
