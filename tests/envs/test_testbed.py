"""envs/testbed.py, the generated tasks over BFCL's MessageAPI and TicketAPI (issue 42, acceptance item 2):

* generation is deterministic: a task depends only on (level, split, index, GENERATOR_VERSION), also in another
  process, and a few pinned tasks (plus a digest of 32) catch a generator change that did not bump the version;
* every gold sequence succeeds on the real classes (BFCL's checker and the communicated answers: reward 1.0), and the
  gold calls that must fail get the class's own error;
* the splits are disjoint by template and entity as the module docstring documents (`split_signature`);
* through the evaluation's committed execution (`heldout.evaluate_policy`, the path of ``--mode=eval``), a scripted
  sampler that emits the gold calls gets reward 1.0 on the real tools, and one that breaks a tool's precondition gets
  the tool's real error and reward 0;
* the wiring: registry entry, TFDS builder (prepared and loaded back exactly), the warm-up's reference conversations
  and demonstrations, configs/testbed.py; unknown levels and splits are named errors.

Runtime ≈ 40 s on 2 busy cores; most of it is generating every cpu task once (2000 + 3 × 320, the ``cpu`` fixture)
and preparing the cpu dataset.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import pytest

from envace_jax import config_check, heldout
from envace_jax.envs import bfcl, datasets, registry, testbed
from envace_jax.envs.base import EnvError, Task
from envace_jax.model import tool_format
from envace_jax.rehearsal import demonstration, views
from envace_jax.rehearsal.episode import UnfoldConfig
from envace_jax.rehearsal.trajectory import Termination
from tests.rehearsal.stand_ins import ScriptedSampler
from tests.test_configs import load as load_config

REPO = Path(__file__).resolve().parents[2]

# Each step's gold calls as (function, whether the real tool must answer with its error): this test's own reading of
# the step templates (envs/testbed.py `STEPS`), so a changed step fails here until the table is updated.
STEP_CALLS: dict[str, tuple[tuple[str, bool], ...]] = {
  "user_id": (("get_user_id", False),),
  "send": (("get_user_id", False), ("send_message", False)),
  "add_contact": (("add_contact", False),),
  "delete_last": (("get_user_id", False), ("delete_message", False)),
  "create_ticket": (("create_ticket", False),),
  "ticket_status": (("get_ticket", False),),
  "close_ticket": (("close_ticket", False),),
  "resolve_ticket": (("resolve_ticket", False),),
  "reprioritize": (("edit_ticket", False),),
  "close_created": (("close_ticket", False),),
  "send_unknown": (("get_user_id", True),),
  "send_logged_out": (("get_user_id", False), ("message_login", False), ("send_message", False)),
  "close_closed": (("close_ticket", True),),
  "bad_priority": (("create_ticket", True),),
  "missing_ticket": (("get_ticket", True),),
}
# The error a rule step's gold call gets, as BFCL's classes word it (bfcl_eval/.../func_source_code/message_api.py,
# ticket_api.py); send_logged_out's gold route logs in first and gets no error.
RULE_ERRORS = {
  "send_unknown": "not found in the workspace.",
  "close_closed": "is already closed.",
  "bad_priority": "Invalid priority. Priority must be between 1 and 5.",
  "missing_ticket": "not found.",
}
BUMP = (
  "the generated tasks changed: if that is intended, bump envs/testbed.py GENERATOR_VERSION and the version of "
  "envs/datasets.py EnvaceTestbed (its major number is the generator's; prepared datasets are versioned by it), "
  "then update the pins here"
)


@pytest.fixture(scope="module")
def cpu() -> dict[str, list[Task]]:
  """Every task of every split at level cpu (2000 + 3 × 320: ≈6 s)."""
  return {split: testbed.load_tasks("cpu", split) for split in testbed.SPLITS}


@pytest.fixture(scope="module")
def full() -> dict[str, list[Task]]:
  """The first 300 train and 80 of each held-out split at level full (train has 4000)."""
  return {split: testbed.load_tasks("full", split, 300 if split == "train" else 80) for split in testbed.SPLITS}


def _level_tasks(request, level: str) -> dict[str, list[Task]]:
  return request.getfixturevalue(level)


def _digest(tasks: Sequence[Task]) -> str:
  h = hashlib.sha256()
  for task in tasks:
    h.update(task.to_json().encode())
  return h.hexdigest()


# ---------------------------------------------------------------------------------------------------------------------
# 1. Determinism


def test_a_task_depends_only_on_level_split_index_and_version(monkeypatch):
  """The same (level, split, index) gives the same task; the seed changes with each of its four parts; a version bump
  gives other tasks under the same (stable) ids."""
  for level, split, index in (("cpu", "train", 3), ("cpu", "rules", 0), ("full", "compositional", 5)):
    assert testbed.make_task(level, split, index).to_json() == testbed.make_task(level, split, index).to_json()
  seeds = {
    testbed.task_seed(level, split, index) for level in testbed.LEVELS for split in testbed.SPLITS for index in range(5)
  }
  assert len(seeds) == len(testbed.LEVELS) * len(testbed.SPLITS) * 5
  assert all(0 <= s < 2**64 for s in seeds)
  before = {i: testbed.make_task("cpu", "iid", i) for i in range(4)}
  seed = testbed.task_seed("cpu", "iid", 0)
  monkeypatch.setattr(testbed, "GENERATOR_VERSION", testbed.GENERATOR_VERSION + 1)
  assert testbed.task_seed("cpu", "iid", 0) != seed
  after = {i: testbed.make_task("cpu", "iid", i) for i in range(4)}
  assert [t.id for t in after.values()] == [t.id for t in before.values()] == [f"tb_cpu_iid_0000{i}" for i in range(4)]
  assert all(after[i].user_turns != before[i].user_turns for i in range(4))  # another world and request each
  assert {t.criteria["generator_version"] for t in after.values()} == {testbed.GENERATOR_VERSION}


def test_another_process_with_another_hash_seed_generates_the_same_tasks():
  """Nothing depends on Python's string hashing (set order) or on the process: a fresh interpreter with another
  PYTHONHASHSEED gives byte-identical tasks."""
  code = (
    "import hashlib\n"
    "from envace_jax.envs import testbed\n"
    "h = hashlib.sha256()\n"
    "for level in testbed.LEVELS:\n"
    "  for split in testbed.SPLITS:\n"
    "    for t in testbed.load_tasks(level, split, 6):\n"
    "      h.update(t.to_json().encode())\n"
    "print(h.hexdigest())\n"
  )
  env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO)}
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  here = _digest(
    [t for level in testbed.LEVELS for split in testbed.SPLITS for t in testbed.load_tasks(level, split, 6)]
  )
  assert out.stdout.strip() == here


def test_golden_tasks(cpu):
  """Pinned tasks: a generator change that alters tasks must bump GENERATOR_VERSION (and EnvaceTestbed's version)."""
  pins = {
    ("cpu", "train", 0): (
      ["resolve_ticket", "reprioritize"],
      ("resolve_ticket", {"ticket_id": 386, "resolution": "Restarted the service"}),
      "Resolve ticket 386 with the resolution 'Restarted the service'.",
    ),
    ("cpu", "iid", 7): (["reprioritize"], ("edit_ticket", {"ticket_id": 786, "updates": {"priority": 5}}),
                        "Set the priority of ticket 786 to 5."),
    ("cpu", "rules", 10): (["send_logged_out"], ("get_user_id", {"user": "Conrad"}),
                           "This is Tom, user USR570: please message Conrad 'Remember the standup'."),
    ("full", "compositional", 3): (["reprioritize", "delete_last"],
                                   ("edit_ticket", {"ticket_id": 562, "updates": {"priority": 5}}),
                                   "Change ticket 562 to priority 5."),
  }  # fmt: skip
  assert testbed.GENERATOR_VERSION == 1, BUMP
  for (level, split, index), (template, (name, arguments), request) in pins.items():
    task = testbed.make_task(level, split, index)
    first = task.gold_actions[0]
    assert task.id == f"tb_{level}_{split}_{index:05d}"
    assert (task.criteria["template"], first.name, dict(first.arguments), task.user_turns[0]) == (
      template, name, arguments, request), BUMP  # fmt: skip
  counts = {(lv, s): len(testbed.templates(testbed.LEVELS[lv], s)) for lv in testbed.LEVELS for s in testbed.SPLITS}
  assert counts == {
    ("cpu", "train"): 32, ("cpu", "iid"): 32, ("cpu", "compositional"): 20, ("cpu", "rules"): 22,
    ("full", "train"): 130, ("full", "iid"): 130, ("full", "compositional"): 320, ("full", "rules"): 26,
  }, BUMP  # fmt: skip
  first_eight = [t for split in testbed.SPLITS for t in cpu[split][:8]]
  assert _digest(first_eight) == "8199b9cc83df04f682d98e8749a9379568fd970c1abad19b03afbf5256b7cafa", BUMP


# ---------------------------------------------------------------------------------------------------------------------
# 2. Every gold sequence succeeds on the real classes


def _check_gold_replay(task: Task, env: testbed.TestbedEnv) -> None:
  """The oracle conversation of ``task`` on the real classes: reward 1.0 by BFCL's checker and communicate_info; the
  calls are the steps' (`STEP_CALLS`), exactly those marked get the real tool's error, and the results are the
  task's recorded reference interactions."""
  conversation = testbed.oracle_conversation(task, env)
  reward = env.evaluate(conversation)
  assert (reward.reward, reward.valid, reward.breakdown) == (1.0, True, {"multi_turn": 1.0, "communicate": 1.0}), (
    task.id, reward.info)  # fmt: skip
  template = task.criteria["template"]
  expected = [call for step in template for call in STEP_CALLS[step]]
  assert [g.name for g in task.gold_actions] == [name for name, _ in expected], task.id
  tools = [m for m in conversation if m.role == "tool"]
  assert [m.is_error for m in tools] == [error for _, error in expected], (task.id, [m.content for m in tools])
  assert [(m.name, m.content, m.is_error) for m in tools] == [
    (r.name, r.result, r.is_error) for r in task.reference_interactions
  ], task.id
  errors = [json.loads(m.content)["error"] for m in tools if m.is_error]
  rules = [s for s in template if s in RULE_ERRORS]
  assert len(errors) == len(rules) and all(RULE_ERRORS[s] in e for s, e in zip(rules, errors, strict=True)), errors
  replies = [m.content for m in conversation if m.role == "assistant" and not m.tool_calls]
  assert replies == task.criteria["replies"] and len(replies) == len(task.user_turns) == len(template)
  for info in task.communicate_info:
    assert any(info.lower() in r.lower() for r in replies), (task.id, info)


@pytest.mark.parametrize("level", ["cpu", "full"])
def test_every_gold_sequence_succeeds_on_the_real_classes(request, level):
  """cpu: every held-out task and the first 300 train tasks; full: the ``full`` fixture's sample."""
  tasks = _level_tasks(request, level)
  env = testbed.TestbedEnv()
  checked = {split: tasks[split][:300] for split in testbed.SPLITS}
  for split, sample in checked.items():
    for task in sample:
      assert (task.benchmark, task.domain, task.split) == ("testbed", level, split)
      _check_gold_replay(task, env)
  rule_steps = {s for t in checked["rules"] for s in t.criteria["template"] if s in testbed.RULE_STEPS}
  assert rule_steps == set(testbed.RULE_STEPS)  # every rule step was replayed
  # The level's knobs (envs/testbed.py `LEVELS`).
  spec = testbed.LEVELS[level]
  functions = {c: set(testbed._class_functions()[c]) for c in testbed.CLASSES}
  for task in (t for sample in checked.values() for t in sample):
    steps = task.criteria["template"]
    assert len(task.user_turns) <= spec.max_turns and len(task.gold_actions) + len(steps) <= spec.max_act
    own = {f for s in steps for f in testbed.STEPS[s].functions}
    classes = task.criteria["involved_classes"]
    assert classes == [c for c in testbed.CLASSES if any(testbed.STEPS[s].cls == c for s in steps)]
    if spec.schemas == "task":
      assert own < set(task.tool_names) and len(task.tool_names) == len(own) + spec.distractors
    else:
      assert set(task.tool_names) == set().union(*(functions[c] for c in classes))
    assert {g.name for g in task.gold_actions} <= set(task.tool_names)


def test_the_generator_rejects_a_gold_call_whose_result_contradicts_its_step(monkeypatch):
  """make_task executes each gold call on the real classes: a call marked to fail that succeeds, or one marked to
  succeed that fails, is a generator bug and raises (flipped here on one step of each kind)."""

  def flipped(step: testbed.Step) -> testbed.Step:
    def make(world, memo):
      turn = step.make(world, memo)
      calls = tuple(dataclasses.replace(c, expect_error=not c.expect_error) for c in turn.calls)
      return dataclasses.replace(turn, calls=calls)

    return dataclasses.replace(step, make=make)

  assert testbed.make_task("cpu", "rules", 39).criteria["template"] == ["close_closed"]
  assert testbed.make_task("cpu", "train", 0).criteria["template"][0] == "resolve_ticket"
  monkeypatch.setitem(testbed.STEPS, "close_closed", flipped(testbed.STEPS["close_closed"]))
  with pytest.raises(EnvError, match=r"rules/39 step close_closed: close_ticket\(.*\) returned .*is already closed"):
    testbed.make_task("cpu", "rules", 39)
  monkeypatch.setitem(testbed.STEPS, "resolve_ticket", flipped(testbed.STEPS["resolve_ticket"]))
  with pytest.raises(EnvError, match=r"train/0 step resolve_ticket: .* returned .*resolved successfully"):
    testbed.make_task("cpu", "train", 0)


# ---------------------------------------------------------------------------------------------------------------------
# 3. The splits are disjoint as documented


def _values(data: Any) -> Iterator[str]:
  """Every key and leaf value of JSON ``data`` as a string, except BFCL's random seeds (any number)."""
  if isinstance(data, dict):
    for key, value in data.items():
      if key != "random_seed":
        yield str(key)
        yield from _values(value)
  elif isinstance(data, list | tuple):
    for value in data:
      yield from _values(value)
  else:
    yield str(data)


def _task_values(task: Task) -> set[str]:
  """What a task holds of its world: the initial state of its classes, the gold calls' arguments, its entities."""
  values = set(_values(task.criteria["initial_config"]))
  values.update(_values([dict(g.arguments) for g in task.gold_actions]))
  return values | set(task.criteria["entities"])


@pytest.mark.parametrize("level", ["cpu", "full"])
def test_the_splits_are_disjoint_by_template_and_entity(request, level):
  """iid: train's templates, none of train's entities; compositional: templates train never has, each across both
  classes; rules: each template has a rule step, no train template has one. No held-out entity (name, text, title,
  id) appears anywhere in a train task's state or calls, nor a train entity in a held-out task's. cpu: every task;
  full: the ``full`` fixture's sample, and the generator's template lists."""
  tasks = _level_tasks(request, level)
  spec = testbed.LEVELS[level]
  signatures = {s: [testbed.split_signature(t) for t in tasks[s]] for s in testbed.SPLITS}
  seen = {s: {template for template, _ in signatures[s]} for s in testbed.SPLITS}
  listed = {s: set(testbed.templates(spec, s)) for s in testbed.SPLITS}
  for split in testbed.SPLITS:
    assert seen[split] <= listed[split], split
  if level == "cpu":
    assert seen["train"] == listed["train"]  # 2000 tasks draw every train template
  train = listed["train"]
  assert seen["iid"] <= train and listed["iid"] == train
  for split in ("compositional", "rules"):
    assert not listed[split] & train and not {frozenset(c) for c in listed[split]} & {frozenset(c) for c in train}
  classes = lambda template: {testbed.STEPS[s].cls for s in template}  # noqa: E731
  assert all(classes(c) == set(testbed.CLASSES) for c in listed["compositional"])
  assert all(len(classes(c)) == 1 for c in train)
  assert all(s in testbed.SEEN_STEPS or s == "close_created" for c in listed["compositional"] for s in c)
  assert all(any(s in testbed.RULE_STEPS for s in c) for c in listed["rules"])
  assert not any(s in testbed.RULE_STEPS for c in train | listed["compositional"] for s in c)

  entities = {s: set().union(*(e for _, e in signatures[s])) for s in testbed.SPLITS}
  heldout_entities = set().union(*(entities[s] for s in testbed.HELDOUT_SPLITS))
  assert len(entities["train"]) > 100 and len(heldout_entities) > 100
  assert not entities["train"] & heldout_entities
  for task in tasks["train"]:
    assert not _task_values(task) & heldout_entities, task.id
  for split in testbed.HELDOUT_SPLITS:
    for task in tasks[split]:
      assert not _task_values(task) & entities["train"], task.id
  # The kinds of entity: names, texts, ticket titles, user and ticket ids all come from disjoint pools.
  for kind in ("name", "text", "title"):
    train_pool, heldout_pool = set(testbed.POOLS["train"][kind]), set(testbed.POOLS["heldout"][kind])
    assert not train_pool & heldout_pool and entities["train"] & train_pool and heldout_entities & heldout_pool
    assert not entities["train"] & heldout_pool and not heldout_entities & train_pool
  user_ids = lambda found: {int(e[3:]) for e in found if e.startswith("USR")}  # noqa: E731
  ticket_ids = lambda found: {int(e) for e in found if e.isdigit()}  # noqa: E731
  assert max(user_ids(entities["train"]) | ticket_ids(entities["train"])) <= testbed.ID_RANGES["train"][1]
  assert min(user_ids(heldout_entities) | ticket_ids(heldout_entities)) >= testbed.ID_RANGES["heldout"][0]


# ---------------------------------------------------------------------------------------------------------------------
# 4. A scripted sampler through the evaluation's committed execution, on the real tools


def _as_act(message) -> str:
  """An assistant message as ACT writes it: one ``<tool_call>`` block, or the reply text."""
  if message.tool_calls:
    (call,) = message.tool_calls
    return tool_format.render_tool_call(call.name, dict(call.arguments))
  return message.content


def _evaluate_scripted(tokenizer, tasks: Sequence[Task], plans: Sequence[Sequence[str]]):
  """`heldout.evaluate_policy` (configs/testbed.py:cpu, rehearsal off: one committed execution per task against
  `TestbedEnv`) with a `ScriptedSampler` whose k-th ACT generation on task i is ``plans[i][k]``."""
  config = load_config("testbed.py:cpu")
  sampler = ScriptedSampler(tokenizer, lambda role, i, k: plans[i][k], len(tasks))
  samplers = {"policy": sampler, "reference": None}
  return heldout.evaluate_policy(
    config, tasks, samplers, tokenizer, jax.random.key(0), fidelity=False, gap=False, gold=False
  )


def test_a_scripted_sampler_that_emits_the_gold_calls_gets_full_reward(smollm2_tokenizer, cpu):
  tasks = [cpu["train"][0]] + [cpu[s][i] for s in testbed.HELDOUT_SPLITS for i in (0, 1)]
  tasks.append(cpu["rules"][10])  # send_logged_out: the gold route logs in first
  env = testbed.TestbedEnv()
  oracles = [testbed.oracle_conversation(t, env) for t in tasks]
  plans = [[_as_act(m) for m in conversation if m.role == "assistant"] for conversation in oracles]
  summary, run = _evaluate_scripted(smollm2_tokenizer, tasks, plans)
  assert (summary["reward"], summary["pass^1"], summary["tasks"], summary["reward/invalid"]) == (1.0, 1.0, 8.0, 0.0)
  assert summary["tool_call_validity"] == 1.0
  assert summary["tool_calls"] == sum(len(t.gold_actions) for t in tasks) / len(tasks)
  for task, oracle, traj in zip(tasks, oracles, run.committed, strict=True):
    assert traj.task.id == task.id and traj.termination == Termination.USER_TURNS_DONE
    assert traj.reward.reward == 1.0 and traj.reward.breakdown == {"multi_turn": 1.0, "communicate": 1.0}
    real = [(m.name, m.content, m.is_error) for m in traj.messages if m.role == "tool"]
    assert real == [(m.name, m.content, m.is_error) for m in oracle if m.role == "tool"]  # the real tools' answers
    assert [m.content for m in traj.messages if m.role == "user"] == list(task.user_turns)


def test_a_scripted_sampler_that_breaks_a_rule_gets_the_tools_real_error(smollm2_tokenizer, cpu):
  """send_logged_out: sending before message_login gets MessageAPI's own "No user is currently logged in." and
  reward 0 (the state differs from the gold's); close_closed: the same call as the gold, the real "already closed"
  error, but a reply that claims success: BFCL's checker passes, the answer was not told, reward 0."""
  logged_out, closed = cpu["rules"][10], cpu["rules"][39]
  assert (logged_out.criteria["template"], closed.criteria["template"]) == (["send_logged_out"], ["close_closed"])
  lookup, login, send = logged_out.gold_actions
  assert (lookup.name, login.name, send.name) == ("get_user_id", "message_login", "send_message")
  (close,) = closed.gold_actions
  render = lambda g: tool_format.render_tool_call(g.name, dict(g.arguments))  # noqa: E731
  plans = [
    [render(lookup), render(send), "Sent your message."],  # skips message_login
    [render(close), f"Closed ticket {close.arguments['ticket_id']}."],  # ignores the error
  ]
  summary, run = _evaluate_scripted(smollm2_tokenizer, [logged_out, closed], plans)
  assert (summary["reward"], summary["pass^1"], summary["reward/invalid"]) == (0.0, 0.0, 0.0)
  sent, closing = run.committed
  tool = [m for m in sent.messages if m.role == "tool"]
  assert [(m.name, m.is_error) for m in tool] == [("get_user_id", False), ("send_message", True)]
  assert json.loads(tool[1].content) == {"error": "No user is currently logged in."}
  # The same call on a fresh MessageAPI loaded with the task's initial state gives exactly that (the class's own).
  instances = bfcl._make_instances(["MessageAPI"], logged_out.criteria["initial_config"], long_context=False)
  assert tool[1].content == json.dumps(instances["MessageAPI"].send_message(**send.arguments))
  assert sent.termination == Termination.USER_TURNS_DONE and sent.reward.reward == 0.0
  assert sent.reward.breakdown["multi_turn"] == 0.0 and sent.reward.info["error_type"]
  (tool,) = [m for m in closing.messages if m.role == "tool"]
  assert tool.is_error and json.loads(tool.content) == {
    "error": f"Ticket with ID {close.arguments['ticket_id']} is already closed."
  }
  assert closing.reward.reward == 0.0 and closing.reward.breakdown == {"multi_turn": 1.0, "communicate": 0.0}
  assert closing.reward.info["not_told"] == ["already closed"]


# ---------------------------------------------------------------------------------------------------------------------
# 5. Wiring: registry, prepared dataset, warm-up, configs


def test_registry_and_dataset_builder_agree_with_the_generator():
  bench = registry.get("testbed")
  assert bench.adapter() is testbed and bench.data == "packaged"
  assert dict(bench.packaged_splits) == {level: testbed.SPLITS for level in testbed.LEVELS}
  assert bench.domains() == testbed.DOMAINS == ("cpu", "full")
  assert all(bench.splits(level) == testbed.SPLITS for level in testbed.LEVELS)
  assert bench.logged_user_turns and bench.demonstrations and not bench.judged and bench.tools_unreachable == ""
  assert datasets.configs("testbed") == testbed.DOMAINS
  assert {c.name: tuple(c.splits) for c in datasets.EnvaceTestbed.BUILDER_CONFIGS} == dict(bench.packaged_splits)
  version = datasets.EnvaceTestbed.VERSION
  assert version.major == testbed.GENERATOR_VERSION and str(version) in datasets.EnvaceTestbed.RELEASE_NOTES
  assert set(testbed.HELDOUT_SPLITS) == set(testbed.SPLITS) - {"train"}
  assert all(testbed.LEVELS[lv].sizes[s] >= 128 for lv in testbed.LEVELS for s in testbed.HELDOUT_SPLITS)


def test_prepare_and_load_round_trip_the_tasks(tmp_path, cpu):
  """The cpu level prepared through the TFDS builder (≈8 s: it generates every task again) and loaded back: the
  same tasks, in order, as the generator's."""
  b = datasets.prepare("testbed", "cpu", tmp_path)
  assert {s: b.info.splits[s].num_examples for s in b.info.splits} == testbed.LEVELS["cpu"].sizes
  assert Path(b.data_dir) == tmp_path / "envace_testbed" / "cpu" / str(datasets.EnvaceTestbed.VERSION)
  for split in testbed.SPLITS:
    source = datasets.load("testbed", "cpu", split, tmp_path)
    assert len(source) == len(cpu[split])
    assert list(source) == cpu[split], split
  assert all(Task.from_json(t.to_json()) == t for t in cpu["iid"][:20])
  with pytest.raises(EnvError, match=r"no split 'test'; choose one of \['train', 'iid', 'compositional', 'rules'\]"):
    datasets.load("testbed", "cpu", "test", tmp_path)
  with pytest.raises(EnvError, match=r"testbed config 'full' is not prepared"):
    datasets.load("testbed", "full", "iid", tmp_path)


@pytest.mark.parametrize("level", ["cpu", "full"])
def test_reference_conversations_and_warm_up_demonstrations(smollm2_tokenizer, request, level):
  """The supervised warm-up's path (train.Trainer.demonstrations): the registry's env and reference conversation
  (the oracle's, reward 1.0), replayed as a demonstration that fits the level's views (configs/testbed.py) and
  trains every gold call (ACT) and every real response (REHEARSE)."""
  tasks = _level_tasks(request, level)
  config = load_config(f"testbed.py:{level}")
  cfg = UnfoldConfig.from_config(config)
  fmt = views.ChatFormat.of(smollm2_tokenizer)
  bench = registry.get("testbed")
  for split in testbed.SPLITS:
    for task in tasks[split][: 5 if level == "cpu" else 2]:
      env = bench.make_env(task)
      assert type(env) is testbed.TestbedEnv
      conversation = bench.reference_conversation(task, env)
      assert conversation == testbed.oracle_conversation(task, testbed.TestbedEnv())
      assert env.evaluate(conversation).reward == 1.0
      traj = demonstration.demonstration(cfg, task, conversation, smollm2_tokenizer, fmt, 0)
      assert traj.termination == Termination.USER_TURNS_DONE, (task.id, traj.termination)
      calls, turns = len(task.gold_actions), len(task.user_turns)
      assert traj.counts["tool_calls"] == calls and traj.counts["demonstration_messages"] == 2 * calls + turns
      env.reset(task)
      assert env.evaluate(traj.messages).reward == 1.0


def test_gold_fidelity_probes_each_gold_call_after_its_own_user_turn(cpu):
  """``eval.fidelity_gold`` (`fidelity.gold_trajectories`) on logged-user tasks: the reference conversation, so each
  turn's gold calls are probed with that turn's user message in REHEARSE's view, not all after the opening."""
  from envace_jax.rehearsal import fidelity

  tasks = [t for t in cpu["iid"] if len(t.user_turns) == 2][:4]
  assert tasks, "no two-turn iid task at level cpu"
  runs = fidelity.gold_trajectories([(t, ()) for t in tasks], lambda task: testbed.TestbedEnv())
  assert [r.group for r in runs] == list(range(len(tasks)))
  for task, run in zip(tasks, runs, strict=True):
    assert run.messages == testbed.oracle_conversation(task, testbed.TestbedEnv())
    found = fidelity.probes([run])
    assert len(found) == len(task.gold_actions)
    for probe in found:
      users = [m.content for m in run.messages[: probe.message] if m.role == "user"]
      dialogue = [m.content for m in probe.view if m.role == "user" and m.content.startswith("User: ")]
      assert dialogue == ["User: " + u for u in users]  # every user turn so far, and only those
    last_turn = max(p.message for p in found)
    assert sum(m.role == "user" for m in run.messages[:last_turn]) == 2  # the last call answers the second turn


def test_the_testbed_configs_validate_and_name_bad_values():
  for spec, level, act_capacity in (("testbed.py", "cpu", 2048), ("testbed.py:cpu", "cpu", 2048),
                                    ("testbed.py:full", "full", 6144)):  # fmt: skip
    config = load_config(spec)
    config_check.validate(config)
    assert (config.env.benchmark, config.env.domain, config.env.split, config.env.eval_split) == (
      "testbed", level, "train", "iid")  # fmt: skip
    assert config.rollout.act_capacity == act_capacity
    assert config.rollout.max_turns >= testbed.LEVELS[level].max_act
    assert config.train.sft_warmup_steps < config.train.steps
  bad = {
    ("testbed.py:nope",): "env.domain='nope' is not a testbed level; choose one of 'cpu', 'full'",
    ("testbed.py", "--config.env.eval_split=test"): (
      "env.eval_split='test' is not a split of testbed cpu; choose one of 'train', 'iid', 'compositional', 'rules'"
    ),
  }
  for (spec, *overrides), expected in bad.items():
    with pytest.raises(config_check.ConfigError) as err:
      config_check.validate(load_config(spec, *overrides))
    assert err.value.problems == [expected]


# ---------------------------------------------------------------------------------------------------------------------
# 6. Errors


def test_unknown_levels_and_splits_name_the_valid_choices():
  levels, splits = r"\['cpu', 'full'\]", r"\('train', 'iid', 'compositional', 'rules'\)"
  with pytest.raises(EnvError, match=rf"unknown testbed level 'tiny'; choose one of {levels}"):
    testbed.load_tasks("tiny", "train")
  with pytest.raises(EnvError, match=rf"unknown testbed level 'tiny'; choose one of {levels}"):
    testbed.make_task("tiny", "train", 0)
  with pytest.raises(EnvError, match=rf"unknown testbed split 'test'; choose one of {splits}"):
    testbed.load_tasks("cpu", "test")
  with pytest.raises(EnvError, match=rf"unknown testbed split 'test'; choose one of {splits}"):
    testbed.make_task("full", "test", 0)
  with pytest.raises(EnvError, match=rf"unknown testbed split 'test'; choose one of {splits}"):
    testbed.templates(testbed.LEVELS["cpu"], "test")
  with pytest.raises(EnvError, match=rf"'tiny' is not a testbed level; choose one of {levels}"):
    registry.get("testbed").splits("tiny")
  with pytest.raises(EnvError, match=r"unknown testbed config 'tiny'"):
    datasets.builder("testbed", "tiny", "/nonexistent")
  task = testbed.make_task("cpu", "iid", 0)
  with pytest.raises(EnvError, match=r"task 'x' is not a testbed task \(benchmark 'bfcl'\)"):
    testbed.TestbedEnv().reset(dataclasses.replace(task, id="x", benchmark="bfcl"))
