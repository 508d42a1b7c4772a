"""The toy model's runners (see the package docstring). Per-request state lives in ARSlot.state or
the vocoder state the schedulers own; runners keep nothing per request themselves."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pipeline.models import StageContext
from pipeline.models.toy import SAMPLE_RATE
from pipeline.proto import StagePayload
from pipeline.scheduling.base import ARSlot, ARStepResult, BatchItem, RequestError

FRAME_SAMPLES = 1920  # 80 ms at 24 kHz, like Qwen3-Omni's code2wav
CODEBOOKS = 16


def _check_fail(stage: str, request_id: str, params: dict[str, Any]) -> None:
    if params.get("toy_fail") == stage:
        raise RequestError(request_id, f"injected failure in stage {stage}")


def input_seed(inputs: dict[str, Any]) -> int:
    """The seed of a request's answer: a pure function of the turn it answers (the last message)."""
    last = inputs["messages"][-1]
    if last.get("audio") is not None:
        return int(len(last["audio"])) % 997
    return sum(str(last.get("text") or "").encode()) % 997


def answer_token(seed: int, k: int) -> int:
    return (seed * 31 + k * 7) % 1000


def forced_call(params: dict[str, Any]) -> str | None:
    """The function the request forces the model to call (``tool_choice`` "required": the first
    tool; ``{"type": "function", "name"}``: that one), or None."""
    tools, choice = params.get("tools") or [], params.get("tool_choice")
    if not tools:
        return None
    if choice == "required":
        return str(tools[0]["name"])
    return str(choice["name"]) if isinstance(choice, dict) else None


def chosen_call(
    inputs: dict[str, Any], params: dict[str, Any], call_offered_tools: bool
) -> str | None:
    """The function the toy calls instead of answering in words, or None (see the package
    docstring): a forced call always; with ``call_offered_tools`` and ``tool_choice`` "auto", the
    first offered tool when the turn to answer is the user's own (not a function's result)."""
    forced = forced_call(params)
    if forced is not None or not call_offered_tools:
        return forced
    tools, last = params.get("tools") or [], inputs["messages"][-1]
    if tools and params.get("tool_choice", "auto") == "auto" and last["role"] == "user" \
            and last.get("tool_result") is None:
        return str(tools[0]["name"])
    return None


@dataclass
class _ThinkerState:
    seed: int
    answer_tokens: int
    never_stop: bool
    call: str | None  # the function this answer calls (its tokens are the call's arguments)


class _ToyAR:
    """What the toy's autoregressive runners share: a simulated step time, one result per slot."""

    def __init__(self, ctx: StageContext) -> None:
        self._stage = ctx.stage.name
        self._step_delay_s = float(ctx.stage.options.get("step_delay_s", 0.0))

    def step(self, slots: list[ARSlot]) -> list[ARStepResult]:
        if self._step_delay_s:
            time.sleep(self._step_delay_s)  # stands in for a model's forward pass
        results = []
        for slot in slots:
            _check_fail(self._stage, slot.request_id, slot.params)
            results.append(self._step_one(slot))
        return results

    def _step_one(self, slot: ARSlot) -> ARStepResult:
        raise NotImplementedError

    def release(self, slot: ARSlot) -> None:
        slot.state = None


class ToyThinker(_ToyAR):
    def __init__(self, ctx: StageContext) -> None:
        super().__init__(ctx)
        self._answer_tokens = int(ctx.stage.options.get("answer_tokens", 8))
        self._hidden_size = int(ctx.stage.options.get("hidden_size", 1024))
        self._call_offered_tools = bool(ctx.stage.options.get("call_offered_tools", False))

    def new_state(self, payload: StagePayload) -> _ThinkerState:
        messages = payload.data.get("messages") or []
        if not messages or (messages[-1].get("audio") is None and not messages[-1].get("text")):
            raise RequestError(payload.request_id, "the last message has neither audio nor text")
        return _ThinkerState(
            seed=input_seed(payload.data),
            answer_tokens=int(payload.params.get("toy_answer_tokens", self._answer_tokens)),
            never_stop=bool(payload.params.get("toy_never_stop", False)),
            call=chosen_call(payload.data, payload.params, self._call_offered_tools),
        )

    def feed(self, slot: ARSlot, payload: StagePayload) -> None:
        raise RequestError(slot.request_id, "the thinker takes no streamed input")

    def close_input(self, slot: ARSlot, payload: StagePayload) -> None:
        raise RequestError(slot.request_id, "the thinker takes no streamed input")

    def runnable(self, slot: ARSlot) -> bool:
        return slot.input_closed

    def output_cap(self, slot: ARSlot) -> int | None:
        return None

    def _step_one(self, slot: ARSlot) -> ARStepResult:
        state: _ThinkerState = slot.state
        token = answer_token(state.seed, slot.steps)
        hidden = torch.full((self._hidden_size,), float(token), dtype=torch.float32)
        last = slot.steps + 1 >= state.answer_tokens and not state.never_stop
        data = {"token_id": token, "hidden": hidden, "step": slot.steps}
        return ARStepResult(self._with_call(data, state), finished=last)

    def finish(self, slot: ARSlot, capped: bool) -> dict[str, Any] | None:
        return self._with_call({"tokens": slot.steps, "capped": capped}, slot.state)

    @staticmethod
    def _with_call(data: dict[str, Any], state: _ThinkerState) -> dict[str, Any]:
        """``data`` marked with the call the answer makes: the detokenizer and the talker downstream
        see only the thinker's output, as a real model's stages do, not its input messages."""
        return data if state.call is None else {**data, "call": state.call}


class ToyDetok:
    def __init__(self, ctx: StageContext) -> None:
        self._stage = ctx.stage.name

    def run(self, batch: list[BatchItem]) -> list[dict[str, Any]]:
        out = []
        for item in batch:
            _check_fail(self._stage, item.payload.request_id, item.payload.params)
            token = item.payload.data.get("token_id")
            call = item.payload.data.get("call")
            if call is None:
                out.append({"text": "" if token is None else f"w{token} "})
            elif token is None:
                out.append({"function_call": {"name": call, "arguments": '"}'}})
            else:
                first = item.payload.data.get("step") == 0
                piece = f'{{"words": "w{token}' if first else f" w{token}"
                out.append({"function_call": {"name": call, "arguments": piece}})
        return out


@dataclass
class _TalkerState:
    tokens: list[int] = field(default_factory=list)
    frames: int = 0
    never_stop: bool = False


class ToyTalker(_ToyAR):
    def __init__(self, ctx: StageContext) -> None:
        super().__init__(ctx)
        self._frames_per_token = int(ctx.stage.options.get("frames_per_token", 3))

    def new_state(self, payload: StagePayload) -> _TalkerState:
        return _TalkerState(never_stop=bool(payload.params.get("toy_never_stop", False)))

    def feed(self, slot: ARSlot, payload: StagePayload) -> None:
        if payload.data.get("call") is None:  # a function call is not spoken
            slot.state.tokens.append(int(payload.data["token_id"]))

    def close_input(self, slot: ARSlot, payload: StagePayload) -> None:
        """The thinker's final payload carries no token; the talker voices what it has."""

    def _owed(self, state: _TalkerState) -> int:
        return len(state.tokens) * self._frames_per_token - state.frames

    def runnable(self, slot: ARSlot) -> bool:
        state: _TalkerState = slot.state
        return self._owed(state) > 0 or slot.input_closed or state.never_stop and bool(state.tokens)

    def output_cap(self, slot: ARSlot) -> int | None:
        """Frames tied to the text voiced so far: a runaway talker stops."""
        return len(slot.state.tokens) * self._frames_per_token + 1

    def _step_one(self, slot: ARSlot) -> ARStepResult:
        state: _TalkerState = slot.state
        if self._owed(state) <= 0 and not state.never_stop:
            return ARStepResult(None, finished=True)
        token = state.tokens[min(state.frames // self._frames_per_token, len(state.tokens) - 1)]
        codes = torch.tensor([(token + i * 13 + state.frames) % 2048 for i in range(CODEBOOKS)])
        state.frames += 1
        return ARStepResult({"codes": codes})

    def finish(self, slot: ARSlot, capped: bool) -> dict[str, Any] | None:
        return {"frames": slot.state.frames, "capped": capped}


@dataclass
class _VocoderState:
    phase: float = 0.0
    frames: int = 0


class ToyVocoder:
    def __init__(self, ctx: StageContext) -> None:
        self._stage = ctx.stage.name
        self._amplitude = float(ctx.stage.options.get("amplitude", 0.3))

    def new_state(self, payload: StagePayload) -> _VocoderState:
        _check_fail(self._stage, payload.request_id, payload.params)
        return _VocoderState()

    def decode(self, state: _VocoderState, chunks: list[dict[str, Any]], final: bool) -> dict[str, Any]:
        pieces = []
        for chunk in chunks:
            if "codes" not in chunk:
                continue
            freq = 200.0 + float(chunk["codes"][0]) % 400
            step = 2 * np.pi * freq / SAMPLE_RATE
            phases = state.phase + step * np.arange(1, FRAME_SAMPLES + 1)
            pieces.append((self._amplitude * np.sin(phases)).astype(np.float32))
            state.phase = float(phases[-1] % (2 * np.pi))
            state.frames += 1
        audio = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)
        return {"audio": audio, "sample_rate": SAMPLE_RATE}

    def release(self, state: _VocoderState) -> None:
        state.frames = 0


class ToyRelay:
    """Passes data through (trivial compute), for chains that measure the framework's own cost.

    Each relay stamps ``via_<stage>`` with the ``time.perf_counter()`` at which it ran: Linux's
    monotonic clock is shared by every process of the machine, so stamps from stage processes
    compare, and their differences are the hops between stages.
    """

    def __init__(self, ctx: StageContext) -> None:
        self._stage = ctx.stage.name

    def run(self, batch: list[BatchItem]) -> list[dict[str, Any]]:
        for item in batch:
            _check_fail(self._stage, item.payload.request_id, item.payload.params)
        stamp = {f"via_{self._stage}": time.perf_counter()}
        return [dict(item.payload.data, **stamp) for item in batch]
