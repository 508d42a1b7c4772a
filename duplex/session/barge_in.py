"""Speech over the agent on a paced transport: is it an interruption, a backchannel, or noise?

The session (:mod:`duplex.session.session`) holds the agent's audio at the onset of any speech
over it (:class:`~duplex.session.states.PendingInterruption`), so the person hears the agent stop
at once whatever comes next, and asks :func:`next_step` after every VAD window what to do:

- ``CONFIRM``: an interruption. Speech that lasts ``interrupt_min_speech_ms``; where
  backchannels are listened for (``backchannel_max_ms`` > 0), speech longer than a backchannel
  can be, or a fragment whose words are not one.
- ``DISMISS``: a false interruption (a click, a cough: too short to be a word); the audio resumes.
- ``RECOGNISE``: a fragment of word length ended while backchannels are listened for; its words
  decide (:class:`BackchannelCheck`, :func:`duplex.turns.backchannel.is_backchannel`): after
  "mhm" or "yeah" the agent goes on where it paused, after "stop" it is interrupted.
- ``WAIT``: nothing is known yet.

A :class:`BackchannelCheck` is one out-of-band, text-only request over the fragment alone (no
history, no kept model state, one output token) that asks the pipeline to transcribe it
(``params["transcribe"]``); it takes the first ``input_transcript`` and leaves the request,
which aborts it. It lives from the fragment's end until its verdict, or until the session drops
it (the person went on speaking, the session closed). A pipeline that does not transcribe, fails,
or is slower than ``RECOGNITION_TIMEOUT_S`` gives no verdict: the fragment counts as an
interruption, as it would without backchannels.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Callable

from duplex import metrics
from duplex.session.model_pipeline import ModelPipeline
from duplex.settings import SessionDefaults
from duplex.turns.backchannel import is_backchannel
from duplex.turns.server_vad import TurnDetector
from pipeline.coordinator import PipelineError, PipelineOverloaded
from pipeline.proto import OmniRequest

log = logging.getLogger(__name__)

RECOGNITION_TIMEOUT_S = 2.0  # past this, holding the agent's audio costs more than a wrong guess


class Step(enum.Enum):
    WAIT = "wait"
    CONFIRM = "confirm"
    DISMISS = "dismiss"
    RECOGNISE = "recognise"


def next_step(detector: TurnDetector, defaults: SessionDefaults, recognising: bool) -> Step:
    """What speech over the agent calls for after this VAD window (module doc); ``recognising``:
    the fragment's words are being recognised already."""
    word_ms = defaults.interrupt_min_speech_ms
    longest = defaults.backchannel_max_ms
    if not detector.in_speech:
        return Step.WAIT if recognising else Step.DISMISS
    if longest <= 0:
        if detector.speech_ms >= word_ms:
            return Step.CONFIRM
        return Step.DISMISS if detector.silence_ms >= word_ms else Step.WAIT
    if detector.speech_ms >= longest:
        return Step.CONFIRM
    if recognising or detector.silence_ms < word_ms:
        return Step.WAIT
    return Step.RECOGNISE if detector.speech_ms >= word_ms else Step.DISMISS


class BackchannelCheck:
    """The recognition of one fragment of speech over the agent (module doc). ``on_verdict`` gets
    True (a backchannel), False (words that interrupt) or None (no words came back in time)."""

    def __init__(self, pipeline: ModelPipeline, request: OmniRequest,
                 on_verdict: Callable[[bool | None], None], log_extra: dict[str, str]) -> None:
        self._pipeline = pipeline
        self._request = request
        self._on_verdict = on_verdict
        self.log = logging.LoggerAdapter(log, {**log_extra, "request_id": request.request_id})
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            async with asyncio.timeout(RECOGNITION_TIMEOUT_S):
                transcript = await self._transcript()
        except (TimeoutError, PipelineError, PipelineOverloaded) as err:
            self.log.warning("speech over the agent not recognised (%s): taken as an interruption", err)
            transcript = None
        verdict = None if transcript is None else is_backchannel(transcript)
        if verdict:
            metrics.BACKCHANNELS_TOTAL.inc()
        self.log.info("speech over the agent heard as %r: %s", transcript,
                      {True: "a backchannel", False: "an interruption", None: "unknown"}[verdict])
        self._on_verdict(verdict)

    async def _transcript(self) -> str | None:
        # aclosing, as a Response streams: leaving early (the transcript came, the check was
        # cancelled) aborts the request's other stages now, not when the generator is collected.
        chunks = self._pipeline.stream(self._request)
        async with contextlib.aclosing(chunks):  # type: ignore[type-var]
            async for chunk in chunks:
                transcript = chunk.data.get("input_transcript")
                if transcript is not None:
                    return str(transcript)
        return None

    def cancel(self) -> None:
        """Drop the check (the person went on, or the session closed): no verdict comes."""
        self._task.cancel()
