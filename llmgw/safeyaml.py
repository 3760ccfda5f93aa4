"""YAML as configuration reads it: PyYAML's safe loader with limits on what a few bytes
may cost, refusing what it would otherwise take silently or crash on. Each refusal is a
YAML error (`Refused`, with the line), so a caller reports it as it reports a syntax error.
Used by `llmgw.config` (files and variables) and `llmgw ctl apply`'s models file.
"""

from __future__ import annotations

import math
from typing import Any

import yaml
from yaml.composer import ComposerError
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

MAX_DEPTH = 64
"""Collections nested deeper than this are refused: PyYAML composes recursively, so
`[[[[...` a few thousand deep ended in a RecursionError (a traceback) instead of an error."""

MAX_VALUES = 1_000_000
"""Values a YAML document's aliases may add once expanded, beyond the values it writes out.
PyYAML shares an anchor's value among its aliases, but everything that walks the result
(msgspec, an error message's repr) visits it once per alias: ten anchors of nine aliases
each ("billion laughs") are 9**10 values from a kilobyte. Merge keys and a few shared
sections stay far below. (The values written out are bounded by the largest file read,
llmgw.config.MAX_FILE_BYTES: a keys file of 60,000 keys writes a million.)"""


class Refused(ComposerError):
    """What `_Loader` refuses in text that is otherwise valid YAML."""


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader with the limits above, and refusing what it would otherwise
    take silently: a key given twice (the last one won) and numbers that are not finite
    (`.nan` passed every `<= 0` check of a duration). Each refusal is a YAML error with
    the line, so every caller reports it as it reports a syntax error."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._sizes: dict[int, int] = {}
        self._written = 0
        """Nodes written out so far (an alias is not one): no size up to this is expansion."""

    def compose_node(self, parent: Node | None, index: int) -> Node | None:
        if not self.check_event(AliasEvent):
            self._written += 1
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise Refused(
                    None, None, f"values are nested more than {MAX_DEPTH} levels deep, which no"
                    " setting is: check the brackets", self.get_mark()
                )  # fmt: skip
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        # An alias gives back its anchor's node, already checked and counted.
        if isinstance(node, (MappingNode, SequenceNode)) and id(node) not in self._sizes:
            if node.end_mark is None:  # an alias of a collection that is still being composed
                raise Refused(
                    None, None, "found an alias inside its own anchor (the anchor is here): a"
                    " value cannot contain itself; write it out", node.start_mark
                )  # fmt: skip
            if isinstance(node, MappingNode):
                _check_keys(node)
            self._count(node)
        return node

    def _count(self, node: MappingNode | SequenceNode) -> None:
        """Count the values `node` expands to (an alias's once per use), memoised per node."""
        children = (
            [c for pair in node.value for c in pair]
            if isinstance(node, MappingNode)
            else list(node.value)
        )
        size = 1 + sum(self._sizes.get(id(c), 1) for c in children)
        if size > MAX_VALUES + self._written:
            raise Refused(
                None, None, f"this value expands to more than {MAX_VALUES:,} values through"
                " its aliases (*name): write it out, or use fewer aliases", node.start_mark
            )  # fmt: skip
        self._sizes[id(node)] = size

    def construct_object(self, node: Node, deep: bool = False) -> Any:
        # PyYAML builds a scalar with int(), float() or datetime, which raise ValueError, not
        # a YAML error, for what they refuse (a number past Python's 4,300 digits,
        # `2001-13-45`, an offset of 99 hours), and a tagged one (`!!bool maybe`, `!!int ""`,
        # `!!timestamp x`) with a KeyError, IndexError or AttributeError. Every caller
        # catches YAML errors: each of these is one, with the value's line.
        try:
            return super().construct_object(node, deep)
        except (ValueError, LookupError, AttributeError, TypeError, OverflowError) as exc:
            kind = node.tag.rsplit(":", 1)[-1]
            # Not int()'s advice to raise Python's limit, nor a bare KeyError's repr.
            why = f" ({str(exc).split(';')[0]})" if isinstance(exc, ValueError) else ""
            raise Refused(
                None, None, f"cannot read {_excerpt(node)} as !!{kind}{why}: write it as a"
                " quoted string or fix the value", node.start_mark
            ) from None  # fmt: skip

    def construct_yaml_float(self, node: ScalarNode) -> float:
        value = super().construct_yaml_float(node)
        if not math.isfinite(value):
            raise Refused(
                None, None, f"found {node.value}, not a finite number: write a number",
                node.start_mark
            )  # fmt: skip
        return value


_Loader.add_constructor("tag:yaml.org,2002:float", _Loader.construct_yaml_float)


def _excerpt(node: Node) -> str:
    """A scalar's text as an error quotes it: long ones (digits by the thousand) cut."""
    text = str(node.value) if isinstance(node, ScalarNode) else "this value"
    return repr(text) if len(text) <= 40 else repr(text[:40]) + "..."


def _check_keys(node: MappingNode) -> None:
    """Refuse a key given twice in one mapping (a merge key's keys may be given again)."""
    seen: dict[tuple[str, str], Node] = {}
    for key, _ in node.value:
        if not isinstance(key, ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
            continue
        first = seen.setdefault((key.tag, key.value), key)
        if first is not key:
            raise Refused(
                None, None, f"found key {key.value!r} again (first on line"
                f" {first.start_mark.line + 1}): keep one of them", key.start_mark
            )  # fmt: skip


def parse_yaml(text: str) -> Any:
    """`yaml.safe_load` with the limits of `_Loader`; raises yaml.YAMLError."""
    loader = _Loader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()
