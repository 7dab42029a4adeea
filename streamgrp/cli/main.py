"""The `streamgrp` command's entry point: parse, install logging, run the subcommand, map errors to exit codes.

Logging handlers are installed here and nowhere else. The parser is `streamgrp.cli.parser`; the
handlers are `streamgrp.cli.roles` (processes of a run) and `streamgrp.cli.inspection` (reading one).
Exit codes: 0 done, or stopped on request: a long-running role (server, worker, assembler, batcher,
trainer, archiver, weight-sync) that SIGTERM or SIGINT stopped finishes its round, releases what it holds
and exits 0, as a service does; 2 a `StreamgrpError` (its message says what to change); 130 Ctrl-C in
any other command; the demo, a job that runs to an end, exits 130 after SIGINT and 143 after SIGTERM
once every process it started has stopped; or what the handler returned.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from streamgrp.cli.flag_env import unknown_environment
from streamgrp.cli.parser import LOG_LEVELS, build_parser
from streamgrp.core.shown import printable, printable_lines
from streamgrp.errors import StopRequested, StreamgrpError

__all__ = ["main"]

log = logging.getLogger("streamgrp")


class EscapingFormatter(logging.Formatter):
    """Log lines with every interpolated text argument made `printable`: task ids, producer names and error
    texts come from the streams, and must not move the cursor, rewrite the terminal or forge a log line.
    The format strings are streamgrp's own and keep their line breaks."""

    def format(self, record: logging.LogRecord) -> str:
        if record.args:
            record = logging.makeLogRecord(record.__dict__)  # a copy: other handlers see the record unchanged
            if isinstance(record.args, dict):
                record.args = {k: _printable_arg(v) for k, v in record.args.items()}
            else:  # the copy's args are the original's, which were not empty
                record.args = tuple(_printable_arg(a) for a in record.args or ())
        return super().format(record)


def _printable_arg(value: object) -> object:
    return printable(value) if isinstance(value, (str, bytes)) else value


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = (args.log_level or os.environ.get("STREAMGRP_LOG_LEVEL") or "INFO").upper()
    if level not in LOG_LEVELS:
        parser.error(f"STREAMGRP_LOG_LEVEL={level!r}: choose from {', '.join(LOG_LEVELS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(EscapingFormatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])
    for message in unknown_environment([parser, *parser.subcommands.values()], os.environ):
        log.warning("%s", message)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.handler(args) or 0)
    except StopRequested as exc:
        log.info("%s", exc)  # shutting down while the server is away is not an error
        return 0
    except StreamgrpError as exc:
        print(f"streamgrp {args.command}: {printable_lines(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
