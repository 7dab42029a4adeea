"""A run's role users on the test's server (``ACL SETUSER`` from `streamgrp.store.acl`), for attack tests.

`RoleUsers.client(role)` connects as that role's own user, so what a test does with it is exactly what
a leaked or buggy credential of that role could do; `close` deletes the users again (the server may be
shared with other tests).
"""

from __future__ import annotations

import secrets

import pytest
import redis

from streamgrp.store.acl import access, password_hash, rules, user_name
from streamgrp.store.keys import RunKeys
from streamgrp.store.runs import recorded_layout


class RoleUsers:
    def __init__(self, admin: redis.Redis, run: str, partitions: int = 1) -> None:
        self.admin = admin
        self.run = run
        self.partitions = partitions
        self._clients: list[redis.Redis] = []
        self._users: list[str] = []

    def client(self, role: str) -> redis.Redis:
        password = secrets.token_urlsafe(12)
        name = user_name(self.run, role)
        layout = recorded_layout(self.admin, RunKeys(self.run))  # the run's own: a stream run's users are older ones
        self.admin.execute_command(
            "ACL",
            "SETUSER",
            name,
            *rules(access(RunKeys(self.run), role, self.partitions, layout), password_hashes=[password_hash(password)]),
        )
        self._users.append(name)
        kwargs = self.admin.connection_pool.connection_kwargs
        client = redis.Redis(
            host=kwargs.get("host", "127.0.0.1"),
            port=kwargs.get("port", 6379),
            db=kwargs.get("db", 0),
            username=name,
            password=password,
        )
        self._clients.append(client)
        return client

    def close(self) -> None:
        for client in self._clients:
            client.close()
        if self._users:
            self.admin.execute_command("ACL", "DELUSER", *dict.fromkeys(self._users))


@pytest.fixture
def role_users(client, run_name, redis_server):
    if redis_server.kind == "cluster":
        pytest.skip("role users are made on one server")
    users = RoleUsers(client, run_name)
    yield users
    users.close()


def refused(call) -> str:
    """Run ``call``; it must be refused for want of permission. Returns the server's words."""
    with pytest.raises(redis.exceptions.NoPermissionError) as refusal:
        call()
    return str(refusal.value)
