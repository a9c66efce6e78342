"""The ports tests start their servers on (tests/fixtures/ports.py): free, distinct, and below
the kernel's ephemeral range, where no outgoing connection can take one first."""

from __future__ import annotations

import socket

from tests.fixtures import ports


def test_ports_are_free_distinct_and_below_the_ephemeral_range() -> None:
    handed = [ports.free_port() for _ in range(50)]
    assert len(set(handed)) == len(handed)
    top = ports._ephemeral_start()
    assert all(ports.LOWEST <= port < top for port in handed)
    with socket.socket() as server:  # each is free: a server can listen on it
        server.bind(("127.0.0.1", handed[-1]))
        server.listen()


def test_each_test_worker_takes_ports_of_its_own_residue(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    for index in range(3):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{index}")
        handed = [ports.free_port() for _ in range(20)]
        assert all(port % 3 == index and port >= ports.LOWEST for port in handed)
