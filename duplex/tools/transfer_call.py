"""The built-in ``transfer_call`` tool: the model hands a phone call on to a target the preset names.

The preset's ``transfer_call:`` section (``TransferCallSettings`` in duplex/settings.py) enables
it and names the targets: a name for the model, a ``sip:``/``sips:``/``tel:`` URI for the REFER,
and a description to choose by. The model is offered a function tool ``transfer_call`` whose
``target`` is one of those names (with one target it may be left out) and whose ``reason`` is
logged; it never sees a URI and cannot give one.

Who offers it: a transport whose call can be transferred implements :class:`TransferableCall`
(the SIP transport: a REFER in the call's dialog, the code path ``/refer`` takes, with its
``call.transfer.*`` events). Its session offers the tool beside the client's tools, where the
response's tool choice is not ``none`` and no client function (or MCP tool) has the same name, and
runs the model's calls of it itself (duplex/session/response_call.py). WebRTC, WebSocket and
Twilio calls have no such transport: their models are never offered the tool.

On the wire the call is a ``function_call`` item, as a client's; the server answers it itself
with a ``function_call_output`` item (a client must not). Its ``output`` is JSON text:

- ``{"status": "completed", "target": "desk", "sip_status": 200, "sip_reason": "OK"}``: the
  caller now talks to the target (a 2xx sipfrag; the call then ends);
- ``{"status": "failed", "target": ..., "sip_status": 486, "sip_reason": "Busy Here"}``: the
  REFER was refused or unanswered, or the target's call failed; the call goes on with the agent;
- ``{"status": "pending", "target": ..., ...}``: no final outcome within :data:`OUTCOME_WAIT_S`
  (the last status so far); the ``call.transfer.*`` events tell the rest;
- ``{"status": "error", "error": "..."}``: nothing was sent (an unknown target, arguments that are
  no JSON object, a call that cannot be transferred now).

A :class:`TransferCall` belongs to one call and lives as long as it; ``close`` when it ends lets
go of the call (the call's session holds the tool: no reference cycle keeps either).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from duplex.settings import TransferCallSettings

NAME = "transfer_call"
OUTCOME_WAIT_S = 60.0
"""How long the model's call waits for the transfer's outcome before it is answered ``pending``:
a target rings 30-40 s before a PBX gives up, and the REFER itself times out at 32 s."""
MAX_REASON_CHARS = 500

log = logging.getLogger(__name__)


class TransferImpossible(Exception):
    """The call cannot be transferred now (not answered yet, or a transfer is under way)."""


class TransferableCall(Protocol):
    """A call its transport can hand on (the SIP transport's ``SipSessionCall``)."""

    def transfer(self, target_uri: str, on_progress: Callable[[int, str, str], None]) -> None:
        """Ask the caller's side to call ``target_uri`` instead. ``on_progress(status, reason,
        outcome)`` gets each status of the transfer in order (``outcome`` "pending", then
        "completed" or "failed"), after the transport reported it to the client itself. Raises
        :class:`TransferImpossible` when no transfer can start; nothing is sent then."""


def _output(status: str, **fields: Any) -> str:
    return json.dumps({"status": status, **fields})


class TransferCall:
    """The tool for one call (module doc)."""

    name = NAME

    def __init__(self, settings: TransferCallSettings, call: TransferableCall,
                 log_extra: dict[str, str]) -> None:
        self._targets = settings.targets
        self._call = call
        self._waits: set[asyncio.TimerHandle] = set()
        self.log = logging.LoggerAdapter(log, log_extra)

    def definition(self) -> dict[str, Any]:
        """The function tool the model is offered."""
        names = list(self._targets)
        listed = "; ".join(f"{name}: {t.description}" if t.description else name
                           for name, t in self._targets.items())
        target: dict[str, Any] = {"type": "string", "enum": names,
                                  "description": "where to transfer the caller, by name"}
        return {
            "type": "function", "name": NAME,
            "description": "Transfer this phone call to a person or department; the caller then "
                           "talks to them, not to you. Tell the caller you are transferring them "
                           f"before you call this. Targets: {listed}.",
            "parameters": {"type": "object", "properties": {
                "target": target,
                "reason": {"type": "string", "description": "why, in a few words"},
            }, "required": ["target"] if len(names) > 1 else []},
        }

    def offered(self, functions: list[dict[str, Any]],
                choice: str | dict[str, Any]) -> tuple[list[dict[str, Any]], str | dict[str, Any]]:
        """The tools a response offers the model (``functions``: the client's, and its MCP
        servers'), this one added unless one of them has its name."""
        if not self.offers(functions):
            return functions, choice
        return [*functions, self.definition()], choice

    @staticmethod
    def offers(tools: list[dict[str, Any]] | tuple[dict[str, Any], ...]) -> bool:
        """Whether this tool is offered beside ``tools``: a client's function of the same name
        is the client's to run."""
        return not any(t.get("type", "function") == "function" and t.get("name") == NAME
                       for t in tools)

    def run(self, arguments: str, answered: Callable[[str, bool], None]) -> None:
        """The model called the tool with ``arguments``: start the transfer. ``answered(output,
        reply)`` gets the call's output once: at once when nothing could be sent, else at the
        outcome or after :data:`OUTCOME_WAIT_S` (module doc); ``reply``: the model should tell
        the caller now (an error, a failed transfer), not when the caller is gone or on hold."""
        try:
            args = json.loads(arguments or "{}")
        except ValueError:
            args = None
        if not isinstance(args, dict):
            return answered(_output("error", error="the arguments are not a JSON object"), True)
        name = args.get("target")
        if name is None and len(self._targets) == 1:
            name = next(iter(self._targets))
        if not isinstance(name, str) or name not in self._targets:
            known = ", ".join(self._targets)
            self.log.info("transfer_call to an unknown target %.64r: nothing sent", name)
            return answered(_output("error", error=f"no target named {name!r}: the targets are {known}"),
                            True)
        reason = str(args.get("reason") or "")[:MAX_REASON_CHARS]
        uri = self._targets[name].uri
        told = False
        last: dict[str, Any] = {}

        def tell(status: str, **fields: Any) -> None:
            nonlocal told
            if not told:
                told = True
                wait.cancel()
                self._waits.discard(wait)
                answered(_output(status, **fields), status in ("failed", "error"))

        def progress(status: int, sip_reason: str, outcome: str) -> None:
            last.update(sip_status=status, sip_reason=sip_reason)
            if outcome != "pending":
                tell(outcome, target=name, **last)

        wait = asyncio.get_running_loop().call_later(
            OUTCOME_WAIT_S, lambda: tell("pending", target=name, **last))
        self._waits.add(wait)
        self.log.info("the model transfers the call to %s (%s)%s", name, uri,
                      f": {reason!r}" if reason else "")  # the model's words: quoted
        try:
            self._call.transfer(uri, progress)
        except TransferImpossible as err:
            tell("error", error=f"the call cannot be transferred now: {err}")

    def close(self) -> None:
        """The call ended: no output waits any more, and the tool lets go of the call."""
        for wait in self._waits:
            wait.cancel()
        self._waits.clear()
        self._call = _Ended()


class _Ended:
    """The call of a closed tool."""

    def transfer(self, target_uri: str, on_progress: Callable[[int, str, str], None]) -> None:
        raise TransferImpossible("the call has ended")
