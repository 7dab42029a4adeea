"""The one exception tree of streamgrp.

    StreamgrpError
    ├── ConfigError (also ValueError)       a setting is invalid or disagrees with the run's record
    ├── DecodeError (also ValueError)       an entry's bytes do not decode or validate; carries .reason
    ├── ContractViolation                   a slot broke the one-sample-per-slot contract (terminal)
    ├── RunFailed                           the run reached a terminal event (stall bound, contract)
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


class ContractViolation(StreamgrpError):
    """A usable slot carried more than one row while group statistics treat rows as members."""


class RunFailed(StreamgrpError):
    """The run has a terminal event; every trainer rank raises this with the same message."""


class ServerError(StreamgrpError):
    """The Redis/Valkey server could not be started, reached, or is too old."""


class OutageBudgetExceeded(ServerError):
    """The server did not answer for longer than ``--outage-budget-s``; the process gives up."""


class StopRequested(StreamgrpError):
    """The process was asked to stop while it waited for the server; it exits quietly."""
