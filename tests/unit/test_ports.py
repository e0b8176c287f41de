"""The port picker for nodes told their port before they bind it (launch/local/ports.py): below the
ephemeral range, which outgoing connections take ports from, and free on 127.0.0.1 and every interface."""

import socket

import pytest

from paramserver.launch.local import ports


def test_a_picked_port_is_below_the_ephemeral_range_and_binds_on_loopback_and_every_interface():
    low, _ = ports.ephemeral_range()
    for _ in range(50):
        port = ports.free_port()
        assert ports.LOWEST <= port < low
        for host in ("127.0.0.1", "0.0.0.0"):
            with socket.socket() as sock:
                sock.bind((host, port))  # the port is free: this raises if it is not


def test_picks_in_one_process_are_all_different():
    picked = [ports.free_port() for _ in range(200)]
    assert len(set(picked)) == len(picked)


def test_a_port_held_by_a_listener_is_never_picked(monkeypatch):
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        taken = held.getsockname()[1]
        assert not ports.binds(taken)
        monkeypatch.setattr(ports.random, "choice", lambda choices: taken)  # every try draws the held port
        with pytest.raises(OSError, match="no free TCP port"):
            ports.free_port()


@pytest.mark.parametrize(
    "text, expected",
    [
        ("32768\t60999\n", range(20000, 32768)),
        ("40000 60999", range(20000, 40000)),
        ("20500 50000", range(50001, 65536)),  # too few below: above the range
        ("10000 65000", range(20000, 65536)),  # no room on either side: no port avoids the race
        ("not numbers", range(20000, 32768)),  # unreadable: Linux's default range
    ],
)
def test_the_candidates_avoid_the_ephemeral_range_the_kernel_reports(tmp_path, text, expected):
    path = tmp_path / "ip_local_port_range"
    path.write_text(text)
    assert ports.candidate_ports(path) == expected
    low, high = ports.ephemeral_range(path)
    port = ports.free_port(path)
    assert port in expected
    if expected != range(20000, 65536):
        assert not low <= port <= high


def test_a_missing_range_file_means_linux_default_range(tmp_path):
    assert ports.ephemeral_range(tmp_path / "absent") == ports.FALLBACK_EPHEMERAL
    assert ports.candidate_ports(tmp_path / "absent") == range(20000, 32768)
