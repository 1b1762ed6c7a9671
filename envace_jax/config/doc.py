"""docs/configuration.md from ``defaults.py``: every config key, its default, the paper's value and what it means.

    python -m envace_jax.config.doc            # writes docs/configuration.md
    python -m envace_jax.config.doc --check    # exit status 1 when docs/configuration.md differs (tests/test_docs.py)

The meaning of a key is the comment written beside it in ``defaults.py`` (its line's own comment, or the comment
block just above it); its paper value is that comment's "paper: X" ("full size: X", "official: X" where the value is
ours or the official code's), and the ``+paper`` preset's value (``presets.PAPER``) where it sets the key. Keys set
inside a dict literal take their own line's comment, else their parent's. The defaults are ``get_config()``'s.
"""

from __future__ import annotations

import ast
import io
import os
import pathlib
import re
import sys
import tokenize
from collections.abc import Sequence

from envace_jax.config import defaults, presets

SOURCE = pathlib.Path(defaults.__file__)
PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
_PAPER = re.compile(r"\b(paper(?:-scale)?|full size(?: \([^)]*\))?): (.+?)(?:;|\.\s+[A-Z]|\.?$)")


def _comments(text: str) -> dict[int, tuple[str, bool]]:
  """Line number -> (comment text, whether the comment is the line's only content)."""
  out = {}
  for tok in tokenize.generate_tokens(io.StringIO(text).readline):
    if tok.type == tokenize.COMMENT:
      alone = not tok.line[: tok.start[1]].strip()
      out[tok.start[0]] = (tok.string.lstrip("#").strip(), alone)
  return out


def _key(target: ast.expr) -> str | None:
  """``c.a.b`` -> "a.b"; ``c.a[f"{x}_y"]`` -> a regex "a\\.\\w+_y"; None for anything else."""
  parts: list[str] = []
  node = target
  while True:
    if isinstance(node, ast.Attribute):
      parts.append(re.escape(node.attr))
      node = node.value
    elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.JoinedStr):
      fmt = "".join(re.escape(v.value) if isinstance(v, ast.Constant) else r"\w+" for v in node.slice.values)
      parts.append(fmt)
      node = node.value
    else:
      break
  if not (isinstance(node, ast.Name) and node.id == "c") or not parts:
    return None
  return r"\.".join(reversed(parts))


def _assignments(text: str) -> list[tuple[str, str, int, int]]:
  """(key regex, comment, first line, last line) for every assignment to the config in ``get_config``, in source
  order, with the keys of dict literals as ``key.subkey``."""
  comments = _comments(text)
  lines = text.splitlines()
  func = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == "get_config")
  out: list[tuple[str, str, int, int]] = []
  for node in ast.walk(func):
    if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
      continue
    key = _key(node.targets[0])
    if key is None:
      continue
    own = comments.get(node.lineno, ("", True))
    above, line = [], node.lineno - 1
    while line in comments and comments[line][1] and not comments[line][0].startswith("---"):
      above.insert(0, comments[line][0])
      line -= 1
    if not above and lines[node.lineno - 2].strip().startswith("for "):  # the comment above the loop it is in
      line = node.lineno - 2
      while line - 1 in comments and comments[line - 1][1]:
        above.insert(0, comments[line - 1][0])
        line -= 1
    note = " ".join([*above, *([own[0]] if not own[1] else [])])
    out.append((key, note, node.lineno, node.end_lineno or node.lineno))
    value = node.value
    if isinstance(value, ast.Call) and value.args and isinstance(value.args[0], ast.Dict):
      for k in value.args[0].keys:
        if isinstance(k, ast.Constant) and k.lineno in comments and not comments[k.lineno][1]:
          out.append((key + r"\." + re.escape(k.value), comments[k.lineno][0], k.lineno, k.lineno))
  return sorted(out, key=lambda a: a[2])


def _flat(config, prefix: str = "") -> dict[str, object]:
  out = {}
  for name, value in config.items():
    key = f"{prefix}{name}"
    if hasattr(value, "items"):
      out.update(_flat(value, key + "."))
    else:
      out[key] = value
  return out


def rows() -> list[tuple[str, object, str, str, str]]:
  """(key, default, paper value from the comment, the +paper preset's value, meaning) per key of get_config(), in
  the order ``defaults.py`` sets them. A key without a comment that directly follows one with a comment shares it, and
  a key whose comment is the key before's (the keys of one dict literal) says so instead of repeating it."""
  found = _assignments(SOURCE.read_text(encoding="utf-8"))
  placed = []
  for key, default in _flat(defaults.get_config()).items():
    matches = [a for a in found if re.fullmatch(a[0], key)]
    if not matches:  # a key inside a dict literal without its own comment: its parent's
      matches = [a for a in found if re.match(a[0] + r"\.", key)]
    if not matches:
      raise ValueError(f"{key}: no assignment found in {SOURCE}")
    placed.append((matches[-1][2], key, default, matches[-1]))
  out, previous = [], None
  for _, key, default, (_, note, first, last) in sorted(placed, key=lambda p: (p[0], p[1])):
    shown = note
    if previous and (note == previous[1] or (not note and first <= previous[2] + 1)):
      note, shown = previous[1], f"As `{previous[0]}`."
      previous = (previous[0], note, last)
    elif note:
      previous = (key, note, last)
    paper = "; ".join(m[2] if m[1].startswith("paper") else f"{m[1]}: {m[2]}" for m in _PAPER.finditer(note))
    preset = repr(presets.PAPER[key]) if key in presets.PAPER else ""
    out.append((key, default, paper, preset, shown))
  return out


def _cell(value: object) -> str:
  text = value if isinstance(value, str) else repr(value)
  text = text.replace(os.path.expanduser("~"), "~")  # env.data_dir: the same page on every machine
  return text.replace("|", "\\|").replace("\n", " ").replace("<", "&lt;")


def page() -> str:
  """docs/configuration.md's content."""
  head = [
    "# Configuration",
    "",
    "<!-- Generated by `python -m envace_jax.config.doc` from envace_jax/config/defaults.py; do not edit. -->",
    "",
    "Every key of `envace_jax/config/defaults.py:get_config`, which `configs/*.py` start from and override. Set one",
    "on the command line with `--config.KEY=VALUE` (e.g. `--config.train.steps=10`); a preset adds a set of values:",
    "`--config=configs/tau2.py:airline+official` (the official implementation's semantics, see",
    "[departures.md](departures.md)) or `+paper` (those and the paper's sizes; `envace_jax/config/presets.py`).",
    "Every value is checked at start-up (`envace_jax/config_check.py`): a bad one names the key and the valid values.",
    "",
    "Columns: the default; the paper's value as the comment in `defaults.py` gives it (`full size:` where the value",
    "is ours, for a paper-size run); the `+paper` preset's value where it sets the key (the paper's sizes and the",
    "official code's semantics); the meaning, the comment beside the key. Where the two paper columns differ, the",
    "preset is what runs.",
  ]
  sections: dict[str, list[str]] = {}
  for key, default, paper, preset, note in rows():
    section = key.split(".")[0] if "." in key else "top level"
    preset = preset and f"`{_cell(preset)}`"
    line = f"| `{key}` | `{_cell(repr(default))}` | {_cell(paper)} | {preset} | {_cell(note)} |"
    sections.setdefault(section, []).append(line)
  body = []
  for section, lines in sections.items():
    body += ["", f"## {section}", "", "| key | default | paper | `+paper` | meaning |", "|---|---|---|---|---|", *lines]
  return "\n".join(head + body) + "\n"


def main(argv: Sequence[str]) -> int:
  text = page()
  if "--check" in argv:
    if not PAGE.exists() or PAGE.read_text(encoding="utf-8") != text:
      print(f"{PAGE} differs from envace_jax/config/defaults.py: run python -m envace_jax.config.doc", file=sys.stderr)
      return 1
    return 0
  PAGE.write_text(text, encoding="utf-8")
  print(f"wrote {PAGE}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
