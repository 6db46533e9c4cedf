"""Fuzzing the token estimate (``capacity_contract/tokens.py``, R-T1, R-K7).

``text_tokens`` counts with byte passes what its docstring's regular expressions define:
the two agree on any text. It never counts more than a token a byte (the most a
tokenizer with byte fallback spends). ``request_charge`` takes any JSON object a body may
decode to and returns a charge, never raises.
"""

from __future__ import annotations

import re
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from json_strategies import json_values as json_value_strategy

from capacity_contract.tokens import (
    LETTERS_A_TOKEN,
    REQUEST_OVERHEAD,
    WORD_LETTERS,
    request_charge,
    text_bytes,
    text_tokens,
)

# the definition the byte passes implement: one a match, plus the letters of a long run past
# WORD_LETTERS less what the chunks counted for them, plus every capital after a letter, at
# most the bytes
DEFINITION = re.compile(f"[A-Za-z]{{1,{LETTERS_A_TOKEN}}}|[^A-Za-z ]| (?![A-Za-z])".encode())
LONG = re.compile(f"[A-Za-z]{{{WORD_LETTERS + 1},}}".encode())
INNER_CAPITAL = re.compile(b"(?<=[A-Za-z])[A-Z]")


def defined(raw: bytes) -> int:
    def chunks(n: int) -> int:
        return -(-n // LETTERS_A_TOKEN)

    total = len(DEFINITION.findall(raw)) + len(INNER_CAPITAL.findall(raw))
    for run in LONG.findall(raw):
        total += len(run) - WORD_LETTERS - (chunks(len(run)) - chunks(WORD_LETTERS))
    return min(total, len(raw))  # never more than a token a byte


texts = st.text() | st.text(alphabet="abYZ.\n\t日é🙂7 ", max_size=200)


@given(texts)
def test_r_t1_the_byte_passes_count_what_the_definition_matches(text: str) -> None:
    raw = text.encode("utf-8", "surrogatepass")
    assert text_tokens(text) == defined(raw)


@given(texts)
def test_r_t1_the_estimate_is_never_above_a_token_a_byte(text: str) -> None:
    assert text_tokens(text) <= text_bytes(text)


@given(json_value_strategy(6, 20))
def test_r_t1_any_json_body_is_charged_without_an_error(value: Any) -> None:
    for doc in ({"messages": value}, {"prompt": value}, {"tools": value, "max_tokens": value}):
        charge = request_charge(doc)
        assert charge.prompt >= REQUEST_OVERHEAD
        assert charge.tokens(None) >= charge.prompt
