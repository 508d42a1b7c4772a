"""Test peers for the SIP stack: a recording call handler, an RTP sink/source, sipp, a raw UAC.

Everything here belongs to one test and is closed by it (or by the fixtures in conftest.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from duplex.transports.sip import CallControl, CallRefused, SipCallInfo
from duplex.transports.sip.message import SipMessage, parse
from duplex.transports.sip.rtp import RtpPacket

SCENARIOS = Path(__file__).parent / "scenarios"
TIMEOUT = 15.0  # the longest any single wait in these tests may take


def tone(seconds_offset: int, samples: int = 160, freq: float = 440.0) -> np.ndarray:
    t = (np.arange(samples) + seconds_offset) / 8000
    return (8000 * np.sin(2 * np.pi * freq * t)).astype(np.int16)


class ToneMedia:
    """A CallMedia that records what it is told and answers with a 440 Hz tone."""

    def __init__(self, info: SipCallInfo, control: CallControl) -> None:
        self.info, self.control = info, control
        self.audio: list[np.ndarray] = []
        self.digits: list[str] = []
        self.holds: list[bool] = []
        self.ended: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.speaking = True
        self._sent = 0
        self.events: asyncio.Queue[str] = asyncio.Queue()  # "dtmf:1", "hold:True", ...

    def on_audio(self, pcm: np.ndarray, arrival: float) -> None:
        assert pcm.dtype == np.int16
        self.audio.append(pcm)

    def on_dtmf(self, digit: str) -> None:
        self.digits.append(digit)
        self.events.put_nowait(f"dtmf:{digit}")

    def on_hold(self, held: bool) -> None:
        self.holds.append(held)
        self.events.put_nowait(f"hold:{held}")

    def next_frame(self) -> np.ndarray | None:
        if not self.speaking:
            return None
        self._sent += 160
        return tone(self._sent)

    def on_ended(self, reason: str) -> None:
        assert not self.ended.done(), "on_ended called twice"
        self.ended.set_result(reason)

    def inbound(self) -> np.ndarray:
        return np.concatenate(self.audio) if self.audio else np.zeros(0, np.int16)


@dataclass
class Acceptor:
    """The server's accept(): ToneMedia for up to ``capacity`` live calls, then 503."""

    capacity: int = 8
    gate: asyncio.Event | None = None  # when set, accept waits for it (a slow acceptor)
    calls: list[ToneMedia] = field(default_factory=list)
    offered: asyncio.Queue = field(default_factory=asyncio.Queue)
    accepted: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: int = 0  # decisions the stack cancelled (the caller's CANCEL)

    async def __call__(self, info: SipCallInfo, control: CallControl) -> ToneMedia:
        self.offered.put_nowait(info)
        if self.gate is not None:
            try:
                await self.gate.wait()
            except asyncio.CancelledError:  # the call ended before we decided
                self.cancelled += 1
                raise
        live = [c for c in self.calls if not c.ended.done()]
        if len(live) >= self.capacity:
            raise CallRefused(503, "Too Many Sessions", retry_after=7)
        media = ToneMedia(info, control)
        self.calls.append(media)
        self.accepted.put_nowait(media)
        return media

    async def next_call(self) -> ToneMedia:
        return await asyncio.wait_for(self.accepted.get(), TIMEOUT)


class UdpPeer(asyncio.DatagramProtocol):
    """A loopback UDP socket that queues what it receives (RTP sink / raw SIP client)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[tuple[bytes, float, tuple]] = asyncio.Queue()
        self.transport: asyncio.DatagramTransport | None = None

    @classmethod
    async def open(cls, port: int = 0) -> UdpPeer:
        loop = asyncio.get_running_loop()
        _, peer = await loop.create_datagram_endpoint(cls, local_addr=("127.0.0.1", port))
        return peer

    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        self.queue.put_nowait((data, asyncio.get_running_loop().time(), addr))

    @property
    def port(self) -> int:
        assert self.transport is not None
        return self.transport.get_extra_info("sockname")[1]

    def send(self, data: bytes, addr: tuple[str, int]) -> None:
        assert self.transport is not None
        self.transport.sendto(data, addr)

    async def recv(self, timeout: float = TIMEOUT) -> bytes:
        data, _, _ = await asyncio.wait_for(self.queue.get(), timeout)
        return data

    def drain(self) -> list[tuple[bytes, float]]:
        out = []
        while not self.queue.empty():
            data, at, _ = self.queue.get_nowait()
            out.append((data, at))
        return out

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class RawUac(UdpPeer):
    """A hand-driven SIP caller for what sipp cannot do deterministically."""

    server: tuple[str, int] = ("127.0.0.1", 5060)

    def request(self, method: str, *, call_id: str | None = None, cseq: int = 1,
                branch: str | None = None, to_tag: str | None = None, body: str = "",
                headers: tuple[str, ...] = (), from_tag: str = "uac",
                content_type: str = "application/sdp") -> str:
        """Send a request; returns its raw text (the Call-ID is in ``self.call_id``)."""
        self.call_id = call_id or secrets.token_hex(8)
        self.branch = branch or f"z9hG4bK{secrets.token_hex(6)}"
        to = "<sip:agent@127.0.0.1>" + (f";tag={to_tag}" if to_tag else "")
        lines = [
            f"{method} sip:agent@127.0.0.1:{self.server[1]} SIP/2.0",
            f"Via: SIP/2.0/UDP 127.0.0.1:{self.port};branch={self.branch}",
            "Max-Forwards: 70",
            f"From: <sip:uac@127.0.0.1>;tag={from_tag}",
            f"To: {to}",
            f"Call-ID: {self.call_id}",
            f"CSeq: {cseq} {method}",
            f"Contact: <sip:uac@127.0.0.1:{self.port}>",
            *headers,
        ]
        if body:
            lines.append(f"Content-Type: {content_type}")
        lines.append(f"Content-Length: {len(body.encode())}")
        text = "\r\n".join(lines) + "\r\n\r\n" + body
        self.send(text.encode(), self.server)
        return text

    async def response(self, status: int | None = None, timeout: float = TIMEOUT) -> SipMessage:
        """The next SIP message received (skipping provisional ones unless asked for)."""
        async with asyncio.timeout(timeout):
            while True:
                msg = parse(await self.recv())
                if status is None or msg.status == status or msg.method:
                    return msg


async def wait_until(condition, timeout: float = TIMEOUT) -> None:
    """Until ``condition()`` holds (checked every 10 ms), or TimeoutError."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


def sdp_offer(port: int, formats: str = "0 101", extra: str = "") -> str:
    lines = ["v=0", "o=uac 1 1 IN IP4 127.0.0.1", "s=-", "c=IN IP4 127.0.0.1", "t=0 0",
             f"m=audio {port} RTP/AVP {formats}", "a=rtpmap:101 telephone-event/8000"]
    return "\r\n".join(lines) + "\r\n" + extra


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_is_free(port: int) -> bool:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_DGRAM)) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


async def sipp(scenario: str | Path, server_port: int, cwd: Path, *keys: tuple[str, str],
               calls: int = 1, options: tuple[str, ...] = ()) -> tuple[int, str]:
    """Run sipp as the caller; returns (exit status, its output). ``scenario``: a file of
    scenarios/ or a path; ``options``: more of sipp's options (``-cid_str``, ...)."""
    args = ["sipp", f"127.0.0.1:{server_port}", "-sf", str(SCENARIOS / scenario), *options,
            "-i", "127.0.0.1", "-mi", "127.0.0.1", "-p", str(free_port()),
            "-mp", str(free_port()), "-m", str(calls), "-l", str(calls), "-nostdin",
            "-timeout", "20s", "-timeout_error", "-trace_err", "-error_file",
            str(cwd / f"{Path(scenario).name}.errors.log")]
    for key, value in keys:
        args += ["-key", key, value]
    proc = await asyncio.create_subprocess_exec(
        *args, cwd=cwd, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, env={**os.environ, "TERM": "dumb"})
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 30)
    except BaseException:  # timed out, or the test gave up on it: no sipp outlives its test
        proc.kill()
        await proc.wait()
        raise
    errors = cwd / f"{Path(scenario).name}.errors.log"
    text = out.decode(errors="replace")[-3000:]
    if errors.exists():
        text += errors.read_text(errors="replace")[-3000:]
    return proc.returncode or 0, text


def rtp_packets(datagrams: list[tuple[bytes, float]]) -> list[tuple[RtpPacket, float]]:
    out = []
    for data, at in datagrams:
        packet = RtpPacket.parse(data)
        if packet is not None:
            out.append((packet, at))
    return out


def rms(pcm: np.ndarray) -> float:
    return float(np.sqrt(np.mean(pcm.astype(np.float64) ** 2))) if len(pcm) else 0.0


def telephone_event(event: int, end: bool, duration: int) -> bytes:
    return struct.pack("!BBH", event, (0x80 if end else 0) | 10, duration)
