"""The ``transfer_call`` tool on its own (duplex/tools/transfer_call.py), against a fake
transferable call that records what it was asked: what the model is offered, which arguments start
a transfer, and the output each outcome gives. The same tool on a real call, with sipp as the
caller's PBX, is tests/operators/test_transfer_call.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import ValidationError

from duplex.settings import ServerSettings, TransferCallSettings
from duplex.tools import transfer_call
from duplex.tools.transfer_call import TransferCall, TransferImpossible

DESK, SALES = "sip:desk@pbx.example", "tel:+14155550123"
SETTINGS = TransferCallSettings(enabled=True, targets={
    "desk": {"uri": DESK, "description": "the front desk"}, "sales": SALES})


class FakeCall:
    """A fake TransferableCall: keeps each transfer's target and progress listener."""

    def __init__(self, refuse: str | None = None) -> None:
        self.transfers: list[tuple[str, Callable[[int, str, str], None]]] = []
        self._refuse = refuse

    def transfer(self, target_uri: str, on_progress: Callable[[int, str, str], None]) -> None:
        if self._refuse is not None:
            raise TransferImpossible(self._refuse)
        self.transfers.append((target_uri, on_progress))


def run(tool: TransferCall, arguments: str) -> list[tuple[dict[str, Any], bool]]:
    answers: list[tuple[dict[str, Any], bool]] = []
    tool.run(arguments, lambda output, reply: answers.append((json.loads(output), reply)))
    return answers


def test_the_model_is_offered_the_targets_by_name_never_their_uris() -> None:
    tool = TransferCall(SETTINGS, FakeCall(), {})
    client = [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}]
    tools, choice = tool.offered(client, "auto")
    assert [t["name"] for t in tools] == ["lookup", "transfer_call"] and choice == "auto"
    definition = tools[1]
    assert definition["parameters"]["properties"]["target"]["enum"] == ["desk", "sales"]
    assert definition["parameters"]["required"] == ["target"]
    assert "the front desk" in definition["description"]
    assert DESK not in json.dumps(definition) and SALES not in json.dumps(definition)
    # A client's own function of that name is the client's: the server's is not offered.
    mine = [{"type": "function", "name": "transfer_call"}]
    assert tool.offered(mine, "required") == (mine, "required") and not tool.offers(mine)


async def test_a_named_target_is_referred_and_its_outcome_is_the_output() -> None:
    call = FakeCall()
    tool = TransferCall(SETTINGS, call, {})
    answers = run(tool, '{"target": "sales", "reason": "wants a quote"}')
    ((uri, progress),) = call.transfers
    assert uri == SALES and answers == []
    progress(202, "Accepted", "pending")
    progress(180, "Ringing", "pending")
    assert answers == []
    progress(486, "Busy Here", "failed")
    progress(486, "Busy Here", "failed")  # told once
    assert answers == [({"status": "failed", "target": "sales", "sip_status": 486,
                         "sip_reason": "Busy Here"}, True)]
    answers = run(tool, '{"target": "desk"}')
    call.transfers[-1][1](200, "OK", "completed")
    assert answers == [({"status": "completed", "target": "desk", "sip_status": 200,
                         "sip_reason": "OK"}, False)]  # the caller is gone: nothing to say


@pytest.mark.parametrize("arguments", [
    '{"target": "nowhere"}', '{"target": "sip:evil@attacker.example"}', '{"target": 7}', "{}",
    '{"words": "w1 w2"}', "[]", "not json", '"desk"'])
async def test_arguments_that_name_no_target_send_nothing(arguments: str) -> None:
    call = FakeCall()
    answers = run(TransferCall(SETTINGS, call, {}), arguments)
    assert call.transfers == []
    ((output, reply),) = answers
    assert output["status"] == "error" and reply


async def test_with_one_target_the_name_may_be_left_out() -> None:
    call = FakeCall()
    tool = TransferCall(TransferCallSettings(enabled=True, targets={"desk": DESK}), call, {})
    assert tool.definition()["parameters"]["required"] == []
    run(tool, '{"words": "w1 w2"}')
    assert [uri for uri, _ in call.transfers] == [DESK]
    assert run(tool, '{"target": "sales"}')[0][0]["status"] == "error"


async def test_a_call_that_cannot_be_transferred_now_is_an_error() -> None:
    answers = run(TransferCall(SETTINGS, FakeCall(refuse="a transfer is under way"), {}),
                  '{"target": "desk"}')
    assert answers == [({"status": "error", "error": "the call cannot be transferred now: a "
                         "transfer is under way"}, True)]


async def test_no_outcome_in_time_is_pending(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfer_call, "OUTCOME_WAIT_S", 0.05)
    call = FakeCall()
    answers = run(TransferCall(SETTINGS, call, {}), '{"target": "desk"}')
    call.transfers[0][1](202, "Accepted", "pending")
    await asyncio.sleep(0.1)
    assert answers == [({"status": "pending", "target": "desk", "sip_status": 202,
                         "sip_reason": "Accepted"}, False)]
    call.transfers[0][1](200, "OK", "completed")  # too late: the output was given
    assert len(answers) == 1


@pytest.mark.parametrize("section", [
    {"enabled": True}, {"targets": {"a b": DESK}}, {"targets": {"desk": "http://pbx.example"}},
    {"targets": {"desk": "sip:desk@pbx>\r\nX-Evil: 1"}}, {"targets": {"desk": {"url": DESK}}}])
def test_presets_name_targets_a_refer_can_carry(section: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        ServerSettings(preset="t", transfer_call=section)
    assert not ServerSettings(preset="t").transfer_call.enabled  # off by default


async def test_a_closed_tool_lets_go_of_its_call() -> None:
    call = FakeCall()
    tool = TransferCall(SETTINGS, call, {})
    tool.close()
    assert run(tool, '{"target": "desk"}') == [
        ({"status": "error", "error": "the call cannot be transferred now: the call has ended"}, True)]
    assert call.transfers == []
