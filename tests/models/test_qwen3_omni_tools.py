"""Function calling on Qwen3-Omni: the prompt Qwen's template writes for tools, calls and results;
the answer's stream split into words and one call; and the tiny preset's stages end to end.

The tiny checkpoint's own chat template has no tools support (``synthetic.CHAT_TEMPLATE``), so the
prompt is checked against the text Qwen3's template writes, spelled out here. The pipeline tests
script the thinker's tokens (random weights never write a call by themselves) and run the real
runners and schedulers of every stage (``staged.py``).
"""

from __future__ import annotations

from typing import Any

import pytest

from pipeline.config import PipelineConfig, parse_pipeline_config, read_yaml
from pipeline.models.qwen3_omni import thinker as thinker_module
from pipeline.models.qwen3_omni.call_parser import CallParser, Parsed
from pipeline.models.qwen3_omni.preprocess import Preprocessor
from pipeline.models.qwen3_omni.tools import call_opening
from pipeline.proto import OmniRequest, StagePayload
from pipeline.scheduling.base import BatchItem
from tests.models.cases import user
from tests.models.conftest import TINY_PRESET
from tests.models.staged import Staged

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
CLOCK = {"type": "function", "name": "get_time"}
SECTION = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "The weather in a '
    'city.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}\n'
    '{"type": "function", "function": {"name": "get_time"}}\n</tools>\n\n'
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call>"
)


def config(thinker_tokens: int) -> PipelineConfig:
    """The tiny preset with the thinker's token cap at ``thinker_tokens``."""
    data = read_yaml(TINY_PRESET)["pipeline"]
    for stage in data["stages"]:
        if stage["name"] == "thinker":
            stage["max_new_tokens"] = thinker_tokens
    return parse_pipeline_config(data)


@pytest.fixture(scope="module")
def staged() -> Staged:
    return Staged(config(thinker_tokens=120))


def prompt(pre: Preprocessor, messages: list[dict[str, Any]], params: dict[str, Any]) -> str:
    out = pre.run([BatchItem(StagePayload("r", {"messages": messages}, params), final=True)])[0]
    return pre.tokenizer.decode(out["input_ids"])


# -- the prompt -----------------------------------------------------------------------------------

def test_tools_calls_and_results_render_as_qwen_writes_them(staged: Staged) -> None:
    pre = staged.runners["preprocessing"]
    call = {"call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    messages = [
        {"role": "system", "text": "Be brief."},
        user(text="Weather in Paris and Rome?"),
        {"role": "assistant", "text": "(fallback)", "words": "Let me see.", "tool_calls": [
            call, {**call, "call_id": "c2", "arguments": '{"city": "Rome"}'}]},
        {"role": "user", "text": "(fallback)", "tool_result": {"call_id": "c1", "output": "sunny"}},
        {"role": "user", "text": "(fallback)", "tool_result": {"call_id": "c2", "output": "rain"}},
    ]
    assert prompt(pre, messages, {"tools": [WEATHER, CLOCK], "tool_choice": "auto"}) == (
        f"<|im_start|>system\nBe brief.\n\n{SECTION}<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        "<|im_start|>assistant\nLet me see.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nrain\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # No system message: the tools section is the system turn. A resumed conversation's kept
    # state already holds it, and tool_choice "none" offers nothing.
    question = [user(text="Hi")]
    assert prompt(pre, question, {"tools": [WEATHER, CLOCK]}).startswith(
        f"<|im_start|>system\n{SECTION}<|im_end|>\n<|im_start|>user\nHi")
    resumed = {"tools": [WEATHER], "conversation": {"id": "c", "resume": True}}
    offered_none = {"tools": [WEATHER], "tool_choice": "none"}
    for params in (resumed, offered_none, {}):
        assert prompt(pre, question, params) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(("tools", "choice", "opening"), [
    ([WEATHER, CLOCK], {"type": "function", "name": "get_time"},
     '<tool_call>\n{"name": "get_time", "arguments": '),
    ([WEATHER], "required", '<tool_call>\n{"name": "get_weather", "arguments": '),
    ([WEATHER, CLOCK], "required", '<tool_call>\n{"name": "'),  # the model picks the function
    ([WEATHER, CLOCK], "auto", ""),
])
def test_a_forced_call_opens_the_assistant_turn(staged: Staged, tools: list, choice: Any,
                                                opening: str) -> None:
    pre = staged.runners["preprocessing"]
    text = prompt(pre, [user(text="Hi")], {"tools": tools, "tool_choice": choice})
    assert text.endswith("<|im_start|>assistant\n" + opening)


def test_bad_tools_fail_the_request_with_words(staged: Staged) -> None:
    staged.submit(OmniRequest("bad", {"messages": [user(text="Hi")]},
                              {"tools": [{"type": "function"}], "tool_choice": "auto"}))
    assert staged.run()["bad"].error == "preprocessing: each tool needs a name"


# -- the stream parser -------------------------------------------------------------------------------

def parse(deltas: list[str], opening: str = "") -> tuple[str, list[dict[str, str]], bool]:
    """Words, call pieces and whether the call closed, for an answer streamed as ``deltas``."""
    parser = CallParser(opening)
    results = [parser.feed(d) for d in deltas] + [parser.close()]
    return "".join(r.text for r in results), [r.call for r in results if r.call], parser.closed


ANSWER = ('Sure, let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
          '{"city": "Paris", "when": ["today", {"x": "}"}]}}\n</tool_call>')
ARGUMENTS = '{"city": "Paris", "when": ["today", {"x": "}"}]}'


@pytest.mark.parametrize("split", [1, 2, 3, 7, len(ANSWER)])
def test_words_then_one_call_whatever_the_split(split: int) -> None:
    deltas = [ANSWER[i:i + split] for i in range(0, len(ANSWER), split)]
    words, pieces, closed = parse(deltas)
    assert words == "Sure, let me look."  # the separator before the call is not words
    assert closed and {p["name"] for p in pieces} == {"get_weather"}
    assert "".join(p["arguments"] for p in pieces) == ARGUMENTS
    assert all(p["arguments"] for p in pieces)  # no empty deltas
    if split == 1:
        assert len(pieces) == len(ARGUMENTS)  # the arguments stream as they are written


def test_a_tag_split_over_tokens_is_held_back_until_known() -> None:
    parser = CallParser()
    assert parser.feed("Hi <tool") == Parsed("Hi")
    assert parser.feed("_c") == Parsed("")
    assert not parser.in_call
    assert parser.feed("all>") == Parsed("")
    assert parser.in_call
    # Not a tag after all: the held text is words.
    other = CallParser()
    assert other.feed("a <tool") == Parsed("a")
    assert other.feed("s> b") == Parsed(" <tools> b")
    assert other.close() == Parsed("")


def test_after_the_first_call_the_parser_reads_nothing() -> None:
    _, pieces, closed = parse([ANSWER + "\n<tool_call>\n{\"name\": \"second\", \"arguments\": {}}"])
    assert closed and {p["name"] for p in pieces} == {"get_weather"}


@pytest.mark.parametrize(("deltas", "name", "arguments"), [
    (['{"city": "Pa'], "f", '{"city": "Pa'),  # capped inside the arguments
    ([], "f", ""),  # capped before any: the call still ends, with its name
])
def test_an_unclosed_forced_call_ends_with_what_was_written(deltas: list[str], name: str,
                                                             arguments: str) -> None:
    words, pieces, closed = parse(deltas, opening=call_opening({"tools": [{"name": "f"}],
                                                                "tool_choice": "required"}))
    assert words == "" and closed
    assert pieces[0]["name"] == name and "".join(p["arguments"] for p in pieces) == arguments


def test_the_model_chooses_the_name_and_may_end_inside_it() -> None:
    opening = call_opening({"tools": [WEATHER, CLOCK], "tool_choice": "required"})
    _, pieces, _ = parse(['get_ti', 'me", "arguments": {}}'], opening=opening)
    assert pieces == [{"name": "get_time", "arguments": "{}"}]  # the name comes first, whole
    _, pieces, _ = parse(["get_ti"], opening=opening)
    assert pieces == [{"name": "get_ti", "arguments": ""}]


def test_arguments_before_the_name_wait_for_it() -> None:
    _, pieces, _ = parse(['<tool_call>\n{"arguments": {"a": 1}, ', '"name": "f"}\n</tool_call>'])
    assert pieces == [{"name": "f", "arguments": '{"a": 1}'}]


# -- the stages ----------------------------------------------------------------------------------


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """The thinker writes ``script[request_id]`` (token by token) instead of what it sampled."""
    script: dict[str, list[int]] = {}
    real_emit = thinker_module.Thinker._emit

    def emit(self: Any, slot: Any, token: int, embed: Any, extra: dict[str, Any]) -> Any:
        if slot.request_id in script:
            token = script[slot.request_id][len(slot.state.tokens)]
            embed = self._embed_cpu([token])[0]
        return real_emit(self, slot, token, embed, extra)

    monkeypatch.setattr(thinker_module.Thinker, "_emit", emit)
    return script


@pytest.fixture
def calls(staged: Staged, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[dict[str, str]]]:
    """The ``function_call`` pieces the decode stage emits during the test, per request."""
    pieces: dict[str, list[dict[str, str]]] = {}
    route = staged._route

    def recording(name: str, out: Any) -> None:
        if name == "decode" and getattr(out, "data", {}).get("function_call"):
            pieces.setdefault(out.request_id, []).append(out.data["function_call"])
        route(name, out)

    monkeypatch.setattr(staged, "_route", recording)
    return pieces


def test_words_are_voiced_and_the_call_is_not(staged: Staged, scripted: dict[str, list[int]],
                                              calls: dict[str, list[dict[str, str]]]) -> None:
    tokenizer = staged.runners["preprocessing"].tokenizer
    answer = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    script = tokenizer.encode(answer + "never read", add_special_tokens=False)
    scripted["words"] = script
    scripted["plain"] = tokenizer.encode("Sure.", add_special_tokens=False) + [tokenizer.eos_token_id]
    tools = {"tools": [WEATHER], "tool_choice": "auto"}
    staged.submit(OmniRequest("words", {"messages": [user(text="Weather?")]}, tools))
    staged.submit(OmniRequest("plain", {"messages": [user(text="Weather?")]}, {}))
    results = staged.run()
    words, plain = results["words"], results["plain"]
    assert words.error is None and words.text == "Sure."
    assert calls["words"][0]["name"] == "get_weather"
    assert "".join(p["arguments"] for p in calls["words"]) == '{"city": "Paris"}'
    # The answer ended at the call's close tag, as the script's tail shows.
    assert words.token_ids == script[: len(tokenizer.encode(answer, add_special_tokens=False))]
    # "Sure." is voiced alike with or without the call after it: the call's first token took
    # the place of the answer's EOS, and nothing of the call was voiced.
    assert len(words.frames) > 0 and len(words.frames) == len(plain.frames)
    assert all((a == b).all() for a, b in zip(words.frames, plain.frames, strict=True))


def test_a_forced_call_has_no_audio_and_ends_at_the_cap(staged: Staged, scripted: dict[str, list[int]],
                                                        calls: dict[str, list[dict[str, str]]]) -> None:
    tokenizer = staged.runners["preprocessing"].tokenizer
    scripted["forced"] = tokenizer.encode('{"city": "Paris"}}', add_special_tokens=False)
    params = {"tools": [WEATHER, CLOCK], "tool_choice": {"type": "function", "name": "get_weather"},
              "max_output_tokens": 6}
    staged.submit(OmniRequest("forced", {"messages": [user(text="Weather?")]}, params))
    result = staged.run()["forced"]
    assert result.error is None and result.text == ""
    assert result.frames == [] and sum(len(a) for a in result.audio) == 0
    assert {p["name"] for p in calls["forced"]} == {"get_weather"}
    assert "".join(p["arguments"] for p in calls["forced"]) == '{"city'  # 6 tokens, a byte each
