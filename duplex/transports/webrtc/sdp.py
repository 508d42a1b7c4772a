"""Checks on a WebRTC SDP offer before aiortc sees it, and the sections its answer rejects.

A call carries exactly one audio stream and the ``oai-events`` data channel, and, on presets whose
model sees, one video stream from the client (a camera or a screen share). An offer may hold
more (a video camera the model cannot see, a second microphone, another application section): RFC 3264 §6 says to
answer each of those with port 0 (rejected) and go on with the rest. aiortc has no notion of a
rejected section: it would make a transceiver, a receiver and a decoded-frame queue for each, and
gather ICE for each one that is not bundled. So :func:`plan_answer` removes them from the offer
aiortc sees (and from its ``a=group`` lines), and :meth:`AnswerPlan.complete` puts them back into
aiortc's answer, rejected, where they were: the answer has the offer's m= lines in the offer's
order (RFC 3264 §6) and the rejected mids in no BUNDLE group (RFC 8843 §7.3.3).
"""

from __future__ import annotations

from dataclasses import dataclass

from aiortc import RTCRtpSender
from aiortc.sdp import SessionDescription

# What aiortc can decode: opus, G722, PCMU, PCMA.
_AUDIO_CODECS = {c.mimeType.split("/")[1].lower()
                 for c in RTCRtpSender.getCapabilities("audio").codecs}
# What aiortc can decode: VP8, H264.
_VIDEO_CODECS = {c.mimeType.split("/")[1].lower()
                 for c in RTCRtpSender.getCapabilities("video").codecs} - {"rtx"}
_DATA_CHANNEL_PROTOCOLS = ("UDP/DTLS/SCTP", "TCP/DTLS/SCTP", "DTLS/SCTP")


# Bounds on what one offer may make the server do: aioice checks every remote candidate against
# every earlier one, so tens of thousands of them keep the event loop busy for minutes. Browsers
# send a handful of candidates and a few kB of SDP.
MAX_SDP_BYTES = 64 * 1024
MAX_CANDIDATES = 64
MAX_MEDIA_SECTIONS = 8


class SdpError(ValueError):
    """An offer this server cannot answer; the message says why (the HTTP layer answers 400)."""


@dataclass(frozen=True)
class _Section:
    """One m= section of an offer, as its raw lines (the m= line first)."""

    lines: tuple[str, ...]

    @property
    def fields(self) -> list[str]:
        return self.lines[0][2:].split()

    @property
    def kind(self) -> str:
        return self.fields[0] if self.fields else ""

    @property
    def mid(self) -> str | None:
        return next((line[6:].strip() for line in self.lines if line.startswith("a=mid:")), None)

    def is_receivable_video(self) -> bool:
        """A video stream the client sends, in a codec aiortc decodes."""
        if self.kind != "video" or any(line in ("a=recvonly", "a=inactive") for line in self.lines):
            return False
        codecs = {line.split()[1].split("/")[0].lower() for line in self.lines
                  if line.startswith("a=rtpmap:") and len(line.split()) > 1}
        return bool(codecs & _VIDEO_CODECS)

    def is_data_channel(self) -> bool:
        fields = self.fields
        return self.kind == "application" and len(fields) > 2 and fields[2] in _DATA_CHANNEL_PROTOCOLS

    def rejected(self) -> list[str]:
        """This section as an answer rejects it: port 0, the offer's protocol and formats, its mid."""
        fields = self.fields
        proto = fields[2] if len(fields) > 2 else "RTP/AVP"
        formats = fields[3:] or ["0"]
        lines = [f"m={self.kind} 0 {proto} {' '.join(formats)}", "c=IN IP4 0.0.0.0"]
        return lines + ([f"a=mid:{self.mid}"] if self.mid is not None else [])


@dataclass(frozen=True)
class AnswerPlan:
    """What to give aiortc (``offer``) and what to reject in its answer (``complete``)."""

    offer: str
    rejected: dict[int, _Section]  # by m= line index in the client's offer
    sections: int  # m= lines in the client's offer

    video: bool = False  # the offer's video section is kept (a preset that sees)

    @property
    def rejected_kinds(self) -> list[str]:
        return [section.kind for section in self.rejected.values()]

    def complete(self, answer_sdp: str) -> str:
        """aiortc's answer to ``offer`` with the rejected sections back in their places."""
        head, answered = _split(answer_sdp)
        if len(answered) + len(self.rejected) != self.sections:
            raise SdpError(f"the answer has {len(answered)} sections for {self.sections} offered")
        kept = iter(answered)
        lines = list(head)
        for index in range(self.sections):
            section = self.rejected.get(index)
            lines += section.rejected() if section is not None else next(kept).lines
        return "\r\n".join(lines) + "\r\n"


def plan_answer(sdp: str, video: bool = False) -> AnswerPlan:
    """Check an SDP offer before aiortc sees it, so that bad input gets a clear error, and set
    apart the sections a call rejects.

    aiortc's parser accepts almost anything and its failures are assertion errors; this requires
    what answering needs: an audio section the client sends on, in a codec aiortc decodes, with
    ICE credentials and a DTLS fingerprint. Kept: the first audio section, the first
    data-channel section and, where ``video`` (the model sees), the first video section the
    client sends in a codec aiortc decodes. Rejected: everything else.
    """
    _check_bounds(sdp)
    head, sections = _split(sdp)
    audio = next((i for i, s in enumerate(sections) if s.kind == "audio"), None)
    data = next((i for i, s in enumerate(sections) if s.is_data_channel()), None)
    camera = next((i for i, s in enumerate(sections) if s.is_receivable_video()), None) if video else None
    rejected = {i: s for i, s in enumerate(sections) if i not in (audio, data, camera)}
    dropped = {s.mid for s in rejected.values() if s.mid is not None}
    lines = [_without_mids(line, dropped) for line in head]
    for i, section in enumerate(sections):
        if i not in rejected:
            lines += section.lines
    offer = "\r\n".join(lines) + "\r\n"
    _check_audio(offer)
    return AnswerPlan(offer, rejected, len(sections), video=camera is not None)


def _check_bounds(sdp: str) -> None:
    if not sdp.lstrip().startswith("v=0"):
        raise SdpError("not an SDP offer: it must start with 'v=0'")
    if len(sdp.encode()) > MAX_SDP_BYTES:
        raise SdpError(f"the offer is larger than {MAX_SDP_BYTES} bytes")
    if sdp.count("a=candidate:") > MAX_CANDIDATES:
        raise SdpError(f"the offer has more than {MAX_CANDIDATES} ICE candidates")
    if sdp.count("\nm=") + sdp.startswith("m=") > MAX_MEDIA_SECTIONS:
        raise SdpError(f"the offer has more than {MAX_MEDIA_SECTIONS} media sections")


def _check_audio(sdp: str) -> None:
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


def _split(sdp: str) -> tuple[list[str], list[_Section]]:
    """The session-level lines and the m= sections of an SDP text."""
    head: list[str] = []
    sections: list[list[str]] = []
    for line in sdp.splitlines():
        if not line:
            continue
        if line.startswith("m="):
            sections.append([line])
        elif sections:
            sections[-1].append(line)
        else:
            head.append(line)
    return head, [_Section(tuple(lines)) for lines in sections]


def _without_mids(line: str, mids: set[str]) -> str:
    """A session-level ``a=group:`` line without the given mids (other lines as they are)."""
    if not line.startswith("a=group:") or not mids:
        return line
    semantic, *items = line[8:].split()
    return " ".join([f"a=group:{semantic}", *(item for item in items if item not in mids)])
