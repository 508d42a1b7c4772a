"""Per-request KV caches of an autoregressive stage, and the left-padded batch they decode in.

A KVPool belongs to one runner (thinker or talker) and holds every KV cache of its stage, keyed by
request_id, from the end of the request's prefill until ``release`` (finish, failure or abort). A
cache lives either on its own ("solo") or as one row of the batch: the rows that decode together
are left-padded to a common length and concatenated on the batch dimension, so a step over the
same rows as the previous step appends to one cache with no copying. When the set of rows changes
(a request joins, leaves, or has to wait for input), ``arrange`` copies: leaving rows are cut out
(padding stripped) back to solo caches, joining rows are padded and concatenated. The attention mask
hides the padding; each row keeps its own positions (the runner passes them explicitly), so a
row's tokens do not depend on its neighbours.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

Layers = list[tuple[torch.Tensor, torch.Tensor]]


def crop_to(cache: DynamicCache, length: int) -> None:
    """Keep the first ``length`` tokens of ``cache`` (transformers 5's crop takes a negative count
    of tokens to remove)."""
    if cache.get_seq_length() > length:
        cache.crop(length - cache.get_seq_length())


def cache_bytes(cache: DynamicCache) -> int:
    """Memory held by a cache's keys and values."""
    return sum(t.numel() * t.element_size() for layer in cache.layers
               if getattr(layer, "is_initialized", False) for t in (layer.keys, layer.values))


def _layers(cache: DynamicCache) -> Layers:
    return [(keys, values) for keys, values, _ in cache]


def _left_pad(layers: Layers, amount: int) -> Layers:
    if amount == 0:
        return layers
    out = []
    for keys, values in layers:
        pad = keys.new_zeros(keys.shape[0], keys.shape[1], amount, keys.shape[3])
        vpad = values.new_zeros(values.shape[0], values.shape[1], amount, values.shape[3])
        out.append((torch.cat([pad, keys], dim=2), torch.cat([vpad, values], dim=2)))
    return out


class KVPool:
    """Every KV cache of one AR stage; see the module docstring for the layout."""

    def __init__(self) -> None:
        self._solo: dict[str, DynamicCache] = {}
        self._rows: list[str] = []
        self._pads: list[int] = []
        self._batch: DynamicCache | None = None

    # -- membership --------------------------------------------------------------------------

    def add(self, request_id: str, cache: DynamicCache) -> None:
        """A request's cache after its prefill (batch size 1)."""
        self._solo[request_id] = cache

    def release(self, request_id: str) -> None:
        """Forget a request's cache, wherever it is. Idempotent."""
        self._solo.pop(request_id, None)
        if request_id in self._rows:
            self._rearrange([r for r in self._rows if r != request_id], park_leaving=False)

    def take(self, request_id: str) -> DynamicCache | None:
        """Remove a request's cache from the pool and hand it over (solo, unpadded): a kept
        conversation state owns it from now on."""
        if request_id in self._solo:
            return self._solo.pop(request_id)
        if request_id not in self._rows:
            return None
        cache = self._cut(self._rows.index(request_id))
        self._rearrange([r for r in self._rows if r != request_id], park_leaving=False)
        return cache

    def __len__(self) -> int:
        """Requests holding a cache here (solo or in the batch)."""
        return len(self._solo) + len(self._rows)

    # -- the batch ---------------------------------------------------------------------------

    @property
    def rows(self) -> list[str]:
        """Request ids of the batch rows, in batch order."""
        return list(self._rows)

    def arrange(self, wanted: list[str]) -> list[str]:
        """Make the batch hold exactly ``wanted`` (any order in, batch order out); rows that leave
        it keep their caches, solo."""
        return self._rearrange(wanted, park_leaving=True)

    def _rearrange(self, wanted: list[str], park_leaving: bool) -> list[str]:
        wanted_set = set(wanted)
        if set(self._rows) == wanted_set:
            return self.rows
        if park_leaving:
            for i, rid in enumerate(self._rows):
                if rid not in wanted_set:
                    self._solo[rid] = self._cut(i)
        keep = [i for i, rid in enumerate(self._rows) if rid in wanted_set]
        layers: Layers = []
        if keep and self._batch is not None:
            index = torch.tensor(keep, device=self._device())
            layers = [(k[index], v[index]) for k, v in _layers(self._batch)]
        self._rows = [self._rows[i] for i in keep]
        self._pads = [self._pads[i] for i in keep]
        joining = [rid for rid in wanted if rid not in self._rows]
        for rid in joining:
            layers = self._join(layers, _layers(self._solo.pop(rid)), rid)
        layers = self._trim(layers)
        self._batch = DynamicCache(ddp_cache_data=layers) if self._rows else None
        return self.rows

    def batch_cache(self) -> DynamicCache:
        if self._batch is None:
            raise RuntimeError("KVPool: no rows arranged")
        return self._batch

    def attention_mask(self, new_tokens: int = 1) -> torch.Tensor:
        """[rows, cached + new_tokens] mask: 0 on each row's left padding."""
        length = self._batch.get_seq_length() + new_tokens if self._batch is not None else new_tokens
        device = self._device()
        pads = torch.tensor(self._pads, device=device)[:, None]
        return (torch.arange(length, device=device)[None] >= pads).long()

    # -- internals ---------------------------------------------------------------------------

    def _device(self) -> torch.device:
        if self._batch is not None:
            return _layers(self._batch)[0][0].device
        return torch.device("cpu")

    def _cut(self, row: int) -> DynamicCache:
        pad = self._pads[row]
        return DynamicCache(
            ddp_cache_data=[
                (k[row : row + 1, :, pad:].clone(), v[row : row + 1, :, pad:].clone())
                for k, v in _layers(self.batch_cache())
            ]
        )

    def _join(self, layers: Layers, solo: Layers, request_id: str) -> Layers:
        if not layers:
            self._rows, self._pads = [request_id], [0]
            return solo
        have, new = layers[0][0].shape[2], solo[0][0].shape[2]
        if new > have:
            layers = _left_pad(layers, new - have)
            self._pads = [p + new - have for p in self._pads]
        solo = _left_pad(solo, max(have - new, 0))
        self._rows.append(request_id)
        self._pads.append(max(have - new, 0))
        return [
            (torch.cat([k, sk], dim=0), torch.cat([v, sv], dim=0))
            for (k, v), (sk, sv) in zip(layers, solo)
        ]

    def _trim(self, layers: Layers) -> Layers:
        """Drop the left columns that are padding in every row (left behind by leaving rows)."""
        common = min(self._pads, default=0)
        if common == 0:
            return layers
        self._pads = [p - common for p in self._pads]
        return [(k[:, :, common:], v[:, :, common:]) for k, v in layers]
