"""The documentation against the code: docs/configuration.md is what ``python -m envace_jax.config.doc`` writes from
``config/defaults.py``, and every ``python -m envace_jax.main`` / ``envace_jax.serve`` command shown in README.md and
docs/*.md names flags that exist and config keys its config has (the commands are parsed, never run: several need
an accelerator or data this machine lacks)."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import shlex

import pytest
from absl import flags

from envace_jax.config import doc, presets

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"python -m envace_jax\.(main|serve)\b(?:[^`\n\\]|\\\n\s*|\\(?!\n))*")
README_MAX_LINES, README_MAX_COLUMNS = 150, 120


def test_configuration_page_is_generated_from_defaults():
  page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
  assert page == doc.page(), "docs/configuration.md drifted from defaults.py: run python -m envace_jax.config.doc"


def test_configuration_page_has_every_key_with_a_meaning():
  rows = doc.rows()
  keys = [r[0] for r in rows]
  assert len(keys) == len(set(keys)) and {"train.steps", "grpo.clip_ratio_c", "eval.sampling.top_p"} <= set(keys)
  assert [k for k, *_, meaning in rows if not meaning] == []
  got = {r[0]: r for r in rows}
  assert got["train.tasks_per_step"][2] == "16" and got["train.tasks_per_step"][3] == "16"
  assert got["grpo.clip_eps_high"][4] == "As `grpo.clip_eps_low`."


def test_readme_fits():
  lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
  assert len(lines) <= README_MAX_LINES
  assert [i + 1 for i, line in enumerate(lines) if len(line) > README_MAX_COLUMNS] == []


def commands() -> list[tuple[str, str, list[str]]]:
  """(where, module, argument tokens) of every command shown: continuation lines joined, shell comments dropped; the
  module named with no arguments (`python -m envace_jax.main` in prose) is a mention, not a command."""
  out = []
  for path in PAGES:
    text = path.read_text(encoding="utf-8")
    for m in COMMAND.finditer(text):
      line = text[: m.start()].count("\n") + 1
      args = shlex.split(re.sub(r"\\\n\s*", " ", m.group(0)), comments=True)[3:]
      if args:
        out.append((f"{path.relative_to(ROOT)}:{line}", m.group(1), args))
  return out


def _main_flags() -> set[str]:
  import envace_jax.main  # noqa: F401  (defines the flags)

  return set(flags.FLAGS)


def _serve_flags() -> set[str]:
  # serve.py defines its flags inside its entry point; read their names from the source.
  source = (ROOT / "envace_jax" / "serve.py").read_text(encoding="utf-8")
  return set(re.findall(r"DEFINE_\w+\(\s*\"(\w+)\"", source)) | set(_main_flags())


def _config(spec: str):
  path, _, arg = spec.partition(":")
  module_spec = importlib.util.spec_from_file_location("doc_config", ROOT / path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg or None)


def _has(config, key: str) -> bool:
  node = config
  for part in key.split("."):
    if not hasattr(node, "keys") or part not in node:
      return False
    node = node[part]
  return True


def test_commands_are_found():
  found = commands()
  where = {w.split(":")[0] for w, *_ in found}
  assert len(found) >= 10 and "README.md" in where and "docs/hardware.md" in where


@pytest.mark.parametrize("where,module,args", commands(), ids=lambda v: v if isinstance(v, str) else None)
def test_every_shown_command_names_real_flags(where, module, args):
  known = _main_flags() if module == "main" else _serve_flags()
  tokens = [a for a in args if a.startswith("--")]
  spec = next((a.split("=", 1)[1] for a in tokens if a.startswith("--config=")), None)
  if module == "main":  # --mode=eval on a run's workdir reads its config from the checkpoint; flags parse as defaults
    assert spec or "--mode=eval" in tokens, f"{where}: no --config"
  config = _config(spec) if spec else doc.defaults.get_config() if module == "main" else None
  if spec:
    unknown = [p for p in presets.split(spec.partition(":")[2])[1] if p not in presets.PRESETS]
    assert not unknown, f"{where}: unknown presets {unknown}"
  for token in tokens:
    name = token[2:].split("=", 1)[0]
    if name.startswith("config."):
      assert config is not None and _has(config, name[len("config.") :]), f"{where}: {spec} has no {name}"
    else:
      assert name in known or (name.startswith("no") and name[2:] in known), f"{where}: no flag --{name}"


def test_every_config_key_and_file_mentioned_exists():
  """Beyond whole commands: every ``--config.KEY`` and ``--config=configs/FILE.py[:ARG]`` written anywhere in README.md
  and docs/*.md (tables, prose) names a key of the defaults and a config that loads with known presets."""
  keys = set(doc._flat(doc.defaults.get_config()))
  for path in PAGES:
    text = path.read_text(encoding="utf-8")
    for key in re.findall(r"--config\.([a-z_][\w.]*[a-z_\d])", text):
      assert key in keys or any(k.startswith(key + ".") for k in keys), f"{path.name}: --config.{key}"
    for spec in re.findall(r"--config=(configs/\w+\.py(?::[\w+.-]+)?)", text):
      _config(spec)
      unknown = [p for p in presets.split(spec.partition(":")[2])[1] if p not in presets.PRESETS]
      assert not unknown, f"{path.name}: {spec}: unknown presets {unknown}"


def test_readme_install_line_is_the_makefiles():
  """The Makefile fills its environment with README.md's install line (its pip commands, with the EXTRAS variable in
  place of the extras, and --no-compile: the runs write the bytecode of what they import, with PYTHONDONTWRITEBYTECODE
  empty), and `.ci/run` reads README.md's `Test:` block: both must stay where they look."""
  readme = (ROOT / "README.md").read_text(encoding="utf-8")
  make = (ROOT / "Makefile").read_text(encoding="utf-8")
  recipe = re.search(r"\$\(ACTIVATE\) && (pip install --no-compile --no-deps .*)", make).group(1)
  assert recipe.count("pip install --no-compile ") == 2
  assert re.findall(r"\$\(ACTIVATE\) && PYTHONDONTWRITEBYTECODE= python -m (\S+)", make) == [
    "envace_jax.main",
    "pytest",
  ]
  line = recipe.replace("$(ALL_EXTRAS)", "dev,tau2,bfcl").replace("pip install --no-compile ", "pip install ")
  assert "ALL_EXTRAS := dev,tau2,bfcl$(" in make and f"\n{line}\n" in readme
  assert re.search(r"\nTest:\n```bash\nmake test\n", readme)


# Links to files another change is to add (docs/testbed.md names the report experiments/testbed_calibration.py is to
# write; neither is in the tree yet).
PENDING_LINKS: set[str] = set()  # "page: link" of a file a running experiment will write


def test_relative_links_resolve():
  """Every relative link in README.md, docs/*.md and the dated reports names a file that exists."""
  pages = [*PAGES, *sorted((ROOT / "experiments" / "results").glob("*.md"))]
  broken = []
  for path in pages:
    text = path.read_text(encoding="utf-8")
    targets = re.findall(r"\]\(\s*([^)\s]+)\)", text) + re.findall(r"^\[[^\]]+\]: (\S+)$", text, re.M)
    for target in targets:
      if re.match(r"[a-z]+:", target) or target.startswith("#"):
        continue
      if not (path.parent / target.split("#")[0]).exists():
        broken.append(f"{path.relative_to(ROOT)}: {target}")
  assert [b for b in broken if b not in PENDING_LINKS] == []


def test_license_citation_and_changelog():
  """LICENSE is the Apache License 2.0 (as the official implementation) under the project's copyright, the package
  metadata says so, CITATION.cff cites the software and prefers the paper, CHANGELOG.md keeps an Unreleased section;
  README.md links all three."""
  import yaml

  license_text = (ROOT / "LICENSE").read_text(encoding="utf-8")
  assert license_text.startswith("Copyright 2026 The envace-jax authors\n")
  assert "Apache License\n                           Version 2.0, January 2004" in license_text
  assert 'license="Apache-2.0"' in (ROOT / "setup.py").read_text(encoding="utf-8")
  cff = yaml.safe_load((ROOT / "CITATION.cff").read_text(encoding="utf-8"))
  assert (cff["cff-version"], cff["type"], cff["license"]) == ("1.2.0", "software", "Apache-2.0")
  assert cff["authors"] == [{"name": "The envace-jax authors"}]
  paper = cff["preferred-citation"]
  assert (paper["title"], paper["url"]) == ("World Rehearsal", "https://arxiv.org/abs/2608.06197")
  assert "\n## [Unreleased]\n" in (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
  readme = (ROOT / "README.md").read_text(encoding="utf-8")
  assert all(f"]({name})" in readme for name in ("LICENSE", "CITATION.cff", "CHANGELOG.md"))
