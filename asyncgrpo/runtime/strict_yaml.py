"""YAML as the user wrote it: `load_yaml` is `yaml.safe_load` that refuses a key given twice in
one mapping (safe_load keeps the last, so a spec naming `grid` twice would run only the second).
Merge keys (`<<: *base`) still merge, and an explicit key may override a merged one."""

from __future__ import annotations

from typing import Any

import yaml

_MERGE_TAG = "tag:yaml.org,2002:merge"


class _UniqueKeyLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
            except TypeError:
                raise yaml.constructor.ConstructorError(None, None, f"found unhashable key {key!r}",
                                                        key_node.start_mark) from None
            if duplicate:
                raise yaml.constructor.ConstructorError(None, None, f"found duplicate key {key!r}",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str | bytes) -> Any:
    """`text` parsed as safe_load does; raises yaml.YAMLError (with the position) for a key given
    twice in one mapping or an unhashable key, as for any other YAML error."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
