"""Deeply nested JSON (issue 42 item 3): ``[[[[...]]]]`` a hundred thousand deep made
``json.loads`` raise ``RecursionError`` out of every reader. One bounded reader
(``world/safe_json.py``) now stands in front of each: the caches (graphs/, plans/, partitions/,
captures/, profiles/) and metrics.jsonl ignore such a file with a warning; a checkpoint
marker and a pretrained config.json are refused with their module's error."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

import varuna_fx as vf
from varuna_fx.capture import capture_cache
from varuna_fx.checkpoint.directory import MARKER, latest_checkpoint, read_marker
from varuna_fx.checkpoint.hf.safetensors_files import read_json
from varuna_fx.monitor.report import _train_summary
from varuna_fx.monitor.sinks import read_jsonl
from varuna_fx.passes import shape_cache
from varuna_fx.planner import cache as plan_cache
from varuna_fx.planner import machine, partition_cache, profile, steady
from varuna_fx.world import disk_cache, safe_json
from varuna_fx.world.files import cache_dir
from varuna_fx.world.membership import Generation

DEEP = "[" * 100_000 + "]" * 100_000  # past the interpreter's recursion limit


def test_the_reader_bounds_the_depth() -> None:
    with pytest.raises(safe_json.JsonTooDeep):
        safe_json.loads(DEEP)
    just_under = "[" * 500 + "]" * 500
    with pytest.raises(safe_json.JsonTooDeep):
        safe_json.loads(just_under)
    assert safe_json.loads('{"a": [1, {"b": 2}]}') == {"a": [1, {"b": 2}]}
    assert issubclass(safe_json.JsonTooDeep, ValueError)


@pytest.mark.parametrize("cache, load", [
    (shape_cache.CACHE, lambda key: shape_cache.load(key, [])),
    (plan_cache.CACHE, plan_cache.load),
    (partition_cache.CACHE, partition_cache.load),
    (capture_cache.CACHE, lambda key: capture_cache.load(key, None, None)),
], ids=["graphs", "plans", "partitions", "captures"])
@pytest.mark.parametrize("text", ["deep", "sealed deep"])
def test_a_cache_ignores_it_with_a_warning(cache: disk_cache.DiskCache, load: object,
                                           text: str) -> None:
    key = "0" * 40
    path = cache.path(key)
    path.parent.mkdir(parents=True)
    if text == "deep":
        path.write_text(DEEP)
    else:  # sealed with this user's key, nested just under the interpreter's limit
        nested: object = 0
        for _ in range(600):
            nested = [nested]
        path.write_text(disk_cache.sealed({"format": cache.format, "key": key, "x": nested}))
    cache.clear()
    ignored = cache.stats["ignored"]
    with pytest.warns(disk_cache.CacheWarning, match="nested deeper"):
        assert load(key) is None  # type: ignore[operator]
    assert cache.stats["ignored"] == ignored + 1


def test_the_profile_cache_ignores_it_with_a_warning() -> None:
    path = profile.cache_dir("profiles") / "k.json"
    path.parent.mkdir(parents=True)
    path.write_text(DEEP)
    with pytest.warns(UserWarning, match="nested deeper"):
        assert profile.load_cached("k") is None


def test_metrics_skip_the_line_with_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n' + DEEP + '\n{"step": 2, "loss": 1.5}\n'
                    '{"step": 3, "lo')  # and a torn last line, skipped quietly as before
    with pytest.warns(UserWarning, match="line 2 of") as caught:
        records = read_jsonl(path)
    assert [r["step"] for r in records] == [1, 2] and len(caught) == 1


def test_a_checkpoint_marker_is_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "step_1"
    ckpt.mkdir()
    (ckpt / MARKER).write_text(DEEP)
    with pytest.raises(vf.CheckpointError, match="nested deeper"):
        read_marker(str(ckpt))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert latest_checkpoint(tmp_path) is None  # skipped with a warning, as other damage
    assert any("nested deeper" in str(w.message) for w in caught)


def test_a_pretrained_config_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text('{"model_type": ' + DEEP + "}")
    with pytest.raises(vf.PretrainedError, match="nested deeper"):
        read_json(str(config))


def test_the_train_summary_and_peer_payloads_are_bounded(tmp_path: Path) -> None:
    """The rest of the class: the train command's summary.json (read by the command and by
    ``varuna-fx report``) and what a peer writes to the membership store (a generation, a
    joiner's fingerprint) go through the same reader, so a deep one is a ValueError each
    reader already answers, never a RecursionError."""
    (tmp_path / "summary.json").write_text(DEEP)
    assert _train_summary(tmp_path) == {}  # read as "no summary"
    with pytest.raises(ValueError, match="nested deeper"):
        Generation.from_json(DEEP)


def test_the_machine_and_link_caches_read_a_deep_file_as_unusable(tmp_path: Path) -> None:
    """The planner's kept machine costs and kept links (planner/machine.py, steady.py) are
    measured again rather than read from a deep file."""
    with pytest.raises(ValueError, match="nested deeper"):
        machine.from_json(DEEP)
    path = cache_dir("links") / "k.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(DEEP)
    assert steady.load("k") is None
