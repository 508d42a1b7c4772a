"""Fixtures for the SIP tests: speech files for sipp to play, servers closed after each test."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from duplex.transports.sip import SipConfig, SipServer, SipTimers

from .peers import Acceptor


@pytest.fixture(scope="module")
def speech_dir(tmp_path_factory) -> Path:
    """A cwd for sipp holding speech.ulaw and speech.alaw (espeak-ng + sox, about 1.5 s)."""
    missing = [tool for tool in ("espeak-ng", "sox", "sipp") if shutil.which(tool) is None]
    assert not missing, f"{missing} missing: `make install-test` installs them"
    folder = tmp_path_factory.mktemp("sipp")
    wav = folder / "raw.wav"
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "170", "-w", str(wav), "hello agent"],
                   check=True)
    for name, kind in (("speech.ulaw", "ul"), ("speech.alaw", "al")):
        subprocess.run(["sox", str(wav), "-r", "8000", "-c", "1", "-t", kind,
                        str(folder / name)], check=True)
    return folder


@pytest.fixture
async def make_server():
    """``await make_server(acceptor, **SipConfig fields)``: a started server on a free port."""
    servers: list[SipServer] = []

    async def make(acceptor: Acceptor | None = None, **options) -> tuple[SipServer, Acceptor]:
        acceptor = acceptor or Acceptor()
        options.setdefault("port", 0)
        options.setdefault("rtp_ports", (42000 + 200 * len(servers), 42199 + 200 * len(servers)))
        options.setdefault("timers", SipTimers())
        server = SipServer(acceptor, SipConfig(**options))
        await server.start()
        servers.append(server)
        return server, acceptor

    yield make
    for server in servers:
        await server.close()
