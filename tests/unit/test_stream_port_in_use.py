"""A stream server on a port in use is an error naming it, raised in process before anything listens."""

import socket

import pytest

import paramserver as ps
from paramserver.transport import stream_server


def test_a_stream_server_on_a_port_in_use_is_an_error():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        with pytest.raises(ps.UnavailableError, match="cannot listen"):
            stream_server.StreamServer(None, "127.0.0.1", taken.getsockname()[1], 1 << 20)
