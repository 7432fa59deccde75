"""Ports for servers that bind late (a simulated worker binds once its
device has loaded): from below the kernel's range for outgoing connections,
which any process's next connection can take in the meantime."""

from __future__ import annotations

import socket
from pathlib import Path

from controlplane import launcher


def test_a_late_binding_server_is_given_ports_below_the_outgoing_range_all_free() -> None:
    low = launcher._ephemeral_low()
    for _ in range(20):
        first = launcher.free_port(25, below_ephemeral=True)
        assert launcher.BELOW_EPHEMERAL_FROM <= first and first + 25 <= low
        for port in range(first, first + 25):
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))  # free now, every one of them


def test_outgoing_connections_take_their_ports_from_the_range_the_kernel_names(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as client:
        assert client.getsockname()[1] >= launcher._ephemeral_low()
    (tmp_path / "range").write_text("40000\t60999\n")
    assert launcher._ephemeral_low(tmp_path / "range") == 40000
    assert launcher._ephemeral_low(tmp_path / "missing") == 32768
