"""ICE for every WebRTC peer of this server: which ICE servers and which host addresses.

Only the configured ICE servers, never aiortc's implicit public STUN server; optionally host
candidates restricted to given addresses (``--ice-host``), which is also how a peer can use
127.0.0.1, which aioice leaves out of its host candidates.
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass
from typing import Any

import aioice
from aiortc import RTCConfiguration, RTCIceGatherer, RTCIceServer, RTCPeerConnection
from aiortc.rtcicetransport import parse_stun_turn_uri

logger = logging.getLogger(__name__)


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
        raise ValueError(f"bad ICE server {plain!r}: {exc}") from None  # not its password
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
            if (line.startswith("a=candidate:") and len(fields) > 4
                    and not self.allows_remote(fields[4])):
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
