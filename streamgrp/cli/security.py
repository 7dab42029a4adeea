"""``streamgrp acl``: the ACL users of one or more runs, one per role, ready for a server's ACL file;
``streamgrp functions``: load the function library the roles call (an administrator's step, once per server).

Owns printing them (`streamgrp.store.acl` builds the rules) and, with ``--password-dir``, keeping
one password per user in a file of its own (``0600``, made once with `secrets`, reused after), so
that the ACL file holds only hashes and each role's process reads its own password with
``--password-file``. ACL files take no comments, so the notes go to stderr and stdout stays a
file the server can load.
"""

from __future__ import annotations

import argparse
import secrets
import sys
from pathlib import Path

from streamgrp.errors import ConfigError
from streamgrp.store.acl import ROLES, render_run, user_name
from streamgrp.store.keys import check_run_name
from streamgrp.store.private import open_private, private_dir

__all__ = ["add_acl_command", "cmd_acl", "cmd_functions"]


def add_acl_command(commands) -> None:
    acl = commands.add_parser("acl", help="print each role's ACL user for runs (least privilege, one run's keys)")
    acl.add_argument("runs", nargs="+", metavar="RUN", help="the runs to print users for")
    acl.add_argument(
        "--role",
        action="append",
        choices=ROLES,
        default=None,
        help="only this role (repeat for several) [default: every role]",
    )
    acl.add_argument(
        "--password-dir",
        default=None,
        metavar="DIR",
        help="keep one password per user in DIR/USER (made if missing, 0600) and put its hash in the rules",
    )
    acl.add_argument(
        "--partitions",
        type=int,
        default=1,
        metavar="P",
        help="the runs' partitions, as recorded (the batcher's --partitions): every role gets its rights in "
        "each partition's keys too",
    )
    acl.add_argument(
        "--payload-layout",
        choices=("keys", "stream"),
        default="keys",
        help="where the runs keep payloads, as recorded: keys (runs this version creates) or stream (runs "
        "an older version created) [default: keys]",
    )
    acl.add_argument(
        "--no-default",
        action="store_true",
        help="leave out 'user default off' (when appending to an ACL file that already has a default user)",
    )
    acl.set_defaults(handler=cmd_acl)

    from streamgrp.cli.parser import add_connection_flags

    functions = commands.add_parser(
        "functions",
        help="load streamgrp's function library on the server (on a cluster: "
        "every primary); run once as an administrator when roles connect as ACL users",
    )
    add_connection_flags(functions)
    functions.set_defaults(handler=cmd_functions)


def cmd_functions(args: argparse.Namespace) -> int:
    from streamgrp.cli.context import connected
    from streamgrp.store.scripts import load_library

    with connected(args) as (client, _connection, _handle):
        name = load_library(client)
    print(
        f"streamgrp functions: the server holds the function library {name}; every role calls it with FCALL",
        file=sys.stderr,
    )
    return 0


def cmd_acl(args: argparse.Namespace) -> int:
    roles = args.role or list(ROLES)
    lines = [] if args.no_default else ["user default off"]
    for run in args.runs:
        check_run_name(run)
        passwords = _passwords(Path(args.password_dir), run, roles) if args.password_dir else None
        try:
            lines += render_run(run, roles, passwords=passwords, partitions=args.partitions, layout=args.payload_layout)
        except ValueError as exc:  # a partition count out of range
            raise ConfigError(str(exc)) from None
    print("\n".join(lines))
    where = (
        f"their passwords are in {args.password_dir}"
        if args.password_dir
        else "they have no password yet: add one with ACL SETUSER USER >PASSWORD, or run again with --password-dir DIR"
    )
    print(
        f"streamgrp acl: {len(lines)} ACL lines for {', '.join(args.runs)}; load them with streamgrp server "
        f"--acl-file FILE (or ACL LOAD); {where}. Each role connects as its user: "
        "rediss://USER@HOST:PORT/0 with --password-file DIR/USER",
        file=sys.stderr,
    )
    return 0


def _passwords(directory: Path, run: str, roles: list[str]) -> dict[str, str]:
    """Each role's password, from DIR/USER, made (random, 0600) when the file does not exist yet."""
    private_dir(directory)
    out = {}
    for role in roles:
        path = directory / user_name(run, role)
        if not path.exists():
            with open_private(path, "xb") as handle:
                handle.write(secrets.token_urlsafe(32).encode() + b"\n")
        text = path.read_text().splitlines()
        if not text or not text[0].strip():
            raise ConfigError(f"{path} is empty; delete it to make a new password, or write one on its first line")
        out[role] = text[0].strip()
    return out
