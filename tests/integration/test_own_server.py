"""The ``own_server`` marker (tests/conftest.py): a test marked so gets a server of its own kind to itself, so
what it does to the server (flushing the function library) cannot reach tests running beside it; an unmarked
test gets the session's shared server."""

from __future__ import annotations

import pytest


@pytest.mark.own_server
def test_a_marked_test_gets_a_server_of_its_own_kind(redis_url, redis_server, client):
    assert redis_url != redis_server.url
    assert client.connection_pool.connection_kwargs["port"] != int(redis_server.url.rsplit(":", 1)[1].split("/")[0])
    assert client.ping()


def test_an_unmarked_test_gets_the_shared_server(redis_url, redis_server):
    assert redis_url == redis_server.url
