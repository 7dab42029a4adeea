"""The `streamgrp` command's entry point: parse, install logging, run the subcommand, map errors to exit codes.

Logging handlers are installed here and nowhere else. The parser is `streamgrp.cli.parser`; the
handlers are `streamgrp.cli.roles` (processes of a run) and `streamgrp.cli.inspection` (reading one).
Exit codes: 0 done (or stopped), 2 a `StreamgrpError` (its message says what to change), 130 Ctrl-C,
or what the handler returned.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from streamgrp.cli.parser import build_parser
from streamgrp.errors import StopRequested, StreamgrpError

__all__ = ["main"]

log = logging.getLogger("streamgrp")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = (args.log_level or os.environ.get("STREAMGRP_LOG_LEVEL") or "INFO").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.handler(args) or 0)
    except StopRequested as exc:
        log.info("%s", exc)  # shutting down while the server is away is not an error
        return 0
    except StreamgrpError as exc:
        print(f"streamgrp {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
