"""Code2wav stage: codec frames -> 24 kHz waveform, streamed with exact carried state.

One-shot ``code2wav(codes)`` of L frames gives ``1920 * L - 555`` samples. Re-decoding chunks with
a little left context (the reference's ``chunked_decode``) cannot reproduce it: the pre-transformer
attends over a 72-frame sliding window through 8 layers and the convolutions reach far back. This
module runs the same layers incrementally instead, carrying per request exactly the state each
layer needs:

- pre-transformer: its KV cache (sliding window) and the global frame position;
- every causal convolution (stride 1): its last ``(kernel - 1) * dilation`` input samples, which
  stand in for the zero left padding of the one-shot run;
- every transposed convolution with kernel 2 x stride: its last input frame, since output block q
  depends on inputs q and q + 1 (the one-shot run drops the final block for want of input L; so
  does the stream, hence the 555 samples it never has). Kernel == stride needs no state.

The first chunk of n frames yields ``1920 n - 555`` samples, every later chunk ``1920 n``, and the
concatenation equals one-shot decoding to float rounding. The final marker needs no extra compute
(nothing is held back that one-shot decoding would produce); it ends the stream.

Per-request state (Code2WavState) lives from ``new_state`` to ``release``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoeCausalConvNet,
    Qwen3OmniMoeCausalTransConvNet,
    Qwen3OmniMoeCode2Wav,
    Qwen3OmniMoeCode2WavDecoderBlock,
    Qwen3OmniMoeCode2WavDecoderResidualUnit,
    Qwen3OmniMoeConvNeXtBlock,
)

from pipeline.models import StageContext
from pipeline.models.qwen3_omni import loading
from pipeline.proto import StagePayload

SAMPLE_RATE = 24000


@dataclass
class Code2WavState:
    """Carried state of one stream: keyed by the module it belongs to (``id(module)``)."""

    cache: DynamicCache
    position: int = 0
    history: dict[int, torch.Tensor] = field(default_factory=dict)
    answer_tokens: int = 0
    """The thinker's answer tokens voiced by the frames decoded so far (from the talker's chunks)."""


class StreamingCode2Wav:
    """Runs a ``Qwen3OmniMoeCode2Wav``'s own layers on successive chunks of one stream."""

    def __init__(self, model: Qwen3OmniMoeCode2Wav) -> None:
        self.model = model

    def new_state(self) -> Code2WavState:
        return Code2WavState(cache=DynamicCache(config=self.model.config))

    @torch.inference_mode()
    def decode(self, state: Code2WavState, codes: torch.Tensor) -> torch.Tensor:
        """Samples [n] for ``codes`` [quantizers, frames], continuing the stream in ``state``."""
        m = self.model
        frames = codes.shape[-1]
        hidden = m.code_embedding(codes[None] + m.code_offset).mean(1)
        positions = torch.arange(state.position, state.position + frames, device=hidden.device)
        hidden = m.pre_transformer(
            inputs_embeds=hidden, position_ids=positions[None], cache=state.cache, use_cache=True
        ).last_hidden_state
        state.position += frames
        hidden = hidden.permute(0, 2, 1)
        for blocks in m.upsample:
            for block in blocks:
                hidden = self._module(state, block, hidden)
        for block in m.decoder:
            hidden = self._module(state, block, hidden)
        return hidden.clamp(min=-1, max=1)[0, 0]

    def _module(self, state: Code2WavState, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        if isinstance(module, Qwen3OmniMoeCausalConvNet):
            return self._conv(state, module, x)
        if isinstance(module, Qwen3OmniMoeCausalTransConvNet):
            return self._trans_conv(state, module, x)
        if isinstance(module, Qwen3OmniMoeConvNeXtBlock):
            return self._convnext(state, module, x)
        if isinstance(module, Qwen3OmniMoeCode2WavDecoderBlock):
            for inner in module.block:
                x = self._module(state, inner, x)
            return x
        if isinstance(module, Qwen3OmniMoeCode2WavDecoderResidualUnit):
            y = self._conv(state, module.conv1, module.act1(x))
            return self._conv(state, module.conv2, module.act2(y)) + x
        return module(x)  # pointwise in time (SnakeBeta)

    def _conv(self, state: Code2WavState, conv: Qwen3OmniMoeCausalConvNet, x: torch.Tensor) -> torch.Tensor:
        if conv.stride != 1:
            raise NotImplementedError("streaming code2wav supports stride-1 causal convolutions only")
        keep = conv.padding  # (kernel - 1) * dilation zeros on the left, one-shot
        if keep == 0:
            return conv.conv(x)
        past = state.history.get(id(conv))
        if past is None:
            past = x.new_zeros(x.shape[0], x.shape[1], keep)
        full = torch.cat([past, x], dim=-1)
        state.history[id(conv)] = full[..., -keep:]
        return conv.conv(full)

    def _trans_conv(
        self, state: Code2WavState, conv: Qwen3OmniMoeCausalTransConvNet, x: torch.Tensor
    ) -> torch.Tensor:
        if conv.left_pad == 0:
            return conv(x)
        past = state.history.get(id(conv))
        full = x if past is None else torch.cat([past, x], dim=-1)
        state.history[id(conv)] = full[..., -1:]
        return conv(full)

    def _convnext(self, state: Code2WavState, block: Qwen3OmniMoeConvNeXtBlock, x: torch.Tensor) -> torch.Tensor:
        y = self._conv(state, block.dwconv, x).permute(0, 2, 1)
        y = block.pwconv2(block.act(block.pwconv1(block.norm(y))))
        return x + (block.gamma * y).permute(0, 2, 1)


class Code2Wav:
    """VocoderRunner for the ``code2wav`` stage (one codec frame per input chunk: ``codes``)."""

    def __init__(self, ctx: StageContext) -> None:
        source = loading.resolve(ctx.model_args)
        self.device = ctx.stage.device
        self.streaming = StreamingCode2Wav(loading.load_code2wav(source, self.device))

    def new_state(self, payload: StagePayload) -> Code2WavState:
        return self.streaming.new_state()

    def decode(self, state: Code2WavState, chunks: list[dict[str, Any]], final: bool) -> dict[str, Any]:
        """Output: ``audio``, ``sample_rate`` and ``answer_tokens``: the answer tokens voiced up to
        the end of this chunk (cumulative), what a barge-in after this chunk keeps."""
        state.answer_tokens = max([state.answer_tokens, *(int(c.get("answer_tokens", 0)) for c in chunks)])
        if not chunks:
            audio = np.zeros(0, dtype=np.float32)
        else:
            codes = torch.stack([c["codes"] for c in chunks], dim=-1).to(self.device)
            audio = self.streaming.decode(state, codes).float().cpu().numpy()
        return {"audio": audio, "sample_rate": SAMPLE_RATE, "answer_tokens": state.answer_tokens}

    def release(self, state: Code2WavState) -> None:
        state.history.clear()
        state.cache = None
