"""The target's KV cache during speculative decoding: create, crop, compact to an accepted path, tree masks.

Every touch point with transformers' cache API and its 4-D attention-mask convention lives here, so a
transformers upgrade changes one file. Tested on transformers 5.17 and 5.24 (README, docs/interop.md):

* The cache keyword: models take ``past_key_values`` up to 5.2x and ``cache`` from the rename on (5.24 takes both,
  ``past_key_values`` deprecated; 5.40 drops it), and their outputs carry ``past_key_values`` or ``cache`` the same
  way. Every call into a transformers model passes its cache through :func:`cache_kwargs` and reads the returned one
  with :func:`output_cache`: the one compatibility point for the rename.

* ``DynamicCache`` holds one ``DynamicLayer`` per decoder layer with ``keys`` / ``values`` of shape
  (B, H_kv, S, hd); ``Cache.crop`` takes the number of tokens to *remove* (negative), so vat slices the layers itself.
* A 4-D ``attention_mask`` (B, 1, T, S_past + T) is passed to the attention functions as-is; eager attention *adds*
  it to the scores, so it must be an additive float mask (0 = attend, dtype minimum = masked), which SDPA accepts too.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import transformers
from packaging.version import Version
from transformers import DynamicCache

from vat.errors import VatError

_CACHE_NAMES = ("cache", "past_key_values")  # new name first


@functools.cache
def _cache_keyword_of(forward: Any) -> str:
    try:
        params = inspect.signature(forward).parameters  # follows the deprecate_kwarg wrappers (functools.wraps)
    except (TypeError, ValueError):
        params = {}
    for name in _CACHE_NAMES:
        if name in params:
            return name
    return _cache_keyword_of_version()


@functools.lru_cache(maxsize=1)
def _cache_keyword_of_version() -> str:
    """Fallback for a forward whose signature names neither (``**kwargs`` only): ``past_key_values`` is accepted by
    every release before 5.40 (natively, or as the deprecated alias of ``cache``), ``cache`` from then on."""
    return "cache" if Version(transformers.__version__).release >= (5, 40) else "past_key_values"


def cache_keyword(model: Any) -> str:
    """The keyword ``model``'s forward takes its KV cache by: ``"cache"`` after transformers' rename, else
    ``"past_key_values"`` (read from the forward's signature, so a model class that was not renamed yet still
    gets the name it accepts)."""
    forward = getattr(type(model), "forward", None) or getattr(model, "forward", None)
    return _cache_keyword_of(forward)


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``{keyword: cache}`` for a call into a transformers model (empty when ``cache`` is None):
    ``model(input_ids=..., **cache_kwargs(model, cache))``."""
    return {} if cache is None else {cache_keyword(model): cache}


def output_cache(outputs: Any) -> Any:
    """The KV cache a transformers model returned (``outputs.cache`` after the rename, ``outputs.past_key_values``
    before), or None."""
    for name in _CACHE_NAMES:
        value = getattr(outputs, name, None)
        if value is not None:
            return value
    return None


def new_cache(config: Any = None) -> Any:
    """An empty ``DynamicCache`` (pass the model config for sliding-window / hybrid layer types)."""
    return DynamicCache(config=config) if config is not None else DynamicCache()


def cache_length(cache: Any) -> int:
    """Number of cached positions (0 for ``None`` or an empty cache)."""
    return 0 if cache is None else int(cache.get_seq_length())


def _full_layers(cache: Any) -> list:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise VatError(f"unsupported KV cache type {type(cache).__name__}: vat eval needs a transformers DynamicCache")
    for layer in layers:
        if getattr(layer, "is_sliding", False):
            raise VatError(
                "speculative decoding with a sliding-window KV cache is not supported (the cache cannot be compacted)"
            )
    return layers


def crop_cache(cache: Any, length: int) -> None:
    """Keep the first ``length`` positions of every layer (discard rejected drafts), in place."""
    for layer in _full_layers(cache):
        if getattr(layer, "is_initialized", True) and layer.keys is not None and layer.keys.numel():
            layer.keys = layer.keys[:, :, :length]
            layer.values = layer.values[:, :, :length]


def select_cache_positions(cache: Any, keep: torch.Tensor) -> None:
    """Keep only the cached positions ``keep`` (in this order) in every layer, in place: compaction of the KV cache to
    the accepted path of a verified tree.

    Args:
        cache: a ``DynamicCache``.
        keep: (S',) int64 indices into the cached positions, ascending (prefix, then the accepted tree nodes).
    """
    for layer in _full_layers(cache):
        if getattr(layer, "is_initialized", True) and layer.keys is not None and layer.keys.numel():
            idx = keep.to(layer.keys.device)
            layer.keys = layer.keys.index_select(2, idx)
            layer.values = layer.values.index_select(2, idx)


def tree_attention_mask(ancestors: torch.Tensor, past_length: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive 4-D attention mask of a tree-verification forward over a cache of ``past_length`` positions.

    Args:
        ancestors: (N, N) bool, ``ancestors[i, j]`` = block entry j is entry i itself or one of its ancestors.
        past_length: cached positions (all visible to every tree entry).
        dtype: the model's compute dtype (the mask is added to attention scores).

    Returns:
        (1, 1, N, past_length + N) float mask: 0 where attending is allowed, the dtype's minimum elsewhere.
    """
    n = ancestors.shape[0]
    allowed = torch.cat(
        [torch.ones(n, past_length, dtype=torch.bool, device=ancestors.device), ancestors.bool()], dim=1
    )  # (N, S + N)
    mask = torch.zeros(n, past_length + n, dtype=dtype, device=ancestors.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]  # (1, 1, N, S + N)


def sliding_window_limit(config: Any) -> int | None:
    """The smallest attention window of the target's sliding-window layers, or None when every layer is global.

    A custom 4-D tree mask replaces the model's own mask, window included, so tree verification is exact only while
    the whole sequence fits in the window.
    """
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return int(window) if window and "sliding_attention" in layer_types else None
    if getattr(config, "use_sliding_window", None) is False:
        return None
    return int(window) if window else None
