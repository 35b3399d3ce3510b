"""JSON-schema rewriting before compilation: closing objects to the properties they name.

JSON Schema lets an object carry keys its `properties` do not name unless `additionalProperties` says otherwise, and
a grammar built from that lets a model invent keys (`"unit_scale"` beside `"unit"`) and spend its tokens on them.
vLLM's xgrammar backend closes such objects by default (its guidance backend does with
`disable_additional_properties`); so does pagellm, with the same opt-out."""
from __future__ import annotations

import copy
from typing import Any

# Keywords whose value is one subschema, a list of them, or a name -> subschema map (draft 2020-12 and older).
_SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
              "unevaluatedItems", "additionalProperties", "unevaluatedProperties")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# An object that says any of these decides its extra keys itself (or shares them with sibling schemas).
_OPEN_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf", "anyOf", "oneOf",
                  "$ref")


def close_objects(schema: Any) -> Any:
    """A copy of `schema` in which every object schema that names `properties` and says nothing about other keys
    gets `"additionalProperties": false`. Left open: objects that name no properties (`{"type": "object"}` is any
    object), that decide extra keys themselves (`additionalProperties`, `patternProperties`,
    `unevaluatedProperties`), that combine with others (`allOf` / `anyOf` / `oneOf` / `$ref` beside their
    properties), and the members of an `allOf` (each names only part of the keys)."""
    schema = copy.deepcopy(schema)
    _close(schema, in_all_of=False)
    return schema


def _close(node: Any, in_all_of: bool) -> None:
    if not isinstance(node, dict):
        return
    if "properties" in node and not in_all_of and not any(key in node for key in _OPEN_KEYWORDS):
        node["additionalProperties"] = False
    for key in _SUBSCHEMA:
        if isinstance(node.get(key), dict):
            _close(node[key], in_all_of=False)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(node.get(key), list):
            for member in node[key]:
                _close(member, in_all_of=key == "allOf")
    for key in _SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for member in node[key].values():
                _close(member, in_all_of=False)
