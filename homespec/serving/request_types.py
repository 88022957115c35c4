"""Field types for request bodies: a value must have the JSON type its field has.

pydantic's lax mode reads `"8"` and `true` as the integer 8 and 1, `"yes"`, `"on"` and `1` as
true, and `"0.5"` as a number. A client that sends those has made a mistake, and answering would
generate something it did not ask for (`max_tokens: true` is one token), so these types refuse them
with a 400 naming the field, as OpenAI, Ollama (`option "top_k" must be of type integer`) and
llama-server (nlohmann's `type must be number`) do. What JSON clients really send for a number
still passes: an integer where a float is wanted, and an integral float (`8.0`, as Python's
`json.dumps` writes a float and Go's float64 comes back) where an integer is.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Strict
from pydantic_core import PydanticCustomError


def _not_text_or_flag(v: Any) -> Any:
    """A before-validator for an integer field: refuses a string or a boolean, which lax int
    would read as a number."""
    got = "a boolean" if isinstance(v, bool) else "a string" if isinstance(v, str) else None
    if got:
        raise PydanticCustomError("int_type", "Input should be a valid integer, got {got}", {"got": got})
    return v


# A JSON true or false; strict mode takes nothing else (not 0/1, not "yes").
Flag = Annotated[bool, Strict()]
# A JSON number without a fraction; lax int, after the check, refuses 8.5 and takes 8.0.
Integer = Annotated[int, BeforeValidator(_not_text_or_flag)]
# A JSON number, integer or not; strict float takes an int and refuses a bool or a string.
Number = Annotated[float, Strict()]
