"""``toy``: a deterministic stand-in model with Qwen3-Omni's stage shape and next to no compute.

It exists to test and measure the framework itself (pipeline core, session layer) apart from model
compute, which the real model (``qwen3_omni``) would dominate: a thinker that "answers" with a fixed
number of token ids and hidden vectors, a text detokenizer, a talker that turns each token into codec
frames, and a vocoder that turns each frame into 80 ms of an audible tone with carried phase (causal
state). Answers are pure functions of the input, so tests can predict them.

Failure injection through request params (tests only): ``toy_fail`` = a stage name whose runner
raises for that request; ``toy_never_stop`` makes the thinker and talker ignore their stop condition
(the output caps must end them); ``toy_answer_tokens`` overrides the answer length.

Function calls: with ``tools`` and a ``tool_choice`` that forces a call (``required``, or a named
function), the answer is that call instead of words: ``function_call`` chunks of
``{"name", "arguments"}`` (argument deltas that join into ``{"words": "..."}``, the words the answer
would have said), and no audio. Frameworks offer tools with ``tool_choice`` "auto", which the toy
ignores unless its thinker stage has the option ``call_offered_tools: true``: then it calls the
first offered tool whenever the turn to answer is the user's (the last message is a user message
that is not a function's result), and answers in words, with audio, when the turn to answer is a
function's result (or anything else). Tools offered to the toy this way take a ``words`` string.
The thinker makes the choice; its output carries ``call`` (the function's name) to the detokenizer
and the talker, which turn the answer into argument deltas and stay silent.

The factories import the runners (and torch, for the tensors the thinker and talker pass on) when
called, as the other model sets' do: the server's own process registers the model and never runs
a stage of it in process mode, and a toy server starts ~1.5 s sooner without torch there.
"""

from __future__ import annotations

from typing import Any

from pipeline.models import ModelSpec, StageContext, register
from pipeline.proto import StagePayload

SAMPLE_RATE = 24000


def make_thinker(ctx: StageContext) -> Any:
    from pipeline.models.toy.runners import ToyThinker

    return ToyThinker(ctx)


def make_detok(ctx: StageContext) -> Any:
    from pipeline.models.toy.runners import ToyDetok

    return ToyDetok(ctx)


def make_talker(ctx: StageContext) -> Any:
    from pipeline.models.toy.runners import ToyTalker

    return ToyTalker(ctx)


def make_vocoder(ctx: StageContext) -> Any:
    from pipeline.models.toy.runners import ToyVocoder

    if ctx.stage.options.get("fail_to_load"):
        raise RuntimeError("injected load failure")
    return ToyVocoder(ctx)


def make_relay(ctx: StageContext) -> Any:
    from pipeline.models.toy.runners import ToyRelay

    return ToyRelay(ctx)


def merge_join(parts: dict[str, StagePayload]) -> StagePayload:
    """Fan-in: the union of the sources' data (later sources in name order win on clashes)."""
    first = next(iter(parts.values()))
    data: dict[str, Any] = {}
    for source in sorted(parts):
        data.update(parts[source].data)
    data["joined_from"] = sorted(parts)
    return StagePayload(first.request_id, data, first.params)


SPEC = register(
    ModelSpec(
        name="toy",
        factories={
            "thinker": make_thinker,
            "detok": make_detok,
            "talker": make_talker,
            "vocoder": make_vocoder,
            "relay": make_relay,
        },
        merges={"join": merge_join},
        output_sample_rate=SAMPLE_RATE,
    )
)
