"""What a client sends the server, as MONITOR shows it: the commands naming one run's keys (the server may be
shared with other tests) up to a function call."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def commands_until_fcall(client, marker: bytes) -> Iterator[list[bytes]]:
    """The commands naming ``marker`` that the body of the ``with`` sends, up to and including its first FCALL;
    the list is complete once the block has ended."""
    seen: list[bytes] = []
    ready = threading.Event()

    def watch() -> None:
        with client.monitor() as monitor:
            ready.set()
            for command in monitor.listen():
                text = command["command"]
                text = text.encode() if isinstance(text, str) else text
                if marker in text:
                    seen.append(text)
                    if text.upper().startswith(b"FCALL "):
                        return

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    assert ready.wait(5)
    time.sleep(0.1)  # MONITOR is on before the body's first command
    yield seen
    thread.join(10)
