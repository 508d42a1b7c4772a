"""The offline language model's first token over a conversation: its KV kept between turns against
a full prefill each turn, and onnxruntime-genai against CTranslate2 (issue 28).

    python -m evaluation.lm_runtime_bench [--turns 10]

In one process, the real SmolLM2-135M-Instruct through the ``lm`` stage's own runner
(``pipeline/models/offline/lm.py``) with the preset's options and one thread (the preset's
``threads: 1``), unpaced (pacing only delays tokens after the first). A conversation of
``--turns`` questions, asked one after another, each prompt the preset's instructions, the turns
before with their answers, and the question:

- ``kept``: the requests name the conversation, so each turn continues the KV its previous turn
  left (``lm_cache.py``), as the offline preset's sessions do;
- ``anew``: the same prompts (the kept run's answers are the history) with no conversation: a full
  prefill every turn;
- ``ct2``: the same prompts on CTranslate2 int8 (the runtime the ``lm`` stage had before, and the
  judge's), greedy, one thread.

Per turn: prompt tokens, tokens reused, time from the request's first step to its first token,
and the mean time of each later token (up to 24). Prints a table, writes
evaluation/results/lm_runtime_bench.{json,png}.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import matplotlib

from evaluation.bench_common import ROOT, format_table, machine, save_figure, save_results
from harness.lm_runner import lm_slot
from pipeline.config import StageConfig, read_yaml
from pipeline.models import StageContext
from pipeline.scheduling.conversation_book import SESSION_PARAM

matplotlib.use("Agg")
import matplotlib.pyplot as plt

QUESTIONS = (
    "What is the capital of France?",
    "And what is the capital of Japan?",
    "How many legs does a spider have?",
    "What is frozen water called?",
    "What do bees make?",
    "What color is the sky on a clear day?",
    "Which planet is closest to the sun?",
    "How many days are in a week?",
    "What is the opposite of hot?",
    "What animal says moo?",
    "What is two plus two?",
    "Tell me something about the moon.",
)
DECODED = 24  # tokens timed after the first


def preset_lm() -> tuple[dict[str, Any], str]:
    """The offline preset's ``lm`` stage options and its instructions."""
    preset = read_yaml(ROOT / "configs" / "offline.yaml")
    stage = next(s for s in preset["pipeline"]["stages"] if s["name"] == "lm")
    return dict(stage.get("options", {})), str(preset["session"]["instructions"])


def timed(runner: Any, slot: Any) -> tuple[float, float, str]:
    """Step ``slot`` alone until it ends: seconds to its first token, mean seconds of each later
    token (up to ``DECODED``), and its text."""
    start = time.perf_counter()
    first = None
    text = ""
    while slot.state is not None:
        result = runner.step([slot])[0]
        slot.steps += 1
        text += (result.data or {}).get("text", "")
        if first is None and slot.state.ids:
            first = time.perf_counter()
        count = len(slot.state.ids)
        if result.finished or count > DECODED:
            end = time.perf_counter()
            runner.release(slot)
            return first - start, (end - first) / max(1, count - 1), text
    raise AssertionError("released before it ended")


def run_conversation(turns: int) -> list[dict[str, Any]]:
    import ctranslate2
    from transformers import AutoTokenizer

    from pipeline.models.offline.lm import LanguageModel
    from pipeline.models.offline.sources import lm_source, prepare_lm

    options, instructions = preset_lm()
    options["pace_tokens_per_s"] = 0
    stage = StageConfig(name="lm", runner="lm", scheduler="ar", max_new_tokens=96, terminal=True,
                        max_batch=1, threads=1, options=options)
    runner = LanguageModel(StageContext(stage, {"lm": "packaged"}))
    prepared = prepare_lm(lm_source("packaged"))
    tokenizer = AutoTokenizer.from_pretrained(prepared.tokenizer_dir)
    ct2 = ctranslate2.Generator(str(prepared.ct2_dir), device="cpu", compute_type="int8",
                                intra_threads=1)
    history: list[dict[str, str]] = [{"role": "system", "text": instructions}]
    # Warm-up: each runtime's first run allocates.
    timed(runner, lm_slot(runner, "warm", [*history, {"role": "user", "text": "Hello."}], cap=4))
    rows = []
    for turn in range(turns):
        history.append({"role": "user", "text": QUESTIONS[turn % len(QUESTIONS)]})
        kept = lm_slot(runner, f"k{turn}", history, cap=96, params={SESSION_PARAM: "bench"})
        state = kept.state
        kept_first, kept_token, said = timed(runner, kept)
        anew = lm_slot(runner, f"a{turn}", history, cap=96)
        prompt = anew.state.prompt
        anew_first, anew_token, _ = timed(runner, anew)
        ct2_first, ct2_token = time_ct2(ct2, tokenizer.convert_ids_to_tokens(prompt))
        rows.append({
            "turn": turn + 1, "prompt_tokens": len(prompt), "cached_tokens": state.cached,
            "kept_first_ms": round(kept_first * 1000, 1), "anew_first_ms": round(anew_first * 1000, 1),
            "ct2_first_ms": round(ct2_first * 1000, 1),
            "kept_token_ms": round(kept_token * 1000, 2), "anew_token_ms": round(anew_token * 1000, 2),
            "ct2_token_ms": round(ct2_token * 1000, 2),
            "question": history[-1]["text"], "answer": said,
        })
        history.append({"role": "assistant", "text": said})
    return rows


def time_ct2(generator: Any, tokens: list[str]) -> tuple[float, float]:
    """Seconds to CTranslate2's first greedy token of ``tokens``, and the mean of each later one."""
    start = time.perf_counter()
    stamps = []
    for _ in generator.generate_tokens(tokens, max_length=DECODED + 1, min_length=DECODED + 1,
                                       sampling_topk=1):
        stamps.append(time.perf_counter())
    return stamps[0] - start, (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)


def plot(results: dict[str, Any], path: Path) -> None:
    rows = results["turns"]
    turns = [r["turn"] for r in rows]
    fig, (first, token) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("kept", "onnxruntime-genai, KV kept"), ("anew", "onnxruntime-genai, anew"),
                       ("ct2", "CTranslate2 int8, anew")):
        first.plot(turns, [r[f"{key}_first_ms"] for r in rows], marker="o", label=label)
        token.plot(turns, [r[f"{key}_token_ms"] for r in rows], marker="o", label=label)
    first.set(xlabel="turn of the conversation", ylabel="ms to the first token",
              title="First token as the conversation grows")
    token.set(xlabel="turn of the conversation", ylabel="ms per later token", title="Decoding")
    first.legend()
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=10)
    args = parser.parse_args()
    rows = run_conversation(args.turns)
    print(format_table(
        ["turn", "prompt", "cached", "first kept", "first anew", "first ct2", "token kept",
         "token anew", "token ct2"],
        [[r["turn"], r["prompt_tokens"], r["cached_tokens"], r["kept_first_ms"], r["anew_first_ms"],
          r["ct2_first_ms"], r["kept_token_ms"], r["anew_token_ms"], r["ct2_token_ms"]]
         for r in rows]))
    save_results("lm_runtime_bench", {"machine": machine(), "turns": rows}, plot)


if __name__ == "__main__":
    main()
