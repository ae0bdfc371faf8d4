"""The cache service: the one owner of varuna_fx's on-disk caches (captures, graphs, plans,
partitions), each a client that says what its entries hold and how to check them.

What every cache gets from here, the same way:

* **one switch**, ``$VARUNA_FX_CACHE_MODE``: ``1`` (the default: the process's memory and
  disk), ``memory`` (the process's only) or ``0`` (off). The older per-family switches are
  still read and win for their caches where set: ``VARUNA_FX_GRAPH_CACHE=0`` (captures and
  graphs), ``VARUNA_FX_PLAN_CACHE=1|memory|0`` (plans and partitions).
* **one rule for noticing changed code**: a key is a SHA-256 of the cache's kind and format,
  :func:`code_digest` (the source of every varuna_fx module, the varuna_fx, torch and Python
  versions: any change to the code that computed an entry makes another key) and what the
  client describes. A cache whose entries also depend on the user's code (captures) records
  every source file the process had loaded and uses an entry only while they are unchanged
  (``watch_files``).
* **one in-memory layer** (``memory=True``): the newest entries of the process, before disk.
* **one damaged-entry rule**: a file that is not JSON, nested too deep (``safe_json``), not
  sealed by this user's key, of another format or key, or that the client's decoder refuses is
  ignored with a :class:`CacheWarning`, counted (``stats["ignored"]``) and rewritten by the
  next store. It is never an error and never acted on: a cache only saves time.
* **entries bound to their writer**: every file is sealed with an HMAC-SHA256 under a per-user
  key kept outside the cache folder (:func:`key_path`: ``$VARUNA_FX_CACHE_KEY``, else
  ``$XDG_CONFIG_HOME/varuna_fx/cache.key``, else ``~/.config/varuna_fx/cache.key``), created
  with mode 0600 and regenerated when it is not a plain file of this user's readable by them
  alone. A cache folder that others can write (shared, copied, planted) then holds nothing this
  process will use: an entry someone else sealed, or re-sealed with a plain digest, is ignored.
  Where no key can be had, the disk layer is off (with one warning) and memory still works.

Files: ``$VARUNA_FX_CACHE_DIR/<kind>/<key>.json`` (``world/files.cache_dir``), written to a
temporary name and renamed, the newest ``max_entries`` kept.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
import sys
import sysconfig
import warnings
from collections import Counter, OrderedDict
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any, Generic, TypeVar

from . import safe_json, switches
from .files import CACHE_ENV, cache_dir, keep_newest, write_atomically

MODE_ENV = "VARUNA_FX_CACHE_MODE"
KEY_ENV = "VARUNA_FX_CACHE_KEY"
# the switches each family had before this service: read, and winning where set
_FAMILY_SWITCHES = {"graphs": "VARUNA_FX_GRAPH_CACHE", "plans": "VARUNA_FX_PLAN_CACHE"}
_PACKAGE = Path(__file__).resolve().parent.parent

T = TypeVar("T")


class CacheWarning(UserWarning):
    """A cache file was ignored (damaged, edited, sealed by someone else, another format)."""


# -- the switch ----------------------------------------------------------------------------------


def mode(family: str) -> str:
    """"disk" (memory and disk), "memory" or "off" for the caches of ``family`` ("graphs":
    captures and shape observations, "plans": searches and partitions): the family's older
    switch where it is set, else the one switch (both read through ``world/switches``)."""
    older = _FAMILY_SWITCHES.get(family)
    return switches.read(older if older is not None and switches.given(older) else MODE_ENV)


# -- noticing changed code -----------------------------------------------------------------------


@lru_cache(maxsize=1)
def code_digest() -> str:
    """The source of every varuna_fx module with the varuna_fx, torch and Python versions: the
    code that computed an entry, in every key."""
    import torch  # a version, read once per process

    # the version read, not imported: the package root sits above this layer (and is loaded)
    version = str(getattr(sys.modules.get("varuna_fx"), "__version__", ""))
    digest = hashlib.sha256(repr((version, torch.__version__, sys.version_info[:3])).encode())
    for path in sorted(_PACKAGE.rglob("*.py")):
        digest.update(str(path.relative_to(_PACKAGE)).encode())
        try:
            digest.update(path.read_bytes())
        except OSError:  # no source (a zipped install): the version must do
            pass
    return digest.hexdigest()


def loaded_files() -> list[list[Any]]:
    """[path, size, mtime_ns] of every source file of an imported module, but Python's own
    and torch's (their versions are in :func:`code_digest`)."""
    import torch

    skip = tuple(str(Path(p)) + os.sep for p in {
        sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"],
        os.path.dirname(torch.__file__)})
    out = []
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if not isinstance(file, str) or file.startswith(skip):
            continue
        try:
            st = os.stat(file)
        except OSError:
            continue
        out.append([file, st.st_size, st.st_mtime_ns])
    return sorted(out)


def files_unchanged(files: Any) -> bool:
    """Whether every [path, size, mtime_ns] of ``files`` still holds (False for a malformed
    list: a damaged entry is not a fresh one)."""
    if not isinstance(files, list):
        return False
    for row in files:
        if not (isinstance(row, list) and len(row) == 3 and isinstance(row[0], str)):
            return False
        try:
            st = os.stat(row[0])
        except OSError:
            return False
        if st.st_size != row[1] or st.st_mtime_ns != row[2]:
            return False
    return True


# -- the writer's key ----------------------------------------------------------------------------


def key_path() -> Path:
    """Where this user's sealing key lives: ``$VARUNA_FX_CACHE_KEY``, else
    ``$XDG_CONFIG_HOME/varuna_fx/cache.key``, else ``~/.config/varuna_fx/cache.key``."""
    explicit = switches.read(KEY_ENV)
    if explicit:
        return Path(explicit)
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "varuna_fx" / "cache.key"


_KEYS: dict[str, bytes | None] = {}
_warned: set[str] = set()


def seal_key() -> bytes | None:
    """This user's key (read, or created mode 0600); None where none can be had."""
    path = key_path()
    if str(path) not in _KEYS:
        _KEYS[str(path)] = _load_or_make_key(path)
    return _KEYS[str(path)]


def _load_or_make_key(path: Path) -> bytes | None:
    root = Path(switches.read(CACHE_ENV) or Path.home() / ".cache" / "varuna_fx")
    try:
        inside = path.resolve().is_relative_to(root.resolve())
    except OSError:
        inside = False
    if inside:  # who can plant entries there may read or replace the key too
        _warn_once(f"the cache key {path} lies inside the cache folder {root}: keep it outside "
                   f"(${KEY_ENV}); the on-disk caches are off")
        return None
    for _ in range(3):  # another process may be creating it at the same moment
        key, trusted = _read_key(path)
        if key is not None and trusted:
            return key
        try:
            made = _write_key(path, replace=key is not None or trusted is False)
        except FileExistsError:
            continue
        except OSError as e:
            _warn_once(f"cannot create the cache key {path} ({e}); the on-disk caches are off "
                       f"(set ${KEY_ENV} to a file of yours)")
            return None
        if made is not None:
            return made
    return None


def _read_key(path: Path) -> tuple[bytes | None, bool | None]:
    """(key, trusted): (None, None) when there is no file; trusted False for a file that is
    not this user's own, readable by them alone (it is then replaced)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None, None
    except OSError as e:  # a symbolic link (O_NOFOLLOW), a folder...
        _warn_once(f"the cache key {path} is not a plain file ({e}): a new one is made")
        return b"", False
    try:
        st = os.fstat(fd)
        text = os.read(fd, 256).decode("ascii", "replace").strip()
    finally:
        os.close(fd)
    mine = not hasattr(os, "getuid") or st.st_uid == os.getuid()
    if not stat.S_ISREG(st.st_mode) or not mine or st.st_mode & 0o077:
        _warn_once(f"the cache key {path} is not a file of yours readable by you alone "
                   f"(mode {stat.S_IMODE(st.st_mode):o}): a new one is made, and entries "
                   "sealed with the old one are ignored")
        return b"", False
    try:
        key = bytes.fromhex(text)
    except ValueError:
        return b"", False
    return (key, True) if len(key) == 32 else (b"", False)


def _write_key(path: Path, replace: bool) -> bytes | None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = secrets.token_bytes(32)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
                 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            os.fchmod(out.fileno(), 0o600)  # whatever the umask
            out.write(key.hex())
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # FileExistsError where another process made it first
    finally:
        Path(tmp).unlink(missing_ok=True)
    return key


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(f"varuna_fx: {message}", CacheWarning, stacklevel=4)


# -- the seal ------------------------------------------------------------------------------------


def sealed(entry: dict[str, Any]) -> str:
    """``entry`` as JSON with its HMAC under this user's key (ValueError when there is none)."""
    key = seal_key()
    if key is None:
        raise ValueError("no cache key")
    body = json.dumps(entry, sort_keys=True)
    return json.dumps({"hmac": hmac.new(key, body.encode(), hashlib.sha256).hexdigest(),
                       "entry": entry})


def unsealed(text: str | bytes) -> dict[str, Any]:
    """The entry :func:`sealed` wrote; ``ValueError`` when the text is not such an entry, is
    nested too deep, or was not sealed with this user's key (edited, corrupted, another
    writer's)."""
    outer = safe_json.loads(text)
    if not isinstance(outer, dict) or not isinstance(outer.get("entry"), dict) or \
            not isinstance(outer.get("hmac"), str):
        raise ValueError("not a sealed entry")
    key = seal_key()
    if key is None:
        raise ValueError("no cache key to check it with")
    body = json.dumps(outer["entry"], sort_keys=True)
    if not hmac.compare_digest(hmac.new(key, body.encode(), hashlib.sha256).hexdigest(),
                               outer["hmac"]):
        raise ValueError("not sealed by this user's key: edited, corrupted or another writer's")
    return outer["entry"]


# -- a cache -------------------------------------------------------------------------------------


class DiskCache(Generic[T]):
    """One cache: ``$VARUNA_FX_CACHE_DIR/<kind>/``, switched by ``family`` (see :func:`mode`).

    ``load(key, decode)`` gives the value stored under ``key`` (memory, then disk) or None;
    ``decode`` turns a checked entry's fields into the value and raises ``ValueError``,
    ``KeyError``, ``TypeError``... for one it refuses. ``store(key, value, fields)`` keeps
    ``value`` in memory and the JSON-able ``fields`` on disk. ``stats`` counts hit, miss,
    write, stale (a watched file changed) and ignored (a damaged entry)."""

    def __init__(self, kind: str, format: int, max_entries: int, *,  # noqa: A002
                 family: str, memory: bool = False, watch_files: bool = False,
                 warning: type[Warning] = CacheWarning) -> None:
        self.kind, self.format, self.max_entries = kind, format, max_entries
        self.family, self.memory, self.watch_files, self.warning = \
            family, memory, watch_files, warning
        self.stats: Counter[str] = Counter()
        self._memory: OrderedDict[str, T] = OrderedDict()

    def mode(self) -> str:
        return mode(self.family)

    def key(self, description: str) -> str:
        """The key of an entry computed from ``description`` (everything it depends on, as
        exact text) by this code: see the module docstring."""
        text = repr((self.kind, self.format, code_digest(), description))
        return hashlib.sha256(text.encode()).hexdigest()[:40]

    def path(self, key: str) -> Path:
        return cache_dir(self.kind) / f"{key}.json"

    def load(self, key: str, decode: Callable[[dict[str, Any]], T]) -> T | None:
        found = self._memory.get(key) if self.memory else None
        if found is not None:
            self._memory.move_to_end(key)
        elif self.mode() == "disk":
            found = self._read(key, decode)
            if found is not None:
                self._remember(key, found)
        self.stats["hit" if found is not None else "miss"] += 1
        return found

    def _read(self, key: str, decode: Callable[[dict[str, Any]], T]) -> T | None:
        path = self.path(key)
        try:
            text = path.read_bytes()
        except OSError:
            return None
        try:
            entry = unsealed(text)
            if entry.get("format") != self.format or entry.get("key") != key:
                raise ValueError("written for another key or by another format")
            if self.watch_files and not files_unchanged(entry.get("files")):
                self.stats["stale"] += 1  # not damage: the user's code changed since
                return None
            return decode(entry)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError,
                RuntimeError) as e:
            self.stats["ignored"] += 1
            warnings.warn(f"varuna_fx: ignoring the {self.kind.removesuffix('s')} cache file {path} ({e}); it is "
                          "computed again and rewritten", self.warning, stacklevel=4)
            return None

    def store(self, key: str, value: T, fields: dict[str, Any]) -> bool:
        """Keep ``value`` (in memory, where this cache has it) and ``fields`` on disk; False
        when nothing was written (off, memory only, no key, a folder that cannot be
        written: a cache only saves time, the caller goes on)."""
        if self.mode() == "off":
            return False
        self._remember(key, value)
        if self.mode() != "disk":
            return False
        entry = {"format": self.format, "key": key, **fields}
        if self.watch_files:
            entry["files"] = loaded_files()
        directory = cache_dir(self.kind)
        try:
            write_atomically(directory, f"{key}.json", sealed(entry))
            keep_newest(directory, self.max_entries)
        except (OSError, ValueError):
            return False
        self.stats["write"] += 1
        return True

    def clear(self) -> None:
        """Forget the process's entries (the files stay)."""
        self._memory.clear()

    def _remember(self, key: str, value: T) -> None:
        if not self.memory:
            return
        self._memory[key] = value
        self._memory.move_to_end(key)
        while len(self._memory) > self.max_entries:
            self._memory.popitem(last=False)
