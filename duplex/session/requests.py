"""What a session asks its model: the pipeline request a response sends.

A :class:`RequestBuilder` belongs to one session and lives as long as it. It turns the history (or
a response's own input items, or the turn so far for a speculative answer) into the pipeline's
messages, the response's options into request params, and names the kept conversation the request
continues (``keep_model_state``). It holds no state of its own: the history and the kept model
state are the session's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from duplex.media.video_window import TurnPictures
from duplex.protocol.events import new_id
from duplex.protocol.response_create import ResponseSpec
from duplex.session.config import SessionConfig
from duplex.session.history import History, Item
from duplex.session.model_state import KeptModelState
from duplex.settings import SessionDefaults
from duplex.turns.vad import SAMPLE_RATE
from pipeline.proto import OmniRequest
from pipeline.scheduling.conversation_book import PARTIAL_PARAM


class RequestBuilder:
    def __init__(self, defaults: SessionDefaults, history: History, model_state: KeptModelState,
                 owner: str) -> None:
        # Every request of the session is the session's in the pipeline's fair share of
        # max_in_flight (pipeline/admission.py): its flood fails it, never another's turn.
        self._owner = owner
        self._defaults = defaults
        self._history = history
        self._model_state = model_state
        # What the model is offered for a response's tools and tool choice: MCP tools become the
        # tools their servers listed (the session's McpTools.offered); as given by default.
        self.offered: Callable[[tuple[dict[str, Any], ...], str | dict[str, Any]],
                               tuple[list[dict[str, Any]], str | dict[str, Any]]] = _as_given

    def params(self, config: SessionConfig, spec: ResponseSpec) -> dict[str, Any]:
        params: dict[str, Any] = {
            "modalities": ["text", "audio"] if spec.speaks else ["text"],
            "voice": self._defaults.voice_map.get(spec.voice, spec.voice),
            "max_output_tokens": spec.max_output_tokens,
        }
        tools, choice = self.offered(spec.tools, spec.tool_choice) if spec.tool_choice != "none" else ([], "none")
        if tools and choice != "none":
            params["tools"], params["tool_choice"] = tools, choice
        td = config.turn_detection
        if config.transcription is not None or (td is not None and td.type == "semantic_vad"):
            # Presets whose model does not transcribe run their recogniser only when asked: for
            # the client, or for semantic_vad's words cue.
            params["transcribe"] = True
        if spec.say is not None:
            params["say"] = spec.say
        return params

    def request(self, config: SessionConfig, spec: ResponseSpec, input_items: list[Item] | None,
                pending: Item | None = None, until: int = 0) -> OmniRequest:
        """The request answering the history (or ``input_items``), with ``pending`` as its newest
        turn (the turn so far, for a speculative answer or, ``until`` > 0, a partial turn)."""
        params = self.params(config, spec)
        source = self._history
        if input_items is not None:
            source = History(self._defaults.max_input_audio_s)
            for given in input_items:
                source.add(given)
        messages = source.messages(spec.instructions, pending)
        request_id = new_id("req")
        if input_items is None and not spec.out_of_band:
            params.update(self._model_state.conversation_for(messages, params.get("tools"), request_id,
                                                             until))
        return OmniRequest(request_id, {"messages": messages}, params, owner=self._owner)

    def speculative(self, config: SessionConfig, turn_audio: np.ndarray,
                    pictures: TurnPictures | None = None) -> OmniRequest:
        """The answer to the turn so far (what was said, and ``pictures``, what the caller's camera
        showed), begun at a pause (:mod:`duplex.session.speculation`)."""
        pictures = pictures or TurnPictures()
        pending = Item(new_id("item"), "user", audio=turn_audio, sample_rate=SAMPLE_RATE,
                       images=pictures.images, image_times=pictures.times)
        request = self.request(config, ResponseSpec.of_session(config), None, pending)
        # The turn may go on: a pipeline that judges words says whether these read as finished.
        request.params["end_of_turn"] = True
        return request

    def partial(self, config: SessionConfig, turn_audio: np.ndarray, until: int) -> OmniRequest:
        """The turn so far as a partial turn (:mod:`duplex.session.prefill`): the model prefills
        its first ``until`` seconds into the conversation's kept state and answers nothing."""
        pending = Item(new_id("item"), "user", audio=turn_audio, sample_rate=SAMPLE_RATE)
        spec = replace(ResponseSpec.of_session(config), output_modalities=("text",))
        request = self.request(config, spec, None, pending, until)
        request.params.pop("transcribe", None)
        request.params[PARTIAL_PARAM] = until
        return request

    def recognition(self, config: SessionConfig, fragment: np.ndarray) -> OmniRequest:
        """A fragment of speech over the agent, alone and out of the conversation, to be
        transcribed (:mod:`duplex.session.barge_in`); the answer's one token is thrown away."""
        spec = replace(ResponseSpec.of_session(config), output_modalities=("text",),
                       max_output_tokens=1, tools=(), out_of_band=True)
        item = Item(new_id("item"), "user", audio=fragment, sample_rate=SAMPLE_RATE)
        request = self.request(config, spec, [item])
        request.params["transcribe"] = True
        return request


def _as_given(tools: tuple[dict[str, Any], ...],
              choice: str | dict[str, Any]) -> tuple[list[dict[str, Any]], str | dict[str, Any]]:
    return list(tools), choice
