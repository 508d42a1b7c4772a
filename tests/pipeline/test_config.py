"""A wrong pipeline config fails at load with a message that names the field."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from pipeline.config import ConfigError, parse_pipeline_config, read_yaml
from pipeline.models import resolve
from tests.pipeline.helpers import REPO, fan_in_config

Mutation = Callable[[dict[str, Any]], None]


def _toy() -> dict[str, Any]:
    return read_yaml(REPO / "configs" / "toy.yaml")["pipeline"]


def _stage(data: dict[str, Any], name: str) -> dict[str, Any]:
    return next(s for s in data["stages"] if s["name"] == name)


def _set(stage: str, **fields: Any) -> Mutation:
    return lambda data: _stage(data, stage).update(fields)


def _drop(name: str, field: str) -> Mutation:
    return lambda data: _stage(data, name).pop(field)


def _top(**fields: Any) -> Mutation:
    return lambda data: data.update(fields)


def _fan_in_cycle(data: dict[str, Any]) -> None:
    """decode waits for thinker and talker, and feeds talker back: a cycle through a fan-in."""
    _stage(data, "thinker").update(stream_to=[], next=["decode"])
    _stage(data, "decode").update(wait_for=["thinker", "talker"], merge="join", next=["talker"])
    _stage(data, "talker").update(stream_to=[], next=["decode"], terminal=True)
    data["stages"] = [s for s in data["stages"] if s["name"] != "code2wav"]


def _fan_in_without_merge(data: dict[str, Any]) -> None:
    _fan_in_cycle(data)
    _stage(data, "decode").pop("merge")


def _orphan_cycle(data: dict[str, Any]) -> None:
    relay = {"runner": "relay", "scheduler": "simple"}
    data["stages"] += [{"name": "c", **relay, "next": ["d"]}, {"name": "d", **relay, "next": ["c"]}]


BAD_CONFIGS: dict[str, tuple[Mutation, str]] = {
    "unknown next": (_set("thinker", next=["nowhere"]), "stages.thinker.next: 'nowhere' is not a stage"),
    "unknown stream_to": (
        _set("talker", stream_to=["speaker"]), "stages.talker.stream_to: 'speaker' is not a stage"
    ),
    "unknown wait_for": (_set("decode", wait_for=["ghost"]), "stages.decode.wait_for: 'ghost'"),
    "feeds itself": (_set("talker", next=["talker"]), "stages.talker.next: a stage cannot feed itself"),
    "cycle through a fan-in": (_fan_in_cycle, "cycle"),
    "cycle apart from the entry": (_orphan_cycle, "cycle c -> d -> c"),
    "no terminal": (_set("code2wav", terminal=False), "stages.code2wav: neither terminal nor feeding"),
    "entry missing": (lambda d: d.pop("entry"), "entry: Field required"),
    "entry unknown": (_top(entry="ear"), "entry: 'ear' is not a stage"),
    "entry fed by another stage": (_top(entry="talker"), "stages.thinker"),
    "ar without output cap": (_drop("thinker", "max_new_tokens"), "an ar stage needs max_new_tokens"),
    "wait_for not the feeders": (
        _set("code2wav", wait_for=["thinker"]), "stages.code2wav.wait_for: must list exactly"
    ),
    "fan-in without merge": (_fan_in_without_merge, "wait_for with several sources needs merge"),
    "two stream sources": (_set("decode", stream_to=["code2wav"], terminal=False), "one stream source"),
    "duplicate names": (_set("talker", name="thinker"), "duplicate stage names ['thinker']"),
    "bad name": (_set("talker", name="Talker!"), "stages.2.name: String should match pattern"),
    "unknown scheduler": (_set("talker", scheduler="fast"), "stages.2.scheduler: Input should be"),
    "unknown field": (_set("talker", colour="blue"), "stages.2.colour: Extra inputs are not permitted"),
    "max_in_flight not a number": (_top(max_in_flight="many"), "max_in_flight: Input should be a valid"),
    "zero threads": (_set("thinker", threads=0), "stages.0.threads: Input should be greater than"),
    "stages not a list": (_top(stages={"thinker": {}}), "stages: Input should be a valid list"),
}


@pytest.mark.parametrize("mutate, message", BAD_CONFIGS.values(), ids=BAD_CONFIGS.keys())
def test_a_bad_config_is_rejected_naming_the_field(mutate: Mutation, message: str) -> None:
    data = copy.deepcopy(_toy())
    mutate(data)
    with pytest.raises(ConfigError) as error:
        parse_pipeline_config(data)
    assert message in str(error.value)
    assert str(error.value).startswith("pipeline: ")


def _fan_in() -> dict[str, Any]:
    return fan_in_config().model_dump()


@pytest.mark.parametrize(
    "base, mutate, message",
    [
        (_toy, _set("talker", runner="speaker"), "pipeline.stages.talker.runner: 'speaker' is not"),
        (_fan_in, _set("join", merge="blend"), "pipeline.stages.join.merge: 'blend' is not a merge"),
        (_toy, _top(model="gpt-9"), "pipeline.model: unknown model 'gpt-9'"),
    ],
    ids=["unknown runner", "unknown merge", "unknown model"],
)
def test_names_the_model_does_not_have_are_rejected(
    base: Callable[[], dict[str, Any]], mutate: Mutation, message: str
) -> None:
    data = base()
    mutate(data)
    config = parse_pipeline_config(data)  # valid as a graph; wrong for the model
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        resolve(config)


def test_the_toy_preset_is_valid_for_its_model() -> None:
    config = parse_pipeline_config(_toy())
    assert resolve(config).name == "toy"
    assert set(config.terminals) == {"decode", "code2wav"}
