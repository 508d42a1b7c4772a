"""While a call runs: the agent's short line when its output is slow to come.

OpenAI's Realtime API leaves a function call's wait silent: the model's response ends with the
call, the client runs it, then sends its output (a ``function_call_output`` item) and a
``response.create``. A lookup that takes seconds leaves the caller in a silence nobody explains.
Where the preset sets ``call_filler_text``, the agent says it once a call has waited
``call_filler_after_ms`` since its response ended (or since the agent last spoke: the caller may
ask something else meanwhile), and the output has not come: once per wait
(calls made together share it), and only while nothing else happens (no response in flight, the
caller silent, no barge-in being checked). It is a response like the idle check-ins', whose request
gives the words (``params["say"]``): a model that speaks given words says them exactly, others are
asked to. The session listens throughout, filler or not: the caller may ask something else while
the call runs, and talking over the filler cuts it as it cuts any answer.

A call of an MCP tool, which the server runs itself, runs inside the response that made it
(``response.mcp_call.in_progress`` to ``.completed``, then ``response.done``): there the filler is
said by that response, as its own message after the call item (:meth:`Response.say_filler`), once
the call has run ``call_filler_after_ms`` and where the model said nothing before its call (words
of its own, "let me look that up", are its filler). The same conditions hold: the caller silent,
no barge-in being checked.

A client's ``response.create`` that comes while the filler is being said does not fail with
``conversation_already_has_active_response``, as it would beside any other response: the client
could not have known the server would speak. It waits for the filler's end (a few words) and
starts then (:meth:`CallWait.defer`); one at most, as only one response may wait.

Time runs on audio time (the caller's stream, as the idle timeout's), so the same audio gives the
same filler.

Lifetime: one per session, made with it and closed by ``Session.close`` (which also lets go of
the session); it holds the ids of the client's calls waiting for their output (dropped when the
output comes), the response running an MCP call that may need the filler (dropped when the call
ends), the filler in flight and at most one deferred ``response.create``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from duplex.protocol.response_create import ResponseSpec
from duplex.session.history import FunctionCall, Item
from duplex.session.idle import say_exactly
from duplex.tools.mcp_items import McpApprovalRequest, McpCall

if TYPE_CHECKING:
    from duplex.session.config import SessionConfig
    from duplex.session.response import Response
    from duplex.settings import SessionDefaults
    from pipeline.proto import OmniRequest


class CallWaitHost(Protocol):
    """What the filler needs from its session."""

    config: SessionConfig
    log: logging.LoggerAdapter

    @property
    def response(self) -> Response | None: ...

    @property
    def barge_in(self) -> Any: ...

    def start_response(self, turn_end_at: float | None = None, spec: ResponseSpec | None = None,
                       input_items: list[Item] | None = None) -> None: ...

    def history_request(self, spec: ResponseSpec) -> OmniRequest:
        """The pipeline request that answers the history as ``spec`` says."""


@dataclass(frozen=True)
class Deferred:
    """A client's ``response.create`` held until the filler is done."""

    spec: ResponseSpec
    input_items: list[Item] | None


def _client_waits(call: FunctionCall) -> bool:
    """Whether the client runs ``call`` and its output has not come: MCP calls are the server's to
    run, and an approval request waits for the client's decision, not for a lookup."""
    return call.output is None and not isinstance(call, McpCall | McpApprovalRequest)


class CallWait:
    """See module doc."""

    def __init__(self, host: CallWaitHost, defaults: SessionDefaults) -> None:
        self._host: CallWaitHost | None = host  # None once closed: no reference back to it
        self._text = defaults.call_filler_text
        self._after_ms = defaults.call_filler_after_ms
        self._position = 0  # the caller's stream, ms (the last window seen)
        self._waiting: dict[str, int] = {}  # call_id -> where its wait began, ms
        self._filler: Response | None = None
        self._deferred: Deferred | None = None
        self._mcp: tuple[Response, int] | None = None  # a response running an MCP call, since when

    def _say(self) -> ResponseSpec:
        """The filler's response options: the session's, asked to say the filler."""
        assert self._host is not None and self._text is not None
        spec = ResponseSpec.of_session(self._host.config)
        return replace(spec, instructions=say_exactly(spec.instructions, self._text), say=self._text)

    def step(self, position_ms: int, in_speech: bool) -> None:
        """One window of the caller's audio was heard (``position_ms``: the stream's end)."""
        self._position = position_ms
        host = self._host
        if host is None or in_speech or host.barge_in is not None:
            return
        if self._mcp is not None:
            self._mcp_step(host, position_ms)
        if not self._waiting or host.response is not None:
            return
        if position_ms - min(self._waiting.values()) < self._after_ms:
            return
        calls = list(self._waiting)
        self._waiting.clear()  # said once for the calls waiting now
        assert self._text is not None  # nothing waits without a filler (response_done)
        host.log.info("function call %s still running after %d ms: saying the filler",
                      ", ".join(calls), self._after_ms)
        host.start_response(spec=self._say())
        self._filler = host.response

    def _mcp_step(self, host: CallWaitHost, position_ms: int) -> None:
        assert self._mcp is not None
        response, since = self._mcp
        if host.response is not response:  # cancelled, or over: its call_ended comes
            return
        if position_ms - since < self._after_ms:
            return
        self._mcp = None
        host.log.info("MCP call of response %s still running after %d ms: saying the filler",
                      response.id, self._after_ms)
        response.say_filler(host.history_request(self._say()))

    def mcp_call_began(self, response: Response) -> None:
        """``response`` runs an MCP call now. Where it said nothing yet, it says the filler when
        the call is slow (module doc)."""
        if self._text is not None and response.speaks and not response.said_anything:
            self._mcp = (response, self._position)

    def mcp_call_ended(self, response: Response) -> None:
        """``response``'s MCP call is over (done, failed or cancelled): no filler for it."""
        if self._mcp is not None and self._mcp[0] is response:
            self._mcp = None

    def response_done(self, response: Response) -> Deferred | None:
        """``response.done`` went out. A response that ended with a client's function call begins
        its wait; the filler's end gives back the ``response.create`` held meanwhile, to start."""
        if response is self._filler:
            self._filler = None
            deferred, self._deferred = self._deferred, None
            return deferred
        for call_id in self._waiting:  # the agent spoke meanwhile: the silence starts again
            self._waiting[call_id] = self._position
        call = response.call.call if response.call is not None else None
        if (self._text is not None and call is not None and _client_waits(call)
                and not response.call_answered_by_server
                and response.generation_done and response.cancel_reason is None):
            self._waiting[call.call_id] = self._position
        return None

    def output_came(self, call_id: str) -> None:
        """The client gave the call's output: no filler for it."""
        self._waiting.pop(call_id, None)

    def defer(self, spec: ResponseSpec, input_items: list[Item] | None) -> bool:
        """Hold a client's ``response.create`` while the filler is said; False where there is no
        filler in flight, or a response already waits for it."""
        if self._filler is None or self._host is None or self._host.response is not self._filler \
                or self._deferred is not None:
            return False
        self._deferred = Deferred(spec, input_items)
        return True

    def close(self) -> None:
        """The session closed: nothing waits, and nothing refers back to it (the session owns
        this: a cycle would keep it until the garbage collector runs)."""
        self._waiting.clear()
        self._filler = None
        self._deferred = None
        self._mcp = None
        self._host = None
