"""A manifest entry's parts checked against its key: the recorded constants and compiler attributes
must be what Triton's in-memory key holds, kind for kind (``kwarm_ext.manifest`` parses the entry;
this module is its key checks, apart to keep that module readable). Imports neither Triton nor torch
at module level."""
from __future__ import annotations

import json
import re

from kwarm_ext.escape import printable

MAX_CONSTANT = 1000  # characters of one recorded constexpr as JSON (vLLM's: numbers, dtypes, short tuples)


def _kind(value) -> type:
    """bool, int (an IntEnum member too), or the value's own type: 1, True and 1.0 differ in a key."""
    return bool if type(value) is bool else int if isinstance(value, int) else type(value)


def _check_constants_match_key(specialization, spec: dict) -> None:
    """Every recorded constant must be the value the key holds for that argument: replay
    compiles the constants and files the binary under the key, so parts that disagree would
    put one specialization's binary under another's key."""
    if specialization is None:
        raise ValueError("the key's specialization cannot be read, so its constants cannot be checked")
    for path, encoded in zip(spec["constant_keys"], spec["constant_vals"]):
        if len(json.dumps(encoded)) > MAX_CONSTANT:
            raise ValueError(f"constant {path} is larger than {MAX_CONSTANT} characters of JSON")
        if len(path) != 1 or path[0] >= len(specialization):
            raise ValueError(f"constant {path} is not an argument of the key")
        held = specialization[path[0]]
        if not (isinstance(held, tuple) and len(held) == 2 and held[0] == "constexpr"):
            raise ValueError(f"argument {path[0]} is not a constexpr in the key")
        if not _same_constant(encoded, held[1]):
            raise ValueError(f"constant {path[0]} is {printable(repr(encoded))} but the key says "
                             f"{printable(repr(held[1]))}")


def _check_attrs_match_key(specialization, spec: dict) -> None:
    """The recorded compiler attributes must be those the key implies (``tt.divisibility`` only
    where the key says ``D``): replay compiles with them and files the binary under the key, and
    an attribute the key does not justify (16-byte alignment) would be assumed by every launch
    that finds that key."""
    from kwarm_ext.surfaces.triton.compat import attrs_from_key

    implied = {path: attrs for path, attrs in attrs_from_key(specialization).items() if attrs}
    recorded = {}
    for path, attrs in zip(spec["attrs_keys"], spec["attrs_vals"]):
        if attrs:
            recorded[tuple(path)] = attrs
    for path in sorted(set(implied) | set(recorded)):
        if json.dumps(recorded.get(path)) != json.dumps(implied.get(path)):
            raise ValueError(f"attributes of argument {list(path)} are {printable(json.dumps(recorded.get(path)))} "
                             f"but the key implies {printable(json.dumps(implied.get(path)))}")


def _same_constant(encoded, in_key) -> bool:
    """Whether a recorded (JSON) constant is the key's value, kind for kind: scalars exactly
    (``-0.0`` is not ``0.0``: Triton compiles them apart), Triton and torch dtypes by name, tuples
    element by element; a jitted function, which the key prints as its cache key (a hash), only
    where the key holds one (its source is checked against the key when it is resolved). Any
    other tag is refused."""
    if encoded is None or isinstance(encoded, (bool, int, float, str)):
        if type(encoded) is float and type(in_key) is float:
            return repr(encoded) == repr(in_key)
        return encoded == in_key and _kind(encoded) is _kind(in_key)
    if not (isinstance(encoded, dict) and len(encoded) == 1):
        return False
    (tag, inner), = encoded.items()
    if tag == "tl_dtype":
        return str(in_key) == inner
    if tag == "constexpr":
        return _same_constant(inner, in_key)
    if tag == "str":
        return type(in_key) is str and in_key == inner
    if tag == "torch_dtype":
        return type(inner) is str and str(in_key) in (f"torch.{inner}", inner)
    if tag == "tuple":
        return (isinstance(inner, list) and isinstance(in_key, (tuple, list)) and len(inner) == len(in_key)
                and all(_same_constant(e, k) for e, k in zip(inner, in_key)))
    if tag == "jit_function":
        return type(inner) is str and type(in_key) is str and bool(re.fullmatch(r"[0-9a-f]{64}", in_key))
    return False
