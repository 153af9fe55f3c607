"""Forty JSON schemas of varied shape, for structured-output tests: nested objects, arrays with
bounds, enums, string patterns and formats, numbers with limits, optional fields, anyOf. Every
string is bounded (maxLength, pattern, enum or format) so that a random-weight model's output ends."""


def obj(props: dict, required: list | None = None, **kw) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False, **kw}


S = {"type": "string", "maxLength": 6}
I = {"type": "integer", "minimum": 0, "maximum": 100}
B = {"type": "boolean"}
E = {"enum": ["red", "green", "blue"]}

SCHEMAS = [
    obj({"a": I}),
    obj({"a": S, "b": I, "c": B}),
    obj({"name": S, "age": {"type": "integer", "minimum": 18, "maximum": 65}}),
    obj({"color": E, "shade": {"enum": [1, 2, 3]}}),
    obj({"flag": B, "note": {"type": "null"}}),
    obj({"x": {"type": "integer", "minimum": -50, "maximum": -10}}),
    obj({"id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}}),
    obj({"code": {"type": "string", "pattern": "^(ab|cd){1,3}$"}}),
    obj({"day": {"type": "string", "format": "date"}}),
    obj({"uid": {"type": "string", "format": "uuid"}}),
    obj({"ip": {"type": "string", "format": "ipv4"}}),
    obj({"tags": {"type": "array", "items": S, "maxItems": 3}}),
    obj({"nums": {"type": "array", "items": I, "minItems": 2, "maxItems": 4}}),
    obj({"pair": {"type": "array", "prefixItems": [I, B], "items": False}}),
    obj({"matrix": {"type": "array", "items": {"type": "array", "items": {"enum": [0, 1]}, "minItems": 2,
                                               "maxItems": 2}, "minItems": 2, "maxItems": 2}}),
    obj({"inner": obj({"a": I, "b": S})}),
    obj({"l1": obj({"l2": obj({"l3": obj({"v": B})})})}),
    obj({"people": {"type": "array", "items": obj({"n": S, "k": I}), "maxItems": 2}}),
    obj({"a": I, "b": S}, required=["a"]),
    obj({"a": I, "b": I, "c": I}, required=[]),
    obj({"opt": E, "must": B}, required=["must"]),
    obj({"v": {"anyOf": [I, S]}}),
    obj({"v": {"anyOf": [B, {"type": "null"}, E]}}),
    obj({"v": {"anyOf": [obj({"kind": {"const": "circle"}, "r": I}), obj({"kind": {"const": "square"}, "s": I})]}}),
    obj({"const": {"const": "fixed-value"}}),
    obj({"ratio": {"type": "number", "minimum": 0, "maximum": 1}}),
    obj({"temp": {"type": "number", "minimum": -10, "maximum": 40}}),
    obj({"big": {"type": "integer", "minimum": 1000, "maximum": 1000000}}),
    obj({"even": {"type": "integer", "enum": [2, 4, 6, 8]}}),
    obj({"short": {"type": "string", "minLength": 2, "maxLength": 3}}),
    obj({"empty": obj({})}),
    obj({"list_of_enum": {"type": "array", "items": E, "minItems": 1, "maxItems": 3, "uniqueItems": False}}),
    obj({"a": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}}),
    obj({"word": {"type": "string", "pattern": "^[a-z]{1,5}$"}, "n": I}),
    obj({"meta": obj({"version": {"type": "string", "pattern": "^[0-9]\\.[0-9]$"}, "beta": B})}),
    {"type": "array", "items": I, "minItems": 1, "maxItems": 5},
    {"type": "array", "items": obj({"k": E}), "minItems": 1, "maxItems": 2},
    {"enum": ["yes", "no", "maybe"]},
    {"type": "integer", "minimum": 0, "maximum": 9},
    {"anyOf": [obj({"ok": B}), obj({"error": S})]},
]
assert len(SCHEMAS) == 40
