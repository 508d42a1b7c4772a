"""Driving the offline ``lm`` stage's runner in-process, as the ``ar`` scheduler does, for tests
that check what it answers: a slot per request, and stepping slots together until each ends."""

from __future__ import annotations

from typing import Any

from pipeline.proto import StagePayload
from pipeline.scheduling.base import ARSlot


def lm_slot(runner: Any, request_id: str, messages: list[dict[str, str]], cap: int = 48,
            params: dict[str, Any] | None = None) -> ARSlot:
    """A request of ``messages`` (``{"role", "text"}``) for ``runner``, its input complete."""
    payload = StagePayload(request_id, {"messages": messages}, params=dict(params or {}))
    return ARSlot(request_id, payload.params, runner.new_state(payload), cap, input_closed=True)


def answer(runner: Any, slots: list[ARSlot]) -> list[tuple[list[int], str]]:
    """Step the slots together until each has finished (and is released): each slot's token ids
    and the text its steps streamed."""
    texts = {slot.request_id: "" for slot in slots}
    answers = {}
    running = list(slots)
    while running:
        for slot, result in zip(running, runner.step(running), strict=True):
            slot.steps += 1
            texts[slot.request_id] += (result.data or {}).get("text", "")
            if result.finished or slot.steps >= slot.cap:
                answers[slot.request_id] = (list(slot.state.ids), texts[slot.request_id])
                runner.release(slot)
        running = [slot for slot in running if slot.state is not None]
    return [answers[slot.request_id] for slot in slots]
