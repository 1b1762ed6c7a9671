"""The benchmarks a run can name (``env.benchmark``): what each one has, and its adapter's entry points.

Everything outside the adapters (``envs/<name>.py``) that differs between benchmarks is read from here. A benchmark's
adapter is imported on first use (τ² and BFCL pull in their harnesses).

    bench = registry.get(config.env.benchmark)
    env = bench.make_env(task, rule_checklist=rewards.rule_checklist)
"""

from __future__ import annotations

import dataclasses
import importlib
import types
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from envace_jax.envs.base import ChatMessage, EnvError, Task, ToolEnv

DataKind = Literal["packaged", "path", "download"]


@dataclasses.dataclass(frozen=True)
class Benchmark:
  """One benchmark.

  Attributes:
    name: the ``env.benchmark`` value; also ``Task.benchmark``.
    title: its name in prose ("τ²-bench").
    domain_word: what ``env.domain`` names, for messages ("τ² domain").
    data: where the tasks come from. "packaged": the installed harness, the dataset config is ``env.domain``;
      "path": the checklist-format data at ``env.data_path``, which is the config; "download": the user's download at
      ``env.data_path``, the config is "DOMAIN:PATH".
    logged_user_turns: the user's turns are replayed from the data, so there are no USER rows to train.
    tools_unreachable: why ``rollout.env_mode='real'`` cannot run (its tools are not reachable offline); "" when it can.
    demonstrations: reference conversations with executable gold calls, for ``train.sft_warmup_steps``.
    judged: scored by an LLM judge over rubrics (no gold actions for the rule checklist).
    requires: (importable module, how to install it) pairs the adapter needs beyond the project's extras.
    packaged_splits: for "packaged" data, each domain's splits (the prepared datasets' configs).
  """

  name: str
  title: str
  domain_word: str
  data: DataKind
  logged_user_turns: bool
  tools_unreachable: str
  demonstrations: bool
  judged: bool
  requires: tuple[tuple[str, str], ...] = ()
  packaged_splits: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
  _make_env: Callable[..., ToolEnv] | None = dataclasses.field(default=None, repr=False)
  _initial: Callable[[Callable[[], types.ModuleType], Task], Sequence[ChatMessage]] | None = dataclasses.field(
    default=None, repr=False
  )
  _reference: Callable[[types.ModuleType, Task, ToolEnv], list[ChatMessage]] | None = dataclasses.field(
    default=None, repr=False
  )
  _data_files: Callable[[types.ModuleType, Path, str], list[Path]] | None = dataclasses.field(default=None, repr=False)

  def adapter(self) -> types.ModuleType:
    """The adapter module (``envace_jax.envs.<name>``), imported now if it was not yet."""
    return importlib.import_module(f"envace_jax.envs.{self.name}")

  def domains(self) -> tuple[str, ...]:
    """The valid ``env.domain`` values; () when the data path is the whole config ("checklist")."""
    if self.data == "packaged":
      return tuple(self.packaged_splits)
    return tuple(getattr(self.adapter(), "DOMAINS", ()))

  def splits(self, domain: str) -> tuple[str, ...] | None:
    """The splits of a domain's prepared dataset; None when the data defines them ("checklist").

    Raises:
      EnvError: ``domain`` is not one of ``domains()``.
    """
    if self.data == "path":
      return None
    if self.data == "download":
      return ("test",)
    if domain in self.packaged_splits:
      return self.packaged_splits[domain]
    raise EnvError(f"{domain!r} is not a {self.domain_word}; choose one of {list(self.domains())}")

  def source_config(self, domain: str, data_path: str) -> str:
    """The prepared-dataset config of a run (``datasets.builder``'s ``config``)."""
    return {"packaged": domain, "path": data_path, "download": f"{domain}:{data_path}"}[self.data]

  def data_files(self, path: Path, domain: str) -> list[Path]:
    """The files of a download that a domain's tasks are read from (their hash names the prepared config).

    Raises:
      EnvError: nothing to read at ``path``.
    """
    if self._data_files is not None:
      return self._data_files(self.adapter(), path, domain)
    if path.is_dir():
      return sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".json", ".jsonl"))
    if path.is_file():
      return [path]
    raise EnvError(f"{self.name} data {str(path)!r} does not exist")

  def make_env(self, task: Task, *, rule_checklist: Any = None, judge: Any = None) -> ToolEnv:
    """A real environment for ``task`` (not yet reset).

    Args:
      task: a task of this benchmark.
      rule_checklist: the rule scorer (``rl.rewards.rule_checklist``) for benchmarks scored by their checklists.
      judge: the LLM judge for ``judged`` benchmarks; None makes its ``evaluate`` return an invalid reward.

    Raises:
      EnvError: the benchmark has no real environment.
    """
    if self._make_env is None:
      raise EnvError(f"benchmark {self.name!r} has no real environment to evaluate against")
    return self._make_env(self.adapter(), task, rule_checklist=rule_checklist, judge=judge)

  def initial_conversation(self, task: Task) -> tuple[ChatMessage, ...]:
    """The logged conversation ``task`` starts from (τ² mock tasks have one); () for most tasks."""
    return tuple(self._initial(self.adapter, task)) if self._initial is not None else ()

  def reference_conversation(self, task: Task, env: ToolEnv) -> list[ChatMessage]:
    """``task``'s reference conversation with every gold call executed on ``env`` (reset here).

    Raises:
      EnvError: the benchmark has no demonstrations, or gold actions the oracle cannot play.
    """
    if self._reference is None:
      with_them = ", ".join(b.name for b in BENCHMARKS.values() if b.demonstrations)
      raise EnvError(
        f"task {task.id!r} of benchmark {self.name!r} has no reference conversation to demonstrate; the supervised "
        f"warm-up supports {with_them} (set train.sft_warmup_steps=0)"
      )
    return self._reference(self.adapter(), task, env)


def _tau2_initial(adapter: Callable[[], types.ModuleType], task: Task) -> Sequence[ChatMessage]:
  """A τ² task's logged opening; the adapter (τ² and litellm) is imported only for a task that has one."""
  return adapter().initial_conversation(task) if task.criteria.get("tau2_task") is not None else ()


BENCHMARKS: dict[str, Benchmark] = {
  b.name: b
  for b in (
    Benchmark(
      "tau2", "τ²-bench", "τ² domain", "packaged", logged_user_turns=False, tools_unreachable="", demonstrations=True,
      judged=False,
      # Each domain's split_tasks.json without "base" where it has train + test, and without TFDS's reserved "all";
      # telecom is left out (its user-side tools are not supported).
      packaged_splits={"mock": ("base",), "airline": ("train", "test"), "retail": ("train", "test")},
      _make_env=lambda m, task, **_: m.Tau2Env(task.domain),
      _initial=_tau2_initial,
      _reference=lambda m, task, env: m.oracle_conversation(env, task),
    ),
    Benchmark(
      "bfcl", "BFCL-v4", "BFCL category", "packaged", logged_user_turns=True, tools_unreachable="", demonstrations=True,
      judged=False,
      packaged_splits={
        c: ("test",)
        for c in ("multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context")
      },
      _make_env=lambda m, task, **_: m.BfclEnv(),
      _reference=lambda m, task, env: m.oracle_conversation(task, env),
    ),
    Benchmark(
      "testbed", "the testbed", "testbed level", "packaged", logged_user_turns=True, tools_unreachable="",
      demonstrations=True, judged=False,
      # envs/testbed.py's LEVELS and SPLITS (tests/envs/test_testbed.py checks they agree).
      packaged_splits={level: ("train", "iid", "compositional", "rules") for level in ("cpu", "full")},
      _make_env=lambda m, task, **_: m.TestbedEnv(),
      _reference=lambda m, task, env: m.oracle_conversation(task, env),
    ),
    Benchmark(
      "checklist", "the checklist data", "checklist data", "path", logged_user_turns=True, tools_unreachable="",
      demonstrations=False, judged=False,
      _make_env=lambda m, task, rule_checklist, **_: m.ChecklistEnv(scorer=rule_checklist),
    ),
    Benchmark(
      "vitabench", "VitaBench", "vitabench domain", "download", logged_user_turns=False, tools_unreachable="",
      demonstrations=False, judged=True,
      requires=((
        "vita",
        "git clone https://github.com/meituan-longcat/vitabench and pip install -e the clone (vita reads "
        "src/vita/models.yaml at import, see its README)",
      ),),
      _make_env=lambda m, task, judge, **_: m.VitaBenchEnv(scorer=judge),
      _data_files=lambda m, path, domain: [m.find_task_file(path, domain)],  # only the task file, not the whole clone
    ),
    Benchmark(
      "finmcp", "FinMCP-Bench", "finmcp domain", "download", logged_user_turns=True,
      tools_unreachable="FinMCP-Bench's live MCP servers, which are not reachable", demonstrations=False, judged=False,
      _make_env=lambda m, task, **_: m.FinMcpEnv(),
    ),
  )
}  # fmt: skip


def initial_conversation(task: Task) -> tuple[ChatMessage, ...]:
  """``get(task.benchmark).initial_conversation(task)``; () for a task of no registered benchmark (a test's own)."""
  bench = BENCHMARKS.get(task.benchmark)
  return bench.initial_conversation(task) if bench is not None else ()


def get(name: str) -> Benchmark:
  """The benchmark called ``name``.

  Raises:
    EnvError: unknown name (the message lists the known ones).
  """
  if name not in BENCHMARKS:
    raise EnvError(f"unknown benchmark {name!r}; choose one of {list(BENCHMARKS)}")
  return BENCHMARKS[name]
