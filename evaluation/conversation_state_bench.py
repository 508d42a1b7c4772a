"""Time to first audio over the turns of one conversation: kept state vs re-sending the history;
and from the end of an utterance of 2, 5 or 15 s: prefilled at its end vs in pieces while spoken.

    python -m evaluation.conversation_state_bench [--turns 10] [--rounds 2]

The tiny preset (configs/qwen3_omni_tiny.yaml, stage processes) answers one conversation of
``--turns`` spoken user turns (espeak-ng, ~5 s each at 16 kHz), twice per round:
- ``resend``: every request carries the whole history and nothing is kept, so preprocessing, the
  audio encoder and the thinker's prefill run over all of it again before the first token;
- ``kept``: the same requests with ``params["conversation_id"]``: the thinker keeps its KV cache
  between turns and only the new user turn is preprocessed, encoded and prefilled.
Time to first audio (TTFA: from submitting the request to its first non-empty audio chunk) and to
the first text token (TTFT: what the thinker's prefill delays most directly) per turn, median over
rounds. Then one user turn of ``UTTERANCES`` seconds each (the sentences run together and cut),
answered as the first turn of a kept conversation, twice per round:
- ``at_end``: the whole turn is encoded and prefilled once it has ended;
- ``pieces``: pieces of ``PIECE_S`` seconds were prefilled while it was spoken (partial requests,
  submitted and finished before the timed one, as the session's pieces finish during the speech),
  so the answer prefills only the audio after the last piece.
TTFA here is from the submission of the answer's request, which the session makes at the end of the
turn. The tiny model is overhead-bound; the growth with the history and the utterance is what this
shows, not what a GPU does with the real model. Prints tables and writes
evaluation/results/conversation_state_bench.{json,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import matplotlib
import numpy as np
from transformers.utils import logging as hf_logging

from evaluation.bench_common import ROOT, format_table, machine, save_figure, save_results
from harness.speech import speech
from pipeline.config import parse_pipeline_config, read_yaml
from pipeline.coordinator import Coordinator
from pipeline.proto import OmniRequest
from pipeline.runner import start_pipeline
from pipeline.scheduling.conversation_book import OPEN_PARAM, PARTIAL_MARGIN_MS, PARTIAL_PARAM

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend

SENTENCES = [
    "good morning, I would like to plan a short trip for this weekend",
    "we were thinking about the mountains, somewhere with a quiet lake",
    "how long would the drive take from the city if we leave early",
    "that sounds fine, what should we pack for two days of hiking",
    "is it likely to rain up there at this time of the year",
    "can you suggest a place to stay that is not too expensive",
    "we also have a dog, are dogs usually allowed on those trails",
    "what would be a good dinner to cook on a small camping stove",
    "remind me what we said about the drive and the weather again",
    "thank you, please summarise the whole plan in a few sentences",
]


async def turn_request(coordinator: Coordinator, rid: str, messages: list[dict], params: dict) -> dict[str, Any]:
    started = time.perf_counter()
    first_audio = first_text = None
    text, prompt_tokens = "", None
    async for chunk in coordinator.stream(OmniRequest(rid, {"messages": list(messages)}, params)):
        if first_audio is None and len(chunk.data.get("audio", ())) > 0:
            first_audio = time.perf_counter() - started
        if first_text is None and chunk.data.get("token_ids"):
            first_text = time.perf_counter() - started
        text += chunk.data.get("text", "")
        prompt_tokens = chunk.data.get("usage", {}).get("prompt_tokens", prompt_tokens)
    return {"ttfa_s": first_audio, "ttft_s": first_text, "text": text, "prompt_tokens": prompt_tokens}


async def conversation(coordinator: Coordinator, mode: str, turns: int, tag: str) -> list[dict[str, Any]]:
    clips = [speech(s, 16000) for s in SENTENCES[:turns]]
    messages: list[dict[str, Any]] = []
    params = {"conversation_id": f"{tag}-{mode}"} if mode == "kept" else {}
    out = []
    for i, clip in enumerate(clips):
        messages.append({"role": "user", "text": None, "audio": clip, "sample_rate": 16000})
        result = await turn_request(coordinator, f"{tag}-{mode}-{i}", messages, params)
        result["history_audio_s"] = round(sum(len(c) for c in clips[: i + 1]) / 16000, 1)
        out.append(result)
        messages.append({"role": "assistant", "text": result["text"]})
    if mode == "kept":
        await coordinator.close_conversation(params["conversation_id"])
    return out


UTTERANCES = (2, 5, 15)
PIECE_S = 2


def utterance(seconds: int) -> np.ndarray:
    """``seconds`` of speech: the sentences spoken one after another, cut there."""
    clips, total = [], 0
    for sentence in SENTENCES:
        clips.append(speech(sentence, 16000, 0.3, 0.0))
        total += len(clips[-1])
        if total >= seconds * 16000:
            break
    return np.concatenate(clips)[: seconds * 16000]


async def spoken_turn(coordinator: Coordinator, mode: str, seconds: int, tag: str) -> dict[str, Any]:
    audio, cid = utterance(seconds), f"{tag}-{mode}-{seconds}"
    turn = {"role": "user", "text": None, "audio": audio, "sample_rate": 16000}
    params: dict[str, Any] = {"conversation_id": cid}
    held, margin = 0, PARTIAL_MARGIN_MS * 16
    while mode == "pieces" and (held + PIECE_S) * 16000 + margin <= len(audio):
        so_far = {**turn, "audio": audio[: (held + PIECE_S) * 16000 + margin]}
        piece = {**params, PARTIAL_PARAM: held + PIECE_S, "modalities": ["text"],
                 **({OPEN_PARAM: held} if held else {})}
        await turn_request(coordinator, f"{cid}-piece{held}", [so_far], piece)
        held += PIECE_S
    result = await turn_request(coordinator, f"{cid}-answer", [turn], {**params, OPEN_PARAM: held} if held else params)
    await coordinator.close_conversation(cid)
    result["left_s"] = round(len(audio) / 16000 - held, 2)
    return result


async def measure(turns: int, rounds: int) -> dict[str, Any]:
    config = parse_pipeline_config(read_yaml(ROOT / "configs" / "qwen3_omni_tiny.yaml")["pipeline"])
    coordinator = await start_pipeline(config, mode="process", ready_timeout=300)
    runs: dict[str, list[list[dict[str, Any]]]] = {"resend": [], "kept": []}
    spoken: dict[str, dict[int, list[dict[str, Any]]]] = {"at_end": {}, "pieces": {}}
    try:
        await conversation(coordinator, "kept", 2, "warmup")  # first-call costs are not the point
        await spoken_turn(coordinator, "pieces", UTTERANCES[0], "warmup")
        for r in range(rounds):
            for mode in ("resend", "kept"):
                runs[mode].append(await conversation(coordinator, mode, turns, f"round{r}"))
            for seconds in UTTERANCES:
                for mode in ("at_end", "pieces"):
                    spoken[mode].setdefault(seconds, []).append(
                        await spoken_turn(coordinator, mode, seconds, f"round{r}"))
        stats = await coordinator.stage_stats()
        leftover = {name: s.conversations for name, s in stats.items() if s.conversations}
    finally:
        await coordinator.close()
    rows = []
    for i in range(turns):
        row: dict[str, Any] = {"turn": i + 1, "history_audio_s": runs["kept"][0][i]["history_audio_s"]}
        for mode in ("resend", "kept"):
            for key in ("ttfa", "ttft"):
                values = [run[i][f"{key}_s"] for run in runs[mode] if run[i][f"{key}_s"] is not None]
                row[f"{mode}_{key}_ms"] = round(1000 * statistics.median(values), 1) if values else None
            row[f"{mode}_prompt_tokens"] = runs[mode][0][i]["prompt_tokens"]
        rows.append(row)
    utterances = []
    for seconds in UTTERANCES:
        row = {"utterance_s": seconds, "piece_s": PIECE_S,
               "left_after_pieces_s": spoken["pieces"][seconds][0]["left_s"]}
        for mode in ("at_end", "pieces"):
            for key in ("ttfa", "ttft"):
                values = [run[f"{key}_s"] for run in spoken[mode][seconds] if run[f"{key}_s"] is not None]
                row[f"{mode}_{key}_ms"] = round(1000 * statistics.median(values), 1) if values else None
        row["same_answer"] = all(a["text"] == b["text"] for a, b in zip(
            spoken["at_end"][seconds], spoken["pieces"][seconds], strict=True))
        utterances.append(row)
    return {"preset": "qwen3_omni_tiny", "rounds": rounds, "turns": rows, "utterances": utterances,
            "kept_state_left_after_close": leftover, "machine": machine()}


def plot(results: dict[str, Any], path: Any) -> None:
    rows = results["turns"]
    x = [r["turn"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    for ax, key, what in zip(axes, ("ttfa", "ttft"), ("first audio", "first text token")):
        ax.plot(x, [r[f"resend_{key}_ms"] for r in rows], "o-", color="tab:red", label="re-send the history")
        ax.plot(x, [r[f"kept_{key}_ms"] for r in rows], "o-", color="tab:green", label="kept state")
        ax.set(xlabel="turn (each ~5 s of user speech)", ylabel="ms (median)", title=f"time to {what}")
        ax.set_ylim(bottom=0)
        ax.legend()
    spoken = results["utterances"]
    x = [r["utterance_s"] for r in spoken]
    ax = axes[2]
    ax.plot(x, [r["at_end_ttfa_ms"] for r in spoken], "o-", color="tab:red", label="prefilled at its end")
    ax.plot(x, [r["pieces_ttfa_ms"] for r in spoken], "o-", color="tab:green",
            label=f"prefilled in {PIECE_S} s pieces while spoken")
    ax.set(xlabel="utterance (s)", ylabel="ms (median)", title="end of the turn to first audio")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.suptitle("tiny Qwen3-Omni (random weights, CPU): one conversation, kept state vs re-sending")
    save_figure(fig, path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=10, choices=range(1, len(SENTENCES) + 1))
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    hf_logging.set_verbosity_error()  # every stage reports the checkpoint keys it does not load
    results = asyncio.run(measure(args.turns, args.rounds))
    headers = ["turn", "history audio s", "resend TTFA ms", "kept TTFA ms", "resend TTFT ms",
               "kept TTFT ms", "context tokens"]
    print(format_table(headers, [
        [r["turn"], r["history_audio_s"], r["resend_ttfa_ms"], r["kept_ttfa_ms"],
         r["resend_ttft_ms"], r["kept_ttft_ms"], r["kept_prompt_tokens"]]
        for r in results["turns"]
    ]))
    print(format_table(["utterance s", "left after pieces s", "at end TTFA ms", "pieces TTFA ms",
                        "at end TTFT ms", "pieces TTFT ms", "same answer"], [
        [r["utterance_s"], r["left_after_pieces_s"], r["at_end_ttfa_ms"], r["pieces_ttfa_ms"],
         r["at_end_ttft_ms"], r["pieces_ttft_ms"], r["same_answer"]] for r in results["utterances"]
    ]))
    save_results("conversation_state_bench", results, plot)


if __name__ == "__main__":
    main()
