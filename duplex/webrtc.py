"""The aiortc peer of one WebRTC call: SDP checks, ICE policy, inbound audio, events channel.

:class:`CallPeer` answers one client's offer (``POST /v1/realtime/calls``) and then carries the
call's media and events:

- inbound: the client's audio track, decoded by aiortc (Opus: 48 kHz stereo s16), resampled with
  PyAV to 16 kHz mono float32 (the VAD's and the model's rate) and handed to the listener with
  its arrival time on the monotonic clock (the decoded frame, after aiortc's jitter buffer);
- outbound: an :class:`~duplex.outbound.OutboundAudioTrack` (``peer.outbound``), paced 20 ms
  frames the session fills, pauses and flushes;
- the ``oai-events`` data channel the client opens: JSON events in and out; events sent before
  the channel is open are held and sent once it opens.

The peer owns its ``RTCPeerConnection``, its inbound resampler, reader task and outbound track for
the length of the call; :meth:`CallPeer.close` (hang-up, session end) or an ICE/DTLS failure
releases all of it, and the listener hears ``on_closed`` exactly once.

ICE (:class:`IcePolicy`): only the configured ICE servers, never aiortc's implicit public STUN
server; optionally host candidates restricted to given addresses (``--ice-host``), which is also
how a peer can use 127.0.0.1, which aioice leaves out of its host candidates.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import aioice
import numpy as np
from aiortc import (
    RTCConfiguration,
    RTCDataChannel,
    RTCIceGatherer,
    RTCIceServer,
    RTCPeerConnection,
    RTCRtpSender,
    RTCSessionDescription,
)
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from aiortc.rtcicetransport import parse_stun_turn_uri
from aiortc.sdp import SessionDescription

from duplex.audio import FrameResampler
from duplex.outbound import OutboundAudioTrack, Playout

EVENTS_CHANNEL = "oai-events"
INBOUND_RATE = 16000
# Events the session sends before the client's channel opens (session.created, ...) wait here.
# A client that never opens the channel is ended by the session's own timeouts; this bound only
# keeps it from holding memory meanwhile.
MAX_PENDING_EVENTS = 256
# What aiortc can decode: opus, G722, PCMU, PCMA.
_AUDIO_CODECS = {c.mimeType.split("/")[1].lower()
                 for c in RTCRtpSender.getCapabilities("audio").codecs}

logger = logging.getLogger(__name__)


class SdpError(ValueError):
    """An offer this server cannot answer; the message says why (the HTTP layer answers 400)."""


def validate_offer(sdp: str) -> None:
    """Check an SDP offer before aiortc sees it, so that bad input gets a clear error.

    aiortc's parser accepts almost anything and its failures are assertion errors; this requires
    what answering needs: an audio section the client sends on, in a codec aiortc decodes, with
    ICE credentials and a DTLS fingerprint.
    """
    if not sdp.lstrip().startswith("v=0"):
        raise SdpError("not an SDP offer: it must start with 'v=0'")
    try:
        description = SessionDescription.parse(sdp)
    except Exception as exc:  # the parser asserts, indexes and converts without checking
        raise SdpError(f"malformed SDP: {exc!r}") from exc
    audio = [m for m in description.media if m.kind == "audio"]
    if not audio:
        raise SdpError("the offer has no audio section (m=audio)")
    media = audio[0]
    if media.direction not in (None, "sendrecv", "sendonly"):
        raise SdpError(f"the offer's audio is {media.direction}: the client must send audio")
    codecs = {codec.name.lower() for codec in media.rtp.codecs}
    if not codecs & _AUDIO_CODECS:
        raise SdpError(f"no supported audio codec offered (have {sorted(codecs)}, "
                       f"need one of {sorted(_AUDIO_CODECS)})")
    if not (media.ice.usernameFragment and media.ice.password):
        raise SdpError("the offer's audio has no ICE credentials (a=ice-ufrag / a=ice-pwd)")
    if not media.dtls or not media.dtls.fingerprints:
        raise SdpError("the offer's audio has no DTLS fingerprint (a=fingerprint)")


def parse_ice_server(url: str) -> RTCIceServer:
    """``--ice-server`` value → RTCIceServer: ``stun:host[:port]`` or
    ``turn[s]:[user:password@]host[:port][?transport=udp|tcp]``.
    """
    scheme, _, rest = url.partition(":")
    username = credential = None
    if "@" in rest:
        userinfo, _, rest = rest.rpartition("@")
        username, _, credential = userinfo.partition(":")
    plain = f"{scheme}:{rest}"
    try:
        parse_stun_turn_uri(plain)
    except ValueError as exc:
        raise ValueError(f"bad ICE server {url!r}: {exc}") from None
    return RTCIceServer(urls=plain, username=username, credential=credential)


@dataclass(frozen=True)
class IcePolicy:
    """Which ICE servers and host addresses every peer of this server uses.

    ``hosts`` empty: aioice's default host candidates (every interface but loopback). Non-empty:
    host candidates on exactly these addresses, and remote candidates only where a socket bound to
    one of them can send: same IP version and the same loopback-or-not scope (a socket bound to
    127.0.0.1 cannot reach a LAN address, and the other way round). Remote candidates given by
    name (mDNS ``.local``) are then ignored too, since resolving them means multicast on the LAN.

    The restriction is applied per peer (:meth:`restrict`, :meth:`filter_candidates`), nothing
    process-wide is patched, so peers with different policies coexist.
    """

    servers: tuple[RTCIceServer, ...] = ()
    hosts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for host in self.hosts:
            ipaddress.ip_address(host)  # ValueError for a name or a typo, at start-up

    def configuration(self) -> RTCConfiguration:
        # An explicit list, even empty: with None aiortc adds stun.l.google.com.
        return RTCConfiguration(iceServers=list(self.servers))

    def allows_remote(self, address: str) -> bool:
        if not self.hosts:
            return True
        try:
            remote = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(
            local.version == remote.version and local.is_loopback == remote.is_loopback
            for local in map(ipaddress.ip_address, self.hosts)
        )

    def filter_candidates(self, sdp: str) -> str:
        """The SDP without the ``a=candidate`` lines :meth:`allows_remote` refuses."""
        if not self.hosts:
            return sdp
        kept = []
        for line in sdp.splitlines(keepends=True):
            fields = line.split()
            # a=candidate:<foundation> <component> <transport> <priority> <address> <port> ...
            if line.startswith("a=candidate:") and len(fields) > 4:
                if not self.allows_remote(fields[4]):
                    logger.info("ignoring remote ICE candidate on %s", fields[4])
                    continue
            kept.append(line)
        return "".join(kept)

    def restrict(self, pc: RTCPeerConnection) -> None:
        """Make ``pc``'s ICE gatherers use ``hosts``: call before ``setLocalDescription``.

        Idempotent, and local to ``pc``: see :func:`_restrict_host_addresses`.
        """
        if self.hosts:
            for gatherer in _gatherers(pc):
                # aiortc exposes the aioice connection only as the gatherer's _connection.
                _restrict_host_addresses(gatherer._connection, list(self.hosts))


def _gatherers(pc: RTCPeerConnection) -> set[RTCIceGatherer]:
    transports = {t.receiver.transport for t in pc.getTransceivers()}
    if pc.sctp is not None:
        transports.add(pc.sctp.transport)
    return {dtls.transport.iceGatherer for dtls in transports}


def _restrict_host_addresses(connection: aioice.Connection, hosts: list[str]) -> None:
    """Gather host candidates on ``hosts`` only, for this one aioice connection.

    aioice's ``Connection.gather_candidates`` asks the module function ``get_host_addresses`` for
    the addresses and passes them to ``self.get_component_candidates``. Shadowing that method on
    the instance, rather than patching the module function, keeps the change to this connection.
    Calling the class's method (not whatever the instance holds) makes a second call replace the
    first instead of wrapping it. tests/duplex check the candidates this gives.
    """
    gather = type(connection).get_component_candidates

    async def restricted(component: int, addresses: list[str], timeout: int = 5) -> Any:
        return await gather(connection, component=component, addresses=hosts, timeout=timeout)

    connection.get_component_candidates = restricted  # type: ignore[method-assign]


class PeerListener(Protocol):
    """What a :class:`CallPeer` reports to its session. Called on the event loop; no blocking."""

    def on_audio(self, samples: np.ndarray, arrival: float) -> None:
        """16 kHz mono float32 audio from the client; ``arrival``: ``time.monotonic()``."""

    def on_event(self, event: dict[str, Any]) -> None:
        """A JSON object received on the events channel."""

    def on_bad_event(self, error: str) -> None:
        """A message on the events channel that is not a JSON object."""

    def on_playout(self, event: Playout) -> None:
        """The outbound track started an item or ran dry."""

    def on_closed(self, reason: str) -> None:
        """The call ended: the reason given to :meth:`CallPeer.close`, "rejected" (a bad offer)
        or "failed" (ICE or DTLS)."""


class CallPeer:
    """One call's aiortc peer (see module doc)."""

    def __init__(self, call_id: str, policy: IcePolicy, listener: PeerListener) -> None:
        self.call_id = call_id
        self._policy = policy
        self._listener = listener
        self._log = logging.LoggerAdapter(logger, {"session_id": call_id})
        self._pc = RTCPeerConnection(policy.configuration())
        self.outbound = OutboundAudioTrack(on_playout=listener.on_playout)
        self._channel: RTCDataChannel | None = None
        self._pending: deque[str] = deque(maxlen=MAX_PENDING_EVENTS)
        self._reader: asyncio.Task[None] | None = None
        self._closed = False
        self._pc.on("track", self._on_track)
        self._pc.on("datachannel", self._on_datachannel)
        self._pc.on("connectionstatechange", self._on_connection_state)

    @property
    def connection_state(self) -> str:
        return self._pc.connectionState

    @property
    def closed(self) -> bool:
        return self._closed

    async def answer(self, offer_sdp: str) -> str:
        """Take the client's offer, return the answer SDP (candidates included: no trickle).

        Raises :class:`SdpError` for an offer that cannot be answered; the peer is then closed.
        """
        try:
            validate_offer(offer_sdp)
            offer = RTCSessionDescription(self._policy.filter_candidates(offer_sdp), "offer")
            await self._pc.setRemoteDescription(offer)
            self._pc.addTrack(self.outbound)
            self._policy.restrict(self._pc)
            await self._pc.setLocalDescription(await self._pc.createAnswer())
        except SdpError:
            await self.close("rejected")
            raise
        except Exception as exc:  # aiortc's own checks: ValueError, InvalidAccessError, ...
            await self.close("rejected")
            raise SdpError(f"cannot answer this offer: {exc}") from exc
        self._log.info("answered offer")
        return self._pc.localDescription.sdp

    def send_event(self, event: dict[str, Any]) -> None:
        """Send a JSON event to the client, now or as soon as the events channel opens."""
        if self.closed:
            return
        message = json.dumps(event)
        if self._channel is not None and self._channel.readyState == "open":
            self._channel.send(message)
            return
        if len(self._pending) == self._pending.maxlen:
            self._log.warning("events channel not open: dropping the oldest held event")
        self._pending.append(message)

    async def close(self, reason: str = "closed") -> None:
        """End the call and release the peer, its track, reader and held events. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pending.clear()
        self.outbound.stop()
        if self._reader is not None:
            self._reader.cancel()
        await self._pc.close()
        self._log.info("peer closed (%s)", reason)
        self._listener.on_closed(reason)

    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind != "audio" or self._reader is not None:
            return
        self._reader = asyncio.create_task(self._read_inbound(track))

    async def _read_inbound(self, track: MediaStreamTrack) -> None:
        resampler = FrameResampler(INBOUND_RATE)
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                self._log.info("inbound audio track ended")
                return
            arrival = time.monotonic()
            samples = resampler.push(frame)
            if len(samples):
                self._listener.on_audio(samples, arrival)

    def _on_datachannel(self, channel: RTCDataChannel) -> None:
        if channel.label != EVENTS_CHANNEL:
            self._log.info("ignoring data channel %r", channel.label)
            return
        self._channel = channel
        channel.on("message", self._on_message)
        # The server learns of a client's channel once it is open, so held events can go now.
        while self._pending:
            channel.send(self._pending.popleft())

    def _on_message(self, message: str | bytes) -> None:
        try:
            event = json.loads(message)
        except ValueError as exc:  # json.JSONDecodeError and UnicodeDecodeError both are
            self._listener.on_bad_event(f"events must be JSON: {exc}")
            return
        if not isinstance(event, dict):
            self._listener.on_bad_event("an event must be a JSON object")
            return
        self._listener.on_event(event)

    async def _on_connection_state(self) -> None:
        state = self._pc.connectionState
        self._log.info("connection %s", state)
        if state in ("failed", "closed"):
            await self.close(state)
