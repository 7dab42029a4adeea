"""The gateway under its own least-privilege ACL user (``ops/acl/gateway.acl``): everything it does works
(opening sessions, turns, ends, a reward posted later, timing sessions out), the server refuses it nothing,
and it may not touch what is not its business (control, decisions, steps, the version, the server)."""

from __future__ import annotations

import secrets
from pathlib import Path

import openai
import pytest
from gateway_fakes import Running
from gateway_fakes import start as start_fake
from processes import wait_until

from streamgrp.cli.server import EmbeddedServer
from streamgrp.config import RunConfig
from streamgrp.core.events import SessionEnded
from streamgrp.store import payloads
from streamgrp.store.acl import password_hash, template_for, user_name
from streamgrp.store.connection import connect
from streamgrp.store.keys import RunKeys
from streamgrp.store.runs import join_run
from streamgrp.store.scripts import load_library
from streamgrp.store.sessions import SessionStore
from streamgrp.store.tasks import TaskIssuer

OPS_ACL = Path(__file__).resolve().parents[2] / "ops" / "acl"


@pytest.mark.one_server_kind
def test_the_gateway_works_under_its_own_acl_user_and_may_do_nothing_else(kind_binary, tmp_path, run_name):
    admin_password, gateway_password = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
    rule = template_for((OPS_ACL / "gateway.acl").read_text(), run_name).strip()
    users = tmp_path / "users.acl"
    gateway_rule = rule.replace(" resetpass ", f" resetpass {password_hash(gateway_password)} ", 1)
    users.write_text(
        "\n".join(
            [
                (OPS_ACL / "default.acl").read_text().strip(),
                f"user admin on {password_hash(admin_password)} ~* &* +@all",
                gateway_rule,
            ]
        )
        + "\n"
    )
    server = EmbeddedServer(tmp_path / "server", binary=kind_binary, acl_file=users)
    server.start()
    fake, fake_server = start_fake()
    admin = connect(f"redis://admin@127.0.0.1:{server.port}/0", password=admin_password)
    try:
        load_library(admin)  # the administrator's step: roles call functions, never load them
        run = join_run(admin, run_name, RunConfig(n_samples=2, group_timeout_s=4.0))
        TaskIssuer(admin, run.keys).issue([{"q": 1}, {"q": 2}])
        client = connect(
            f"redis://{user_name(run_name, 'gateway')}@127.0.0.1:{server.port}/0", password=gateway_password
        )
        gateway = Running(client, run, fake)
        try:
            done, later = gateway.open()["sessions"]
            for session in (done, later):
                with openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"]) as chat:
                    chat.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}])
            # A restarted gateway reads a session's turns back, in a keys-layout run from their turn keys.
            assert len(SessionStore(client, run.partitions, producer="x").load(done["session_id"]).turns) == 1
            gateway.end(done["session_id"], reward=1.0)
            gateway.end(later["session_id"], reward_pending=True)
            assert gateway.control(f"/sessions/{later['session_id']}/reward", {"reward": 0.5}).status_code == 200
            gateway.open()  # the second task's sessions: left to time out
            wait_until(
                lambda: len(gateway.events(SessionEnded)) == 4,
                timeout=20,
                message="the second task's sessions to time out",
            )
        finally:
            gateway.close()
        assert admin.execute_command("ACL", "LOG") == [], "the gateway was refused a command its rules should allow"
        keys = RunKeys(run_name)
        user = user_name(run_name, "gateway")

        def allowed(*command: str) -> bool:
            return admin.execute_command("ACL", "DRYRUN", user, *command) in (b"OK", "OK")

        assert allowed("XADD", keys.sessions, "*", "h", "x") and allowed(
            "HSET", keys.session("p0-0123456789abcdef"), "a", "b"
        )
        # A turn's tensors: SET only of a staging key of the sessions stream, RENAME only from one to a turn key.
        staged, turn = payloads.staged_key(keys.sessions), payloads.turn_key(keys.sessions, "1-0")
        assert allowed("SET", staged, "x", "NX", "PX", "1000") and allowed("RENAME", staged, turn)
        assert allowed("PERSIST", turn) and allowed("MGET", turn)
        for command in (
            ("XADD", keys.control, "*", "h", "x"),
            ("XADD", keys.decisions, "*", "h", "x"),
            ("XADD", keys.steps, "*", "h", "x"),
            ("SET", keys.version, "9"),
            ("SET", payloads.turn_key(keys.sessions, "1-0"), "x"),
            ("SET", keys.session_deadlines, "x"),
            ("RENAME", payloads.staged_key(keys.sessions), payloads.key(keys.payloads, "1-0")),
            ("RENAME", payloads.staged_key(keys.payloads), payloads.turn_key(keys.sessions, "1-0")),
            ("PERSIST", payloads.staged_key(keys.sessions)),
            ("UNLINK", payloads.turn_key(keys.sessions, "1-0")),
            ("DEL", payloads.turn_key(keys.sessions, "1-0")),
            ("HSET", keys.counts, "a", "1"),
            ("XADD", "sg:{other-run}:sessions", "*", "h", "x"),
            ("CONFIG", "GET", "*"),
            ("FLUSHALL",),
            ("EVAL", "return 1", "0"),
            ("KEYS", "*"),
        ):
            assert not allowed(*command), command
    finally:
        admin.close()
        fake_server.shutdown()
        fake_server.server_close()
        server.stop()
