"""The cache service (world/disk_cache.py, issue 39 item 5): the capture, shape, plan and
partition caches are its clients and share its switch, its rule for changed code, its memory
layer and its damaged-entry rule, each checked here once for all four."""

from __future__ import annotations

from typing import Any

import pytest

from varuna_fx.capture import capture_cache
from varuna_fx.passes import shape_cache
from varuna_fx.planner import cache as plan_cache
from varuna_fx.planner import partition_cache
from varuna_fx.world import disk_cache

CLIENTS = {"captures": capture_cache.CACHE, "graphs": shape_cache.CACHE,
           "plans": plan_cache.CACHE, "partitions": partition_cache.CACHE}


def _roundtrip(cache: disk_cache.DiskCache, key: str) -> Any:
    cache.clear()
    return cache.load(key, lambda entry: entry["value"])


@pytest.mark.parametrize("name", sorted(CLIENTS))
def test_one_damaged_entry_rule(name: str) -> None:
    cache = CLIENTS[name]
    key = cache.key("a description")
    assert cache.store(key, "kept", {"value": "kept"})
    assert _roundtrip(cache, key) == "kept"
    path = cache.path(key)
    good = path.read_text()
    for damaged in ["not json", good[: len(good) // 2], good.replace("kept", "edit"),
                    disk_cache.sealed({"format": cache.format + 1, "key": key, "value": 1}),
                    disk_cache.sealed({"format": cache.format, "key": "other", "value": 1})]:
        path.write_text(damaged)
        ignored = cache.stats["ignored"]
        with pytest.warns(disk_cache.CacheWarning, match=f"ignoring the {name[:-1]} cache"):
            assert _roundtrip(cache, key) is None
        assert cache.stats["ignored"] == ignored + 1
    # a decoder's refusal is damage too
    path.write_text(good)
    with pytest.warns(disk_cache.CacheWarning, match="impossible"):
        cache.clear()
        assert cache.load(key, lambda entry: (_ for _ in ()).throw(ValueError("impossible"))) \
            is None
    cache.store(key, "kept", {"value": "kept"})  # rewritten whole
    assert _roundtrip(cache, key) == "kept"


def test_one_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, want in (("0", "off"), ("memory", "memory"), ("1", "disk")):
        monkeypatch.setenv("VARUNA_FX_CACHE_MODE", value)
        assert {c.mode() for c in CLIENTS.values()} == {want}
    monkeypatch.setenv("VARUNA_FX_CACHE_MODE", "0")
    key = plan_cache.CACHE.key("off")
    assert not plan_cache.CACHE.store(key, "x", {"value": "x"})
    assert plan_cache.CACHE.load(key, lambda e: e["value"]) is None
    assert plan_cache.search_key(1) is None and not capture_cache.enabled()
    monkeypatch.setenv("VARUNA_FX_CACHE_MODE", "memory")  # the process's only: no file
    assert not plan_cache.CACHE.store(key, "x", {"value": "x"})
    assert plan_cache.CACHE.load(key, lambda e: e["value"]) == "x"
    assert not plan_cache.CACHE.path(key).exists()
    # the older per-family switches win for their caches where set
    monkeypatch.setenv("VARUNA_FX_CACHE_MODE", "1")
    monkeypatch.setenv("VARUNA_FX_GRAPH_CACHE", "0")
    monkeypatch.setenv("VARUNA_FX_PLAN_CACHE", "memory")
    assert [CLIENTS[n].mode() for n in sorted(CLIENTS)] == ["off", "off", "memory", "memory"]


def test_one_rule_for_changed_code(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = {name: cache.key("same") for name, cache in CLIENTS.items()}
    assert len(set(keys.values())) == 4  # each cache's own keys
    monkeypatch.setattr(disk_cache, "code_digest", lambda: "another varuna_fx")
    assert all(cache.key("same") != keys[name] for name, cache in CLIENTS.items())


def test_one_memory_layer() -> None:
    cache = plan_cache.CACHE
    key = cache.key("memory layer")
    cache.store(key, "in memory", {"value": "on disk"})
    assert cache.load(key, lambda e: e["value"]) == "in memory"  # before the file
    cache.clear()
    assert cache.load(key, lambda e: e["value"]) == "on disk"
    # a capture is bound to its model object; shape observations are read from their file
    assert not shape_cache.CACHE.memory and not capture_cache.CACHE.memory
