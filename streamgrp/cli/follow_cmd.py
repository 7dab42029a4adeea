"""`streamgrp follow NAME`: a named consumer of one run's stream on the command line (`streamgrp.store.follower`).

Prints each entry as a JSON line (or calls ``--follow-handler module:function`` with it), recording its
position as it goes, so a follower stopped or killed resumes where it stopped; ``--list-followers`` shows
every follower of the run, ``--forget`` removes one. `export --follow` is the other shipped follower
(`streamgrp.replay.export_follow`).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import orjson

from streamgrp.cli.context import connected, serve_metrics, settings, stop_event
from streamgrp.config import FollowConfig, load_callable
from streamgrp.errors import ConfigError


def add_follow_command(commands: Any, add_model_flags: Any, connection_model: type) -> None:
    follow = commands.add_parser(
        "follow",
        help="read one run's decisions, slot results or steps as a named "
        "consumer with a durable position, beside training (see docs/guides/follow.md)",
    )
    follow.add_argument(
        "name",
        metavar="NAME",
        nargs="?",
        default=None,
        help="the follower's name: its position is recorded under it (1-64 letters, digits, . _ -)",
    )
    add_model_flags(follow, connection_model, "connection")
    add_model_flags(follow, FollowConfig, "follow")
    follow.set_defaults(handler=cmd_follow)


def as_json(item: Any) -> bytes:
    """A `Followed` or `Skipped` item as one JSON object."""
    from streamgrp.core.wire import jsonable
    from streamgrp.store.follower import Skipped

    if isinstance(item, Skipped):
        return orjson.dumps(
            {"stream": item.stream, "skipped": {"after": item.after, "before": item.before, "count": item.count}}
        )
    event = jsonable(item.event) if item.event is not None else None
    return orjson.dumps({"stream": item.stream, "entry_id": item.entry_id, "event": event, "error": item.error})


def _print(item: Any) -> None:
    sys.stdout.buffer.write(as_json(item) + b"\n")
    sys.stdout.flush()  # before the position is recorded: what was recorded was written out


def cmd_follow(args: argparse.Namespace) -> int:
    from streamgrp.store.follow import FollowPositions, positions, unread_age
    from streamgrp.store.follower import FOLLOWABLE, Follower
    from streamgrp.store.runs import await_run, resolve_run_name, server_time

    stop = stop_event()
    config = settings(args, FollowConfig)
    handle = load_callable(config.follow_handler) if config.follow_handler else _print
    with connected(args, role=True) as (client, connection, _):
        # A follower may start before the run: it waits for the batcher to create it (--list-followers does not).
        run = await_run(
            client,
            resolve_run_name(client, connection.run, create=False),
            stop=stop,
            wait=not (config.list_followers or config.forget),
            who=f"follower {args.name}",
        )
        if config.list_followers:
            now = server_time(client)
            for p in positions(client, run.keys):
                lag = unread_age(client, p.stream.partition("@")[0], run.stream_key(p.stream), p.position, now)
                print(
                    f"{p.name:<20} {p.stream:<12} position {p.position:<24} lag {lag:8.1f}s  skipped {p.skipped}"
                    + (f" (last: after {p.skip.after} before {p.skip.before})" if p.skip else "")
                )
            return 0
        if args.name is None:
            raise ConfigError("streamgrp follow needs the follower's NAME (or --list-followers)")
        if config.forget:
            mine = FollowPositions(client, run.keys, args.name)
            for stream in run.streams():
                if stream.partition("@")[0] in FOLLOWABLE:
                    mine.forget(stream)
            print(f"follower {args.name} forgotten in run {run.name}", file=sys.stderr)
            return 0
        metrics = serve_metrics(config, role="follower", run=run.name)
        follower = Follower(client, run, args.name, config.follow_stream, start=config.follow_start, metrics=metrics)
        try:
            for item in follower.entries(stop, until_finished=config.until_finished):
                handle(item)
        except BrokenPipeError:  # `streamgrp follow NAME | head`: the reader left; the unprinted item stays unrecorded
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
    return 0
