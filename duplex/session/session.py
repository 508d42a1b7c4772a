"""One conversation: the turn state machine, barge-in included, over a transport-agnostic Session.

Every transport (WebRTC, the Realtime WebSocket, ...) creates one Session per connection and feeds it
inbound audio (``on_audio``, 16 kHz float32) and, through ``ClientEvents``, client events; the
session sends server events through its ``SessionTransport`` and agent audio through its
``AgentAudio``, and reaches the model only through a ``ModelPipeline`` (``stream`` / ``abort``).

A turn ends by silence (server_vad) or when the end-of-turn model and the pause say the user has
finished (semantic_vad, :class:`~duplex.turns.semantic.SemanticTurnJudge`). Under semantic_vad
the answer begins at each pause, unseen, and is adopted when the turn ends there or aborted when
the user goes on (:mod:`duplex.session.speculation`); its transcript is the judge's text cue.
Where the model keeps the conversation's state, the turn is prefilled in pieces while the user
speaks (:mod:`duplex.session.prefill`), so its end leaves only the last piece to do.
Where the client asked for transcription, the turn is transcribed while the user speaks, and its
words are told as they firm up (:mod:`duplex.session.live_transcript`).

States (:class:`State`): listening → user_speaking → thinking → speaking → listening. While a
response is active and ``interrupt_response`` is on, speech over the agent adds a barge-in
sub-state (``barge_in``), held and handled by :mod:`duplex.session.interruptions`: where the client
plays the audio, onset cancels the response at once; where the server paces it, onset holds the
audio until the speech is confirmed (cancel, truncate, answer the speech as the next turn),
dismissed (the audio resumes) or recognised as a backchannel (the agent goes on).

While the agent's audio is less than ``echo_guard_ms`` old the VAD threshold is raised to
``echo_guard_threshold`` so that the agent's own echo does not interrupt it.

Time: turn-taking runs on audio time (positions in the inbound stream), so it is deterministic for
the same audio; only metrics read the wall clock. State (the detector, the history, the response in
flight, the barge-in sub-state) belongs to this session and is released by ``close``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from duplex.media.front_end import AudioFrontEnd
from duplex.media.playout import AgentAudio
from duplex.media.recording import CallRecording
from duplex.media.video_window import TurnPictures, VideoWindow
from duplex.protocol.events import RealtimeError, event, new_id
from duplex.protocol.response_create import ResponseSpec
from duplex.protocol.session_update import session_object
from duplex.session.arrivals import Arrivals
from duplex.session.call_wait import CallWait
from duplex.session.config import SessionConfig
from duplex.session.conversation import Conversation
from duplex.session.history import History, Item
from duplex.session.idle import Idle
from duplex.session.input_buffer import InputBuffer
from duplex.session.interruptions import Interruptions
from duplex.session.live_transcript import LiveTranscript
from duplex.session.model_pipeline import ModelPipeline
from duplex.session.model_state import KeptModelState
from duplex.session.prefill import TurnPrefill
from duplex.session.requests import RequestBuilder
from duplex.session.response import Response
from duplex.session.response_call import OfferedTools, ServerFunction
from duplex.session.speculation import Speculation, Speculator
from duplex.session.states import BargeIn, PendingInterruption, SessionTransport, State
from duplex.settings import SessionDefaults
from duplex.tools.mcp_session import McpTools
from duplex.turns.semantic import SemanticTurnJudge
from duplex.turns.server_vad import SpeechStarted, SpeechStopped, TurnDetector
from duplex.turns.vad import SAMPLE_RATE, WINDOW
from pipeline.proto import OmniRequest

log = logging.getLogger(__name__)

MAX_BESIDE_RESPONSES = 4
"""Out-of-band text responses one session may run at a time: past it, a ``response.create`` is
refused (``too_many_responses``) before it reaches the pipeline, whose slots all sessions share."""


class Session:
    def __init__(
        self,
        session_id: str,
        transport: SessionTransport,
        audio: AgentAudio,
        pipeline: ModelPipeline,
        defaults: SessionDefaults,
        voices: list[str],
        model_name: str,
    ) -> None:
        self.id = session_id
        self.transport: SessionTransport | None = transport
        """Where events go; None once the session closed (it lets go of the connection)."""
        self.audio = audio
        self.pipeline = pipeline
        self.defaults = defaults
        self.voices = voices
        self.model_name = model_name
        self.config = defaults.session_config(transport.kind)
        self.history = History(defaults.max_input_audio_s)
        self.conversation = Conversation(self.history, self.send)
        self.state = State.LISTENING
        self.log = logging.LoggerAdapter(log, {"session_id": session_id})
        self._detector = TurnDetector(self.config.turn_detection, self._max_turn_ms)
        self._interruptions = Interruptions(self._detector)
        self._judge = SemanticTurnJudge()
        self._model_state = KeptModelState(pipeline, defaults.keep_model_state)
        self._requests = RequestBuilder(defaults, self.history, self._model_state, session_id)
        # MCP servers the session's tools name (duplex/tools): connected on session.update.
        self.mcp = McpTools(self.send, self.conversation, {"session_id": session_id})
        self._offered = OfferedTools(self.mcp)
        self._requests.offered = self._offered
        self._speculator = Speculator(pipeline, self._judge.hear, self._model_state.withdraw,
                                      {"session_id": session_id})
        piece_s = defaults.prefill_piece_s if defaults.keep_model_state else 0
        self._prefill = TurnPrefill(pipeline, piece_s, {"session_id": session_id})
        self._live = LiveTranscript(pipeline, self.conversation.transcribing, {"session_id": session_id})
        self._input = InputBuffer(defaults.max_input_audio_s, SAMPLE_RATE)
        self._response: Response | None = None
        # Out-of-band, text-only responses (``conversation: "none"``): they run beside the
        # conversation's response, touch neither its state nor its audio, and leave when done.
        self._beside: set[Response] = set()
        self._user_item_id: str | None = None
        self._closed = False
        self._arrivals = Arrivals()
        self.idle = Idle(self, defaults)  # idle timeout, check-ins, longest call
        self.call_wait = CallWait(self, defaults)  # the filler while a client's function runs
        self.recording: CallRecording | None = None  # the binding's, with --record-dir
        # A WebRTC call's camera, on presets whose model sees (the call's): each user turn shows
        # the model the pictures seen since it began (``_turn_began_at``, monotonic).
        self.video: VideoWindow | None = None
        self._turn_began_at = time.monotonic()
        audio.listener = self
        # Echo cancellation and noise suppression of the caller's audio; it taps ``audio`` for
        # what the caller heard (duplex/media/front_end.py).
        self.front_end = AudioFrontEnd(audio, {"session_id": session_id},
                                       record_dir=defaults.front_end_record_dir)

    @property
    def _max_turn_ms(self) -> int:
        return int(self.defaults.max_input_audio_s * 1000)

    @property
    def response(self) -> Response | None:
        """The response in flight, from its creation until its ``response.done`` went out."""
        return self._response

    @property
    def barge_in(self) -> BargeIn:
        """The barge-in sub-state (:mod:`duplex.session.interruptions`), None without one."""
        return self._interruptions.state

    @property
    def server_function(self) -> ServerFunction | None:
        """A function the transport runs itself (the SIP call's transfer_call), offered to the
        model beside the client's tools; set by the transport."""
        return self._offered.function

    @server_function.setter
    def server_function(self, function: ServerFunction | None) -> None:
        self._offered.function = function

    @property
    def closed(self) -> bool:
        return self._closed

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        self.send(event("session.created", session=self.session_object()))

    async def close(self) -> None:
        """End the session: abort the response in flight and release every piece of state."""
        if self._closed:
            return
        self._closed = True
        self.idle.close()
        self.call_wait.close()
        if self._response is not None:
            await self.cancel_response("session_closed")
        for beside in list(self._beside):
            await beside.cancel("session_closed")
        self._detector.reset()
        self._judge.forget()
        await self._speculator.close()
        await self._prefill.close()
        await self._live.close()
        await self._model_state.close()
        await self.mcp.close()
        self.history.clear()
        self._input.clear()
        self.front_end.close()
        self._let_go()
        self.log.info("session %s closed", self.id)

    async def connection_lost(self, unsent_ms: dict[str, int]) -> None:
        """The client's connection dropped and the session waits for a resume (docs/resume.md).
        Audio that never left the server (``unsent_ms``: per assistant item, the milliseconds at
        the end of what its playout counted) is dropped, and what was in flight is cut as at a
        barge-in: the response in flight is cancelled and its item cut to the audio sent, the
        model's kept state to the same answer tokens; an answer already done whose audio was still
        waiting is cut as a client's ``conversation.item.truncate`` cuts it; the user's turn in
        progress (its audio stopped mid-way) is dropped. The rest (history, config, kept state,
        responses beside the conversation) waits for the client."""
        unsent = dict(unsent_ms)
        resp = self._response
        if resp is not None:
            held = unsent.pop(resp.item.id, 0)
            heard_ms = max(0, self.audio.heard_ms() - held) if resp.speaks else None
            self.log.info("connection lost: response %s cut at %s ms", resp.id, heard_ms)
            # OpenAI's reasons have none for a dropped connection: the client's own cancel, as
            # the nearest (idle.py reads the server's hang-up the same way).
            await self._interruptions.cancel(self, resp, "client_cancelled", heard_ms)
        for item_id, held in unsent.items():
            item = self.history.get(item_id)
            if item is not None and item.spoken_ms and held > 0:
                await self.truncate_heard(item, max(0, item.spoken_ms - held))
        if self.config.turn_detection is not None:
            self._detector.discard_turn()

    def _let_go(self) -> None:
        """Cut the references that lead back to this session: its audio reports to it, its
        conversation sends through it, and the transport it sends through owns it. With them, a
        closed session and everything it holds (the resamplers, each a libswresample filter graph
        with threads of its own) would wait for Python's cyclic garbage collector; without them,
        reference counting frees it as soon as its transport lets go."""
        self._interruptions.close()  # a pending backchannel check calls back into the session
        self.audio.close()
        self.conversation.close()
        self.transport = None

    def send(self, message: dict[str, Any]) -> None:
        if not self._closed and self.transport is not None:
            self.transport.send_event(message)

    def session_object(self) -> dict[str, Any]:
        return session_object(self.id, self.config, self.model_name)

    def reconfigure(self, config: SessionConfig) -> None:
        """Apply a validated session.update."""
        self.config = config
        if config.turn_detection is not None:
            self._detector.config = config.turn_detection
        self.mcp.configure(config.tools)

    # --- inbound audio --------------------------------------------------------------------

    def on_audio(self, samples: np.ndarray, received_at: float | None = None) -> None:
        """Inbound audio at 16 kHz (float32 mono), as it arrives; ``received_at`` is monotonic."""
        if self._closed:
            return
        received_at = time.monotonic() if received_at is None else received_at
        if self.recording is not None:
            self.recording.caller(samples, received_at)
        samples = self.front_end.process(samples, received_at, self.config)
        self._arrivals.note(len(samples), received_at)
        if self.config.turn_detection is None:
            self._input.append(samples)
            return
        # One VAD window at a time: an interruption is confirmed (or dismissed) at the window where
        # it happens, even when a client sends a whole utterance in one chunk.
        for start in range(0, len(samples), WINDOW):
            self._detector.threshold_override = self._echo_guard()
            for turn_event in self._detector.process(samples[start : start + WINDOW]):
                if isinstance(turn_event, SpeechStarted):
                    arrived_at = self._arrivals.of(turn_event.start_ms, received_at)
                    self._interruptions.on_onset(self, turn_event, arrived_at)
                else:
                    self.turn_ended(turn_event)
            if self._semantic_turn_end():
                stop = self._detector.end_turn()
                assert stop is not None
                self.turn_ended(stop)
            self._speculator.step(self._detector, self._may_speculate(),
                                  lambda audio: self._requests.speculative(self.config, audio,
                                                                           self._turn_pictures()))
            self._prefill.step(self._detector, self._quiet() and not self._speculator.active,
                               lambda audio, until: self._requests.partial(self.config, audio, until))
            self._live.step(self._detector, self._live_item(),
                            lambda audio: self._requests.recognition(self.config, audio))
            self._interruptions.check(self)
            self.idle.step(self._detector.position_ms, self._detector.in_speech)
            self.call_wait.step(self._detector.position_ms, self._detector.in_speech)

    def _semantic_turn_end(self) -> bool:
        """semantic_vad: whether the end-of-turn model and the pause end the user's turn now."""
        td = self.config.turn_detection
        if td is None or td.type != "semantic_vad" or isinstance(self.barge_in, PendingInterruption):
            return False
        return self._judge.should_end(self._detector, td.eagerness)

    def _may_speculate(self) -> bool:
        """Whether an answer may begin at a pause (module doc of :mod:`duplex.session.speculation`)."""
        td = self.config.turn_detection
        return (td is not None and td.type == "semantic_vad" and td.create_response
                and self.defaults.speculative_start and self._quiet())

    def _quiet(self) -> bool:
        """Whether nothing of the conversation runs: no response, no barge-in, not closed."""
        return self._response is None and self.barge_in is None and not self._closed

    def _live_item(self) -> str | None:
        """The user item the turn in progress becomes, where the client asked for its transcript."""
        speaking = self.state is State.USER_SPEAKING and self.config.transcription is not None
        return self._user_item_id if speaking else None

    async def settled(self) -> None:
        """Until the end-of-turn model answered for the current pause (tests on virtual time)."""
        await self._judge.settled()

    def _echo_guard(self) -> float | None:
        """The raised VAD threshold while the agent's audio is young (audio time, not wall time)."""
        resp = self._response
        if resp is None or resp.playout_started_at is None:
            return None
        young = self.audio.heard_ms() < self.defaults.echo_guard_ms
        return self.defaults.echo_guard_threshold if young else None

    def speech_started(self, onset_ms: int) -> None:
        """The user's speech began at ``onset_ms`` (audio time): a new user item, announced."""
        self._user_item_id = new_id("item")
        self.state = State.USER_SPEAKING
        self._turn_began_at = self._arrivals.of(onset_ms, time.monotonic())
        self.send(event("input_audio_buffer.speech_started", audio_start_ms=onset_ms,
                        item_id=self._user_item_id))
        if not self.audio.paces_playout and self.audio.tap is not None:
            # The client stops playing here (a Realtime client's duty): the rest it was sent
            # never reaches its loudspeaker, the echo canceller's far end or the recording.
            self.audio.tap.cut_agent(time.monotonic())

    def turn_ended(self, stop: SpeechStopped) -> None:
        """The user's turn ended at ``stop``: committed, and answered where turn detection answers
        (after the cancel, where a response is being cancelled)."""
        if self._interruptions.on_turn_end(self, stop):
            return
        item_id = self._user_item_id or new_id("item")
        self._user_item_id = None
        self._live.end_turn()
        self.send(event("input_audio_buffer.speech_stopped", audio_end_ms=stop.end_ms, item_id=item_id))
        td = self.config.turn_detection
        answers = td is not None and td.create_response
        speculation = self._speculator.take() if answers and self._response is None else None
        # An adopted answer's turn is what its model heard and saw (up to the pause it began in).
        if speculation is None:
            self.commit_user_audio(item_id, stop.audio, self._turn_pictures())
        else:
            self.commit_user_audio(item_id, speculation.audio, speculation.pictures)
        if not answers:
            return
        if self._response is None:
            self.start_response(turn_end_at=time.monotonic(), speculation=speculation)
        else:
            self._interruptions.defer(time.monotonic())

    def on_dtmf(self, digit: str) -> None:
        """A key the caller pressed (telephony): an event, and text the model sees next turn."""
        self.log.info("the caller pressed %s", digit)
        self.send(event("input_audio_buffer.dtmf_event_received", event=digit,
                        received_at=int(time.time())))
        self.conversation.create(Item(new_id("item"), "user",
                                     text=f"(The caller pressed {digit} on the keypad.)"))

    # --- user items -----------------------------------------------------------------------

    def commit_manual_buffer(self) -> None:
        self.commit_user_audio(new_id("item"), self._input.take(), self._turn_pictures())
        self._turn_began_at = time.monotonic()  # the next manual turn shows what is seen from now

    def commit_input(self) -> None:
        """``input_audio_buffer.commit``: the manual buffer, or, under turn detection, the turn the
        VAD holds, ended now as if its silence had come (and answered if turn detection answers)."""
        if self.config.turn_detection is None:
            self.commit_manual_buffer()
            return
        stop = self._detector.end_turn()
        if stop is None:
            raise RealtimeError("nothing to commit: the turn detector holds no speech (it commits "
                                "each turn itself when the speech ends)",
                                code="input_audio_buffer_commit_empty")
        self.turn_ended(stop)

    def clear_manual_buffer(self) -> None:
        self._input.clear()
        self._detector.discard_turn()

    def commit_user_audio(self, item_id: str, audio: np.ndarray, pictures: TurnPictures | None = None) -> None:
        pictures = pictures or TurnPictures()
        self.conversation.commit_user_audio(Item(item_id, "user", audio=audio, sample_rate=SAMPLE_RATE,
                                                 images=pictures.images, image_times=pictures.times))
        self.state = State.THINKING

    def _turn_pictures(self) -> TurnPictures:
        """What the caller's camera showed during the turn in progress (none without one)."""
        return TurnPictures() if self.video is None else self.video.seen_since(self._turn_began_at)

    async def truncate_heard(self, item: Item, audio_end_ms: int) -> None:
        """``conversation.item.truncate``: the client, which plays the audio itself, says the user
        heard the first ``audio_end_ms`` of the assistant item ``item`` (its response may be long
        done). The history keeps the text of what was heard, and where the model keeps the
        conversation's state, that state keeps the same answer tokens (a cut of the request that
        answered, as a barge-in's), or is dropped where it cannot (see KeptModelState.cut)."""
        text = item.transcript
        tokens = self.conversation.truncate(item, audio_end_ms)
        if item.transcript == text:
            return  # the history says what it said: so may the kept state
        request_id = self._model_state.cut(item.id, tokens)
        if request_id is not None and tokens is not None:
            await self.pipeline.abort(request_id, keep_answer_tokens=tokens)

    # --- responses ------------------------------------------------------------------------

    def start_response(self, turn_end_at: float | None = None, spec: ResponseSpec | None = None,
                       input_items: list[Item] | None = None,
                       speculation: Speculation | None = None) -> None:
        """Answer the history (or ``input_items``, the response's own input) as ``spec`` says (the
        session's settings by default), or adopt ``speculation``, the answer begun at the pause
        where the turn ended. An out-of-band response's item stays out of the history; one that
        only writes runs beside whatever else runs (one voice at a time: not one that speaks), up to
        ``MAX_BESIDE_RESPONSES`` at a time."""
        spec = spec or ResponseSpec.of_session(self.config)
        beside = spec.out_of_band and not spec.speaks
        if self._response is not None and not beside:
            if self.call_wait.defer(spec, input_items):  # the filler is said first (call_wait.py)
                return
            raise RealtimeError("a response is already in progress (beside it, only an out-of-band "
                                "text response may run: conversation \"none\", output_modalities "
                                "[\"text\"])", code="conversation_already_has_active_response")
        if beside and len(self._beside) >= MAX_BESIDE_RESPONSES:
            raise RealtimeError(f"{MAX_BESIDE_RESPONSES} out-of-band responses are already in progress "
                                "(the most a session may run at a time); wait for one to be done",
                                code="too_many_responses")
        if speculation is not None:
            request, chunks = speculation.request, speculation.adopt()
        else:
            request, chunks = self._requests.request(self.config, spec, input_items), None
        item = Item(new_id("item"), "assistant", speaks=spec.speaks)
        # Added now, so that turns committed meanwhile come after it.
        previous = None if spec.out_of_band else self.conversation.add(item)
        conversation = None if spec.out_of_band else f"conv_{self.id}"
        response = Response(self, request, item, previous, spec, conversation, turn_end_at,
                            {"session_id": self.id}, chunks=chunks)
        if beside:
            self._beside.add(response)
        else:
            self._response = response

    async def cancel_response(self, reason: str, response_id: str | None = None) -> bool:
        """Cancel the response in flight (the conversation's, or the one named ``response_id``,
        which may run beside it) and wait until its response.done went out."""
        beside = next((r for r in self._beside if r.id == response_id), None)
        if beside is not None:
            await beside.cancel(reason)
            return True
        resp = self._response
        if resp is None or (response_id is not None and resp.id != response_id):
            return False
        await self._interruptions.cancel(self, resp, reason)
        return True

    def answer_turn(self, turn_end_at: float) -> None:
        """Answer the turn that ended at ``turn_end_at`` (deferred while a response was cancelled)."""
        self.start_response(turn_end_at=turn_end_at)

    def history_request(self, spec: ResponseSpec) -> OmniRequest:
        """The request that answers the history as ``spec`` says (a filler said inside a response
        whose MCP call runs: call_wait.py)."""
        return self._requests.request(self.config, spec, None)

    def recognition(self, fragment: np.ndarray) -> OmniRequest:
        """The request that transcribes ``fragment``, speech over the agent (a backchannel?)."""
        return self._requests.recognition(self.config, fragment)

    # --- ResponseHost -----------------------------------------------------------------------

    def on_first_audio(self, response: Response) -> None:
        self.state = State.SPEAKING

    def on_mcp_call(self, response: Response, running: bool) -> None:
        if running:
            self.call_wait.mcp_call_began(response)
        else:
            self.call_wait.mcp_call_ended(response)

    def on_input_transcript(self, response: Response, transcript: str) -> None:
        """The model's recognition of the user's last turn: kept as that item's text."""
        user = self.history.last_user_before(response.item.id)
        if user is not None:
            self.conversation.transcribed(user, transcript)

    def on_response_done(self, response: Response) -> None:
        if response.generation_done and self.config.transcription is not None and not response.spec.out_of_band:
            # The client asked for transcripts, and the turn was answered without one.
            user = self.history.last_user_before(response.item.id)
            if user is not None and user.audio is not None and not user.transcribed:
                self.conversation.not_transcribed(user, self.model_name)
        if response in self._beside:
            self._beside.discard(response)
            return
        if response.conversation_id is not None and response.call is None:
            self._model_state.answered(response.request_id, response.item.id)
        deferred = None
        if self._response is response:
            self._response = None
            self.idle.response_done(response)
            deferred = self.call_wait.response_done(response)
        if self.state in (State.THINKING, State.SPEAKING):
            self.state = State.LISTENING
        if self._response is None:
            self._interruptions.response_done(self)
        if response.follow_up is not None and self._response is None and self.state is State.LISTENING \
                and not self._closed:
            self.start_response(spec=response.follow_up)  # the model answers the MCP call's output
        if deferred is not None and self._response is None and not self._closed:
            self.start_response(spec=deferred.spec, input_items=deferred.input_items)

    # --- PlayoutListener ------------------------------------------------------------------

    def on_playout_started(self, item_id: str) -> None:
        resp = self._response
        if resp is not None and resp.item.id == item_id:
            resp.on_playout_started()
