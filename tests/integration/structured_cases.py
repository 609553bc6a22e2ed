"""The constraints the structured-output tests sample: 20 JSON schemas of increasing difficulty,
and regex, choice and EBNF cases with a check of their outputs. Strings carry ``maxLength`` and
arrays ``maxItems`` so that a completion sampled at temperature 1 ends within the tests' budget."""

from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 16}
SCHEMAS: list[dict] = [
    # 1-4: flat objects of one type each
    {"type": "object", "properties": {"name": NAME}, "required": ["name"]},
    {"type": "object", "properties": {"count": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["count"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": "null"}}, "required": ["ok", "note"]},
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 18, "maximum": 120}}, "required": ["name", "age"]},
    # 5-7: enums, const, numbers with ranges
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"version": {"const": 2}, "level": {"enum": [1, 2, 3]}}, "required": ["version", "level"]},
    {"type": "object", "properties": {"score": {"type": "integer", "minimum": -50, "maximum": 50},
                                      "ratio": {"type": "number", "minimum": 0, "maximum": 1}}, "required": ["score", "ratio"]},
    # 8-10: arrays with bounds
    {"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"matrix": {"type": "array", "minItems": 1, "maxItems": 2,
                                                 "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                                           "minItems": 2, "maxItems": 2}}}, "required": ["matrix"]},
    # 11-13: nested objects
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"name": NAME, "admin": {"type": "boolean"}},
                                               "required": ["name", "admin"]}}, "required": ["user"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"sku": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["sku", "qty"]}}},
     "required": ["items"]},
    # 14-15: string patterns and formats
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}, "required": ["date"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                                      "phone": {"type": "string", "pattern": "^\\+[0-9]{2} [0-9]{6}$"}}, "required": ["code", "phone"]},
    # 16-17: anyOf
    {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999}, NAME]}}, "required": ["id"]},
    {"type": "object", "properties": {"shape": {"anyOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["kind", "r"]},
        {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["kind", "side"]},
    ]}}, "required": ["shape"]},
    # 18-19: $ref and $defs
    {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                                          "y": {"type": "integer", "minimum": -9, "maximum": 9}}, "required": ["x", "y"]}},
     "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}, "required": ["start", "end"]},
    {"$defs": {"person": {"type": "object", "properties": {"name": NAME, "role": {"enum": ["dev", "ops", "pm"]}}, "required": ["name", "role"]}},
     "type": "object", "properties": {"lead": {"$ref": "#/$defs/person"},
                                      "team": {"type": "array", "items": {"$ref": "#/$defs/person"}, "minItems": 1, "maxItems": 2}},
     "required": ["lead", "team"]},
    # 20: all of it together
    {"$defs": {"address": {"type": "object", "properties": {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                           "required": ["city", "zip"]}},
     "type": "object",
     "properties": {
         "order_id": {"type": "integer", "minimum": 1000, "maximum": 9999},
         "status": {"enum": ["new", "paid", "shipped"]},
         "ship_to": {"$ref": "#/$defs/address"},
         "lines": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "object", "properties": {
             "sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}, "qty": {"type": "integer", "minimum": 1, "maximum": 5},
             "price": {"type": "number", "minimum": 0, "maximum": 100}}, "required": ["sku", "qty", "price"]}},
         "gift": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
     },
     "required": ["order_id", "status", "ship_to", "lines", "gift"]},
]

REGEXES = [r"[0-9]{4}-[0-9]{2}-[0-9]{2}", r"(yes|no), because [a-z ]{3,20}\.", r"[A-Z][a-z]{2,8} [A-Z][a-z]{2,8}"]
CHOICES = [["positive", "negative", "neutral"], ["Paris", "London", "Berlin", "Madrid"]]
# Arithmetic over small integers; its outputs are checked by evaluating them.
ARITHMETIC_GRAMMAR = """root ::= expr
expr ::= term (" " [+-] " " term){0,3}
term ::= number | "(" expr ")"
number ::= [1-9] [0-9]?
"""
