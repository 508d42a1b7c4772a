"""Which calls the filler waits on (duplex/session/call_wait.py): only a client's function whose
output has not come. The server gives the output of its own calls (an MCP tool's, the transport's
``transfer_call``) and an approval request waits for a decision, not a lookup: after any of those
the caller's silence gets no "one moment". A :class:`CallWait` with a stand-in session (the
filler's host: the real session config, a recorder for the responses it would start) and stand-in
responses (the few fields the wait reads).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from duplex.protocol.response_create import ResponseSpec
from duplex.session.call_wait import CallWait
from duplex.session.history import FunctionCall, Item
from duplex.settings import SessionDefaults
from duplex.tools.mcp_items import McpApprovalRequest, McpCall

AFTER_MS = 400


@dataclass
class Host:
    """The session, as the filler sees it: idle, nobody talking."""

    config: Any = field(default_factory=lambda: SessionDefaults().session_config("websocket"))
    log: logging.LoggerAdapter = field(default_factory=lambda: logging.LoggerAdapter(
        logging.getLogger(__name__), {}))
    response: Any = None
    barge_in: Any = None
    started: list[ResponseSpec] = field(default_factory=list)

    def start_response(self, turn_end_at: float | None = None, spec: ResponseSpec | None = None,
                       input_items: list[Item] | None = None) -> None:
        assert spec is not None
        self.started.append(spec)

    def history_request(self, spec: ResponseSpec) -> Any:
        raise AssertionError("no MCP call runs here")


@pytest.mark.parametrize(("call", "by_server", "filler"), [
    (FunctionCall("call_1", "find_order"), False, True),
    (FunctionCall("call_1", "transfer_call"), True, False),
    (McpCall("call_1", "lookup", server_label="tools"), False, False),
    (McpApprovalRequest("call_1", "lookup", server_label="tools"), False, False),
], ids=["client function", "server function", "mcp call", "approval request"])
def test_only_a_client_functions_wait_gets_the_filler(call: FunctionCall, by_server: bool,
                                                      filler: bool) -> None:
    host = Host()
    wait = CallWait(host, SessionDefaults(call_filler_text="One moment.", call_filler_after_ms=AFTER_MS))
    response = SimpleNamespace(call=Item("item_1", "assistant", call=call), call_answered_by_server=by_server,
                               generation_done=True, cancel_reason=None)
    assert wait.response_done(response) is None  # type: ignore[arg-type]
    wait.step(AFTER_MS // 2, in_speech=False)
    assert host.started == []
    wait.step(2 * AFTER_MS, in_speech=False)
    assert [spec.say for spec in host.started] == (["One moment."] if filler else [])
