"""The one compatibility point for transformers' ``past_key_values`` -> ``cache`` rename (vat/target/cache.py): the
keyword comes from the model forward's own signature, the returned cache is read under either name, and a real
cached decode through it equals the uncached forward on the installed transformers (CI runs this file on the lowest
and the highest version of the tested range: .venv and .venv-interop)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import torch
from tiny_models import tiny_model
from torch import nn

from vat.target import cache as cache_api
from vat.target.cache import cache_keyword, cache_kwargs, new_cache, output_cache


class _Old(nn.Module):
    def forward(self, input_ids=None, past_key_values=None, use_cache=False):
        return SimpleNamespace(past_key_values=past_key_values)


class _New(nn.Module):
    def forward(self, input_ids=None, cache=None, use_cache=False):
        return SimpleNamespace(cache=cache)


class _KwargsOnly(nn.Module):
    def forward(self, input_ids=None, **kwargs):
        return SimpleNamespace(**kwargs)


def test_keyword_follows_the_forward_signature_on_both_sides_of_the_rename():
    sentinel = object()
    assert cache_keyword(_Old()) == "past_key_values" and cache_keyword(_New()) == "cache"
    for model in (_Old(), _New()):
        out = model(input_ids=None, **cache_kwargs(model, sentinel))
        assert output_cache(out) is sentinel
    assert cache_kwargs(_New(), None) == {}  # no cache: nothing passed
    assert output_cache(SimpleNamespace(logits=0)) is None


def test_kwargs_only_forward_falls_back_to_the_installed_version(monkeypatch):
    import transformers

    cache_api._cache_keyword_of.cache_clear()
    cache_api._cache_keyword_of_version.cache_clear()
    try:
        monkeypatch.setattr(transformers, "__version__", "5.18.0")
        assert cache_keyword(_KwargsOnly()) == "past_key_values"  # accepted by every release before 5.40
        cache_api._cache_keyword_of.cache_clear()
        cache_api._cache_keyword_of_version.cache_clear()
        monkeypatch.setattr(transformers, "__version__", "5.40.0")
        assert cache_keyword(_KwargsOnly()) == "cache"
    finally:
        cache_api._cache_keyword_of.cache_clear()
        cache_api._cache_keyword_of_version.cache_clear()


def test_real_model_cached_decode_through_the_compat_point_equals_the_full_forward():
    """On the installed transformers: the keyword is one the model's forward names, and prefill + 2 cached steps
    give the uncached logits."""
    model = tiny_model("olmoe")
    keyword = cache_keyword(model)
    assert keyword in inspect.signature(type(model).forward).parameters
    ids = torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(input_ids=ids).logits
        cache = new_cache(model.config)
        out = model(input_ids=ids[:, :8], use_cache=True, **cache_kwargs(model, cache))
        assert output_cache(out) is cache and cache.get_seq_length() == 8
        steps = [out.logits]
        for t in (8, 9):
            out = model(input_ids=ids[:, t : t + 1], use_cache=True, **cache_kwargs(model, output_cache(out)))
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
