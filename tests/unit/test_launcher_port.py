"""``sokuji serve --ray``'s port probe (``scale/launcher.py`` ``_check_port``): a port whose
only sockets are in TIME_WAIT (a server that just stopped) reads free, as it does for the
listener that will bind it; a port something listens on is refused."""

from __future__ import annotations

import socket

import pytest

from sokuji.errors import ConfigError
from sokuji.scale.launcher import _check_port


def _time_wait_port() -> int:
    """A loopback port left with a TIME_WAIT socket and nothing listening: a connection the
    server side closed first (as a stopping server does), then the listener closed."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = int(listener.getsockname()[1])
    client = socket.create_connection(("127.0.0.1", port))
    served, _ = listener.accept()
    served.close()  # the server's side closes first: its end goes to TIME_WAIT
    assert client.recv(1) == b""
    client.close()
    listener.close()
    return port


def test_a_port_with_only_time_wait_sockets_reads_free() -> None:
    port = _time_wait_port()
    with socket.socket() as s, pytest.raises(OSError, match="in use"):
        s.bind(("127.0.0.1", port))  # the probe before the fix: "Address already in use"
    _check_port("127.0.0.1", port)


def test_a_listening_port_is_refused() -> None:
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = int(listener.getsockname()[1])
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
            _check_port("127.0.0.1", port)
