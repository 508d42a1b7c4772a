"""How close a turn prefilled in pieces while it is spoken is to the turn encoded at once.

    python -m evaluation.prefill_fidelity [--pieces 1 2 4 8]

The tiny preset's real runners (preprocessing, the audio tower; then the whole pipeline in this
process) on one espeak-ng utterance of ~10.8 s, for each piece length: the log-mel frames of the
pieces against the whole turn's (max |difference|), the audio tower's embeddings of the pieces
against the whole turn's (relative L2, over the first 8 s attention block and over all), and the
answer: thinker tokens and the audio after the pieces, against a fresh request over the same audio
(the tests compare the same with ``generate``). Random tiny weights barely use the tower's
attention: this measures the mechanism (frames, counts, the mel floor), not how much the real
model's answers change. Prints a table and writes evaluation/results/prefill_fidelity.{json,png}.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import matplotlib
import numpy as np
import torch
from transformers.utils import logging as hf_logging

from evaluation.bench_common import ROOT, format_table, machine, save_figure, save_results
from harness.speech import speech
from pipeline.config import parse_pipeline_config, read_yaml
from pipeline.models import StageContext, get_model
from pipeline.proto import OmniRequest, StagePayload
from pipeline.runner import start_pipeline
from pipeline.scheduling.base import BatchItem
from pipeline.scheduling.conversation_book import OPEN_PARAM, PARTIAL_MARGIN_MS, PARTIAL_PARAM
from pipeline.scheduling.conversations import CONVERSATION_PARAM

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend

RATE = 16000
TEXT = ("I would like to plan a short trip to the mountains this weekend with my family and our "
        "dog, somewhere quiet near a lake and then we will go home")
BLOCK_TOKENS = 104  # the tower's 8 s attention block, in audio tokens (13 a second)
MARGIN = PARTIAL_MARGIN_MS * RATE // 1000


def turn(audio: np.ndarray) -> dict[str, Any]:
    return {"role": "user", "text": None, "audio": audio, "sample_rate": RATE}


def boundaries(audio: np.ndarray, piece_s: int) -> list[int]:
    return list(range(piece_s, (len(audio) - MARGIN) // RATE + 1, piece_s))


def encoder_side(config: Any, audio: np.ndarray, pieces: list[int]) -> dict[str, Any]:
    """Log-mel and tower embeddings of the turn in pieces, against the turn at once."""
    spec = get_model(config.model)
    pre = spec.factories["preprocessing"](StageContext(config.stage("preprocessing"), config.model_args))
    tower = spec.factories["audio_encoder"](StageContext(config.stage("audio_encoder"), config.model_args))

    def run(messages: list[dict[str, Any]], params: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        prepared = pre.run([BatchItem(StagePayload("x", {"messages": messages}, params), True)])[0]
        embeds = tower.run([BatchItem(StagePayload("x", prepared, params), True)])[0]["audio_embeds"]
        mel = prepared["input_features"][0][:, prepared["feature_attention_mask"][0].bool()]
        return mel, embeds

    whole_mel, whole = run([turn(audio)], {})
    mels, embeds, held = [], [], 0
    for until in [*pieces, None]:
        params: dict[str, Any] = {} if until is None else {PARTIAL_PARAM: until}
        if held:
            params[CONVERSATION_PARAM] = {"id": "c", "resume": True, "covered_s": held}
        clip = audio if until is None else audio[: until * RATE + MARGIN]
        mel, embed = run([turn(clip)], params)
        mels.append(mel)
        embeds.append(embed)
        held = until or held
    mel, embed = torch.cat(mels, dim=1), torch.cat(embeds)
    assert embed.shape == whole.shape, (embed.shape, whole.shape)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    return {"mel_max_abs_diff": float((mel - whole_mel).abs().max()),
            "embeds_rel_l2": rel(embed, whole),
            "embeds_rel_l2_first_block": rel(embed[:BLOCK_TOKENS], whole[:BLOCK_TOKENS])}


async def answers(config: Any, audio: np.ndarray, pieces: dict[int, list[int]]) -> dict[int, dict[str, Any]]:
    """The answer after each piece length's pieces, against a fresh request over the same audio."""
    coordinator = await start_pipeline(config, mode="inproc", ready_timeout=300)

    async def answer(rid: str, params: dict[str, Any]) -> tuple[list[int], np.ndarray]:
        tokens, audio_out = [], []
        async for chunk in coordinator.stream(OmniRequest(rid, {"messages": [turn(audio)]}, params)):
            tokens += chunk.data.get("token_ids", [])
            if "audio" in chunk.data:
                audio_out.append(chunk.data["audio"])
        return tokens, np.concatenate(audio_out) if audio_out else np.zeros(0)

    out: dict[int, dict[str, Any]] = {}
    try:
        fresh_tokens, fresh_audio = await answer("fresh", {})
        for piece_s, ends in pieces.items():
            cid, held = f"pieces{piece_s}", 0
            for until in ends:
                params = {"conversation_id": cid, PARTIAL_PARAM: until, "modalities": ["text"]}
                if held:
                    params[OPEN_PARAM] = held
                request = OmniRequest(f"{cid}-{until}", {"messages": [turn(audio[: until * RATE + MARGIN])]}, params)
                async for _ in coordinator.stream(request):
                    pass
                held = until
            tokens, audio_out = await answer(f"{cid}-answer", {"conversation_id": cid, OPEN_PARAM: held})
            await coordinator.close_conversation(cid)
            out[piece_s] = {"same_tokens": tokens == fresh_tokens,
                            "same_audio": bool(np.array_equal(audio_out, fresh_audio)),
                            "answer_tokens": len(tokens)}
    finally:
        await coordinator.close()
    return out


def measure(piece_lengths: list[int]) -> dict[str, Any]:
    config = parse_pipeline_config(read_yaml(ROOT / "configs" / "qwen3_omni_tiny.yaml")["pipeline"])
    audio = speech(TEXT, RATE, 0.3, 0.3)
    pieces = {p: boundaries(audio, p) for p in piece_lengths}
    answered = asyncio.run(answers(config, audio, pieces))
    rows = []
    for piece_s in piece_lengths:
        row = {"piece_s": piece_s, "pieces": len(pieces[piece_s]),
               "held_s": pieces[piece_s][-1] if pieces[piece_s] else 0}
        row.update(encoder_side(config, audio, pieces[piece_s]))
        row.update(answered[piece_s])
        rows.append(row)
    return {"preset": "qwen3_omni_tiny", "utterance_s": round(len(audio) / RATE, 2), "rows": rows,
            "machine": machine()}


def plot(results: dict[str, Any], path: Any) -> None:
    rows = results["rows"]
    x = [r["piece_s"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    floor = 1e-9  # zeros on a log axis
    ax.semilogy(x, [max(r["embeds_rel_l2"], floor) for r in rows], "o-", label="tower embeddings, all")
    ax.semilogy(x, [max(r["embeds_rel_l2_first_block"], floor) for r in rows], "o-",
                label="tower embeddings, first 8 s block")
    ax.semilogy(x, [max(r["mel_max_abs_diff"], floor) for r in rows], "o-", label="log-mel max |diff|")
    ax.set(xlabel="piece (s)", ylabel="difference from the whole turn (1e-9: none)",
           title=f"tiny Qwen3-Omni, one {results['utterance_s']} s turn in pieces")
    ax.legend()
    save_figure(fig, path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pieces", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()
    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    results = measure(args.pieces)
    print(format_table(
        ["piece s", "pieces", "log-mel max |diff|", "embeds rel L2", "first 8 s block", "same tokens",
         "same audio"],
        [[r["piece_s"], r["pieces"], f"{r['mel_max_abs_diff']:.2e}", f"{r['embeds_rel_l2']:.2e}",
          f"{r['embeds_rel_l2_first_block']:.2e}", r["same_tokens"], r["same_audio"]] for r in results["rows"]]))
    save_results("prefill_fidelity", results, plot)


if __name__ == "__main__":
    main()
