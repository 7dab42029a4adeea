"""Which inference server gets the next request: round-robin or least-loaded over several URLs.

Owns the in-flight count per server (requests sent and not yet answered, from this worker process)
and a short cool-down for a server whose last request failed in transport, so a dead server among
live ones stops taking every other request. It does not probe servers: the next request is the probe.
Thread-safe: a worker runs sync rollouts on a thread pool.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal

Choice = Literal["round_robin", "least_loaded"]


class ServerPool:
    """Hands out one server URL per request (`lease`) and learns from how each request went."""

    def __init__(
        self,
        urls: list[str],
        choice: Choice = "round_robin",
        *,
        cooldown_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not urls:
            raise ValueError("no inference server URL; give --server-url (several: comma-separated)")
        self.urls = [url.rstrip("/") for url in urls]
        self.choice = choice
        self.cooldown_s = cooldown_s
        self.clock = clock
        self.in_flight = dict.fromkeys(self.urls, 0)
        self._failed_at: dict[str, float] = {}
        self._next = 0
        self._lock = threading.Lock()

    @contextmanager
    def lease(self, *, avoid: str | None = None) -> Iterator[str]:
        """A server for one request; ``avoid`` (the one that just failed) is skipped when another is usable."""
        url = self._pick(avoid)
        try:
            yield url
        finally:
            with self._lock:
                self.in_flight[url] -= 1

    def failed(self, url: str) -> None:
        with self._lock:
            self._failed_at[url] = self.clock()

    def succeeded(self, url: str) -> None:
        with self._lock:
            self._failed_at.pop(url, None)

    def _pick(self, avoid: str | None) -> str:
        with self._lock:
            now = self.clock()
            healthy = [u for u in self.urls if now - self._failed_at.get(u, -1e18) >= self.cooldown_s and u != avoid]
            candidates = healthy or [u for u in self.urls if u != avoid] or self.urls
            if self.choice == "least_loaded":
                # Ties go round-robin, so equal servers share the load instead of the first taking all.
                start = self._next
                order = sorted(
                    candidates, key=lambda u: (self.in_flight[u], (self.urls.index(u) - start) % len(self.urls))
                )
                url = order[0]
            else:
                url = next(
                    (
                        u
                        for i in range(len(self.urls))
                        if (u := self.urls[(self._next + i) % len(self.urls)]) in candidates
                    ),
                    candidates[0],
                )
            self._next = (self.urls.index(url) + 1) % len(self.urls)
            self.in_flight[url] += 1
            return url
