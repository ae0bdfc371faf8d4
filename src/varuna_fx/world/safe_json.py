"""JSON read from disk, bounded in depth, so a crafted file raises ``ValueError`` and nothing else.

Python's decoder recurses once per nesting level: ``[[[[...]]]]`` a hundred thousand deep raises
``RecursionError`` out of ``json.loads``, and a structure just under the interpreter's limit
makes every later recursive walk of it (``json.dumps`` to check a seal, a decoder of graphs)
raise it instead. Every file varuna_fx reads that another process, or another person, could
have written (cache entries, checkpoint markers, ``metrics.jsonl``, a pretrained
``config.json``) goes through :func:`loads`: deeper than :data:`MAX_DEPTH` is refused with a
:class:`JsonTooDeep` (a ``ValueError``, which each reader already turns into its own answer:
a cache ignores the entry, a checkpoint raises ``CheckpointError``).
"""

from __future__ import annotations

import json
from typing import Any

# No file varuna_fx writes nests deeper than a few dozen levels (a captured graph's arguments,
# a Hugging Face config's sub-configs); well under the interpreter's recursion limit (1000).
MAX_DEPTH = 200


class JsonTooDeep(ValueError):  # noqa: N818 - a ValueError: readers already handle those
    """JSON nested deeper than :data:`MAX_DEPTH`."""


def loads(text: str | bytes, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads(text)``, refusing nesting deeper than ``max_depth`` with
    :class:`JsonTooDeep` (also where the decoder itself would run out of stack)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise JsonTooDeep(f"JSON nested deeper than the interpreter's recursion limit "
                          f"(at most {max_depth} levels are read)") from None
    _check_depth(value, max_depth)
    return value


def _check_depth(value: Any, max_depth: int) -> None:
    # iterative: a walk that recursed would meet the very limit this check guards
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > max_depth:
            raise JsonTooDeep(f"JSON nested deeper than {max_depth} levels")
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, (dict, list)))
