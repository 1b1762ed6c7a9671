"""Text a tokenizer cannot take, replaced by U+FFFD as the official EnvACE code does.

A tool call's arguments written with the JSON escape ``\\ud800`` decode (``json.loads``) to a lone UTF-16 surrogate,
which no UTF-8 encoder accepts: Hugging Face's Rust ``tokenizers`` raises ``TypeError`` on it, and so would every
view that shows the call. The official code (Within-yao/EnvACE,
``agent_system/environments/env_package/checklist/mcp_tool.py``, ``MCPChecklistTool._sanitize_text_for_tokenizer``)
replaces, not drops, these code points with U+FFFD REPLACEMENT CHARACTER wherever text reaches its tokenizer (tool
arguments, simulator outputs, user text, dataset schemas):

  * U+D800..U+DFFF, lone surrogates (a Python ``str`` holds a surrogate pair as one astral code point, so every
    surrogate in a ``str`` is a lone one);
  * U+0000 (NUL);
  * U+FDD0..U+FDEF and U+xxFFFE / U+xxFFFF on every plane, the Unicode noncharacters.

`sanitize` reproduces it character for character (``tests/data/official/sanitize.json``). Our tokenizer applies it to
every text it encodes or renders (`tokenizer.Tokenizer`), so no model output, tool result, user text or dataset text
can stop a rollout; a view counts what it replaced (`views.View.unencodable`, a trajectory's
``counts["unencodable_chars"]``). The conversation keeps the text as decoded (a call's arguments as the model wrote
them); what goes over HTTP (the external user's and the judge's requests, ``rehearsal/users.py``, ``rl/judge.py``) is
sanitised, as UTF-8 cannot carry a surrogate. The server refuses such text with a 400 naming the field instead
(``serve.py``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

REPLACEMENT = "\ufffd"

_NONCHARACTERS = "".join(chr(plane << 16 | 0xFFFE) + chr(plane << 16 | 0xFFFF) for plane in range(17))
UNENCODABLE = re.compile("[\ud800-\udfff\x00\ufdd0-\ufdef" + _NONCHARACTERS + "]")
"""One code point a tokenizer must not see (the module docstring's list)."""


def sanitize(text: str) -> str:
  """``text`` with every `UNENCODABLE` code point replaced by U+FFFD (same length in code points)."""
  return UNENCODABLE.sub(REPLACEMENT, text)


def count(value: Any) -> int:
  """How many `UNENCODABLE` code points ``value`` holds: a str, or JSON-like data (mapping keys and values, list and
  tuple items, recursively; other values hold none)."""
  if isinstance(value, str):
    return len(UNENCODABLE.findall(value))
  if isinstance(value, Mapping):
    return sum(count(k) + count(v) for k, v in value.items())
  if isinstance(value, list | tuple):
    return sum(count(v) for v in value)
  return 0


def describe(text: str) -> str | None:
  """Where ``text``'s first `UNENCODABLE` code point is, for an error message ("character 3 is U+D800, a lone
  surrogate"); None when there is none."""
  found = UNENCODABLE.search(text)
  if found is None:
    return None
  code = ord(found.group())
  kind = "a lone surrogate" if 0xD800 <= code <= 0xDFFF else "NUL" if code == 0 else "a Unicode noncharacter"
  return f"character {found.start()} is U+{code:04X}, {kind}"
