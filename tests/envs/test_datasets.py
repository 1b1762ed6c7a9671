"""Prepared task datasets: TFDS array_record round trip, random access, caching, resumable streams, no TensorFlow."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tensorflow_datasets as tfds

from envace_jax.envs import datasets
from envace_jax.envs.base import EnvError, GoldAction, ReferenceInteraction, Task

REPO = Path(__file__).resolve().parents[2]


def make_tasks(domain: str, split: str, n: int = 7) -> list[Task]:
  """Hand-made tasks that use every Task field, with non-ASCII text and nested arguments."""
  tool = {
    "type": "function",
    "function": {"name": "book", "description": "Réserver ✈", "parameters": {"type": "object", "properties": {}}},
  }
  return [
    Task(
      id=f"{domain}-{split}-{i}",
      benchmark="tau2",
      domain=domain,
      split=split,
      system_prompt=f"Policy {i}: be nice — ünïcødé ✓\n",
      tools=(tool,),
      user_scenario=f"You want seat {i}",
      user_turns=("hi", "bye"),
      gold_actions=(GoldAction("book", {"seat": i, "opts": {"window": True, "names": ["a", "b"]}}, ("seat",)),),
      communicate_info=(f"{i * 10}",),
      reference_interactions=(ReferenceInteraction("book", {"seat": i}, json.dumps({"ok": i}), False),),
      criteria={"nl_assertions": [f"agent books {i}"], "score": 0.5},
      user_stop_markers=("###STOP###",),
    )
    for i in range(n)
  ]


def original_task(domain: str, split: str, i: int) -> Task:
  return make_tasks(domain, split)[i]


@pytest.fixture
def fake_tau2(monkeypatch):
  """Replaces the τ² adapter with hand-made tasks; returns the list of (domain, split) calls."""
  calls = []

  def load(domain: str, split: str) -> list[Task]:
    calls.append((domain, split))
    return make_tasks(domain, split, n=4 if split == "test" else 7)

  monkeypatch.setattr(datasets, "_load_tau2_tasks", load)
  return calls


def test_prepare_writes_array_record_and_tasks_round_trip(tmp_path, fake_tau2):
  b = datasets.prepare("tau2", "airline", tmp_path)
  version_dir = tmp_path / "envace_tau2" / "airline" / "1.0.0"
  assert Path(b.data_dir) == version_dir
  assert b.info.file_format == tfds.core.FileFormat.ARRAY_RECORD
  assert {s: b.info.splits[s].num_examples for s in b.info.splits} == {"train": 7, "test": 4}
  assert sorted(p.name for p in version_dir.glob("*.array_record*")) == [
    "envace_tau2-test.array_record-00000-of-00001",
    "envace_tau2-train.array_record-00000-of-00001",
  ]
  assert sorted(fake_tau2) == [("airline", "test"), ("airline", "train")]

  for split in ("train", "test"):
    source = datasets.load("tau2", "airline", split, tmp_path)
    original = make_tasks("airline", split, n=len(source))
    assert list(source) == original  # exact round trip, in the adapter's order
  source = datasets.load("tau2", "airline", "train", tmp_path)
  assert source[-1] == original_task("airline", "train", 6)
  assert source[2:5] == make_tasks("airline", "train")[2:5]
  assert source.get_many([5, 0, 5]) == [original_task("airline", "train", i) for i in (5, 0, 5)]
  with pytest.raises(IndexError, match="out of range"):
    source[7]


def test_tfds_data_source_and_builder_from_directory_give_random_access(tmp_path, fake_tau2):
  datasets.prepare("tau2", "retail", tmp_path)
  ds = tfds.data_source("envace_tau2/retail:1.0.0", split="train", data_dir=os.fspath(tmp_path), download=False)
  assert len(ds) == 7
  for i in (6, 0, 3):
    record = ds[i]
    assert record["id"] == f"retail-train-{i}".encode()
    assert Task.from_json(record["task_json"].decode()) == original_task("retail", "train", i)
  # Without our builder classes: the files describe themselves.
  ro = tfds.builder_from_directory(os.fspath(tmp_path / "envace_tau2" / "retail" / "1.0.0"))
  test = datasets.TaskSource(ro.as_data_source("test"))
  assert [t.id for t in test] == [f"retail-test-{i}" for i in range(4)]


def test_prepare_twice_reuses_the_files(tmp_path, fake_tau2):
  datasets.prepare("tau2", "mock", tmp_path)
  files = sorted((tmp_path / "envace_tau2" / "mock" / "1.0.0").iterdir())
  mtimes = [f.stat().st_mtime_ns for f in files]
  n_calls = len(fake_tau2)
  b = datasets.prepare("tau2", "mock", tmp_path)
  assert len(fake_tau2) == n_calls  # the adapter was not asked again
  assert sorted(Path(b.data_dir).iterdir()) == files
  assert [f.stat().st_mtime_ns for f in files] == mtimes
  assert len(datasets.load("tau2", "mock", "base", tmp_path)) == 7


def test_bfcl_config_has_one_test_split(tmp_path, monkeypatch):
  def load(category: str) -> list[Task]:
    return [dataclasses.replace(t, benchmark="bfcl", domain=category) for t in make_tasks(category, "test", n=3)]

  monkeypatch.setattr(datasets, "_load_bfcl_tasks", load)
  datasets.prepare("bfcl", "multi_turn_miss_func", tmp_path)
  source = datasets.load("bfcl", "multi_turn_miss_func", "test", tmp_path)
  assert list(source) == load("multi_turn_miss_func")
  with pytest.raises(EnvError, match=r"no split 'train'; choose one of \['test'\]"):
    datasets.load("bfcl", "multi_turn_miss_func", "train", tmp_path)


def test_checklist_builder_splits_by_task_and_follows_file_content(tmp_path, monkeypatch):
  data = tmp_path / "My Data.jsonl"
  data.write_text("v1")
  loaded = {
    "v1": make_tasks("shop", "all", n=3) + make_tasks("shop", "test", n=2),
    "v2": make_tasks("shop", "all", n=5),
  }
  monkeypatch.setattr(datasets, "_load_checklist_tasks", lambda path: loaded[Path(path).read_text()])
  root = tmp_path / "tfds"
  b1 = datasets.prepare("checklist", data, root)
  assert b1.builder_config.name.startswith("my_data_")
  assert set(b1.info.splits) == {"train", "test"}  # Task.split "all" is written to TFDS split "train"
  assert list(datasets.load("checklist", data, "train", root)) == loaded["v1"][:3]
  assert list(datasets.load("checklist", data, "test", root)) == loaded["v1"][3:]

  data.write_text("v2")  # new content -> a new config, not the stale one
  b2 = datasets.prepare("checklist", data, root)
  assert b2.builder_config.name != b1.builder_config.name
  assert list(datasets.load("checklist", data, "train", root)) == loaded["v2"]
  with pytest.raises(EnvError, match="does not exist"):
    datasets.prepare("checklist", tmp_path / "missing.jsonl", root)


def test_errors_name_the_choices(tmp_path, fake_tau2, monkeypatch):
  with pytest.raises(
    EnvError, match=r"unknown benchmark 'gsm8k'.*\['tau2', 'bfcl', 'testbed', 'checklist', 'vitabench', 'finmcp'\]"
  ):
    datasets.prepare("gsm8k", "x", tmp_path)
  with pytest.raises(EnvError, match=r"unknown tau2 config 'banking'.*'mock', 'airline', 'retail'"):
    datasets.load("tau2", "banking", "train", tmp_path)
  with pytest.raises(EnvError, match=r"not prepared.*prepare\('tau2', 'airline'"):
    datasets.load("tau2", "airline", "train", tmp_path)
  datasets.prepare("tau2", "airline", tmp_path)
  with pytest.raises(EnvError, match=r"no split 'dev'; choose one of \['train', 'test'\]"):
    datasets.load("tau2", "airline", "dev", tmp_path)

  monkeypatch.setattr(datasets, "_load_tau2_tasks", lambda d, s: make_tasks(d, s, 2) + make_tasks(d, s, 1))
  with pytest.raises(EnvError, match="task id 'retail-train-0' occurs twice"):
    datasets.prepare("tau2", "retail", tmp_path)


# --- TaskStream ---------------------------------------------------------------------------------------------------


def ids(batches: list[list[Task]]) -> list[list[str]]:
  return [[t.id for t in b] for b in batches]


def take_ids(stream: datasets.TaskStream, n: int) -> list[list[str]]:
  """The task ids of the stream's next n batches."""
  return ids([stream.next_batch() for _ in range(n)])


def test_stream_resumes_exactly_from_a_saved_position():
  tasks = make_tasks("d", "train", n=11)
  uninterrupted = take_ids(datasets.TaskStream(tasks, batch_size=3, seed=7), 12)

  stream = datasets.TaskStream(tasks, batch_size=3, seed=7)
  head = [stream.next_batch() for _ in range(5)]  # crosses the first epoch boundary (3 batches per epoch)
  state = stream.state()
  assert state == {"seed": 7, "batch_size": 3, "position": 15, "num_tasks": 11}
  assert json.loads(json.dumps(state)) == state  # plain ints: any checkpoint can hold it
  resumed = datasets.TaskStream.from_state(tasks, json.loads(json.dumps(state)))
  assert ids(head) + ids([resumed.next_batch() for _ in range(7)]) == uninterrupted
  # The constructor's position argument is the same thing.
  again = datasets.TaskStream(tasks, batch_size=3, seed=7, position=15)
  assert ids([again.next_batch() for _ in range(7)]) == uninterrupted[5:]


def test_epochs_reshuffle_deterministically():
  tasks = make_tasks("d", "train", n=10)
  stream = datasets.TaskStream(tasks, batch_size=4, seed=1)
  assert stream.batches_per_epoch == 2
  batches = take_ids(stream, 6)  # 3 epochs x 2 batches; 2 tasks of each epoch's permutation are skipped
  epochs = [batches[0] + batches[1], batches[2] + batches[3], batches[4] + batches[5]]
  for epoch in epochs:
    assert len(set(epoch)) == 8  # no task twice in an epoch, so never twice in a batch
  assert epochs[0] != epochs[1] != epochs[2]
  assert stream.epoch == 3
  expected = np.random.default_rng([1, 1]).permutation(10)[:8]
  assert epochs[1] == [f"d-train-{i}" for i in expected]
  assert take_ids(datasets.TaskStream(tasks, batch_size=4, seed=1), 6) == batches
  assert take_ids(datasets.TaskStream(tasks, batch_size=4, seed=2), 6) != batches


def test_stream_over_a_prepared_source(tmp_path, fake_tau2):
  datasets.prepare("tau2", "mock", tmp_path)
  source = datasets.load("tau2", "mock", "base", tmp_path)
  from_disk = take_ids(datasets.TaskStream(source, batch_size=2, seed=3), 5)
  in_memory = take_ids(datasets.TaskStream(make_tasks("mock", "base"), batch_size=2, seed=3), 5)
  assert from_disk == in_memory


def test_stream_refuses_bad_arguments_and_a_changed_dataset():
  tasks = make_tasks("d", "train", n=5)
  with pytest.raises(EnvError, match=r"batch_size must be in \[1, 5\]"):
    datasets.TaskStream(tasks, batch_size=6, seed=0)
  with pytest.raises(EnvError, match="at least one task"):
    datasets.TaskStream([], batch_size=1, seed=0)
  with pytest.raises(EnvError, match="non-negative"):
    datasets.TaskStream(tasks, batch_size=2, seed=-1)
  with pytest.raises(EnvError, match="multiple of batch_size=2"):
    datasets.TaskStream(tasks, batch_size=2, seed=0, position=3)
  state = datasets.TaskStream(tasks, batch_size=2, seed=0, position=4).state()
  with pytest.raises(EnvError, match="saved over 5 tasks but the source has 4"):
    datasets.TaskStream.from_state(tasks[:4], state)
  with pytest.raises(EnvError, match=r"lacks \['num_tasks'\]"):
    datasets.TaskStream.from_state(tasks, {k: v for k, v in state.items() if k != "num_tasks"})


# --- No TensorFlow ------------------------------------------------------------------------------------------------

_NO_TF_SCRIPT = """
import importlib.util, sys

class HideTensorFlow:
  # Wraps every import finder: "tensorflow" (and its submodules) is not found, whether installed or not.
  def __init__(self, finder):
    self.finder = finder
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] == "tensorflow":
      return None
    return self.finder.find_spec(name, path, target)
  def invalidate_caches(self):
    getattr(self.finder, "invalidate_caches", lambda: None)()

sys.meta_path[:] = [HideTensorFlow(f) for f in sys.meta_path]
assert importlib.util.find_spec("tensorflow") is None
try:
  import tensorflow
  raise SystemExit("tensorflow imported")
except ImportError:
  pass

from envace_jax.envs import datasets
from envace_jax.envs.base import Task
from tests.envs.test_datasets import make_tasks

datasets._load_tau2_tasks = lambda domain, split: make_tasks(domain, split)
data_dir = sys.argv[1]
datasets.prepare("tau2", "retail", data_dir)
source = datasets.load("tau2", "retail", "test", data_dir)
assert list(source) == make_tasks("retail", "test"), "round trip"
batch = datasets.TaskStream(source, batch_size=3, seed=0).next_batch()
assert all(isinstance(t, Task) for t in batch)
assert "tensorflow" not in sys.modules, "tensorflow was imported"
print("OK without tensorflow")
"""


def test_prepare_and_read_without_tensorflow(tmp_path):
  """In a fresh interpreter where `tensorflow` cannot be found: TFDS writes and reads, and never imports it.

  (`sys.modules["tensorflow"] = None` is no good test: TFDS treats a "tensorflow" key in sys.modules as "TF is
  loaded" and then fails to import it.)
  """
  result = subprocess.run(
    [sys.executable, "-c", textwrap.dedent(_NO_TF_SCRIPT), os.fspath(tmp_path)],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, "PYTHONPATH": os.pathsep.join([os.fspath(REPO), os.environ.get("PYTHONPATH", "")])},
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert "OK without tensorflow" in result.stdout
  assert list((tmp_path / "envace_tau2" / "retail" / "1.0.0").glob("*.array_record-*"))


# --- The real adapters ---------------------------------------------------------------------------------------------
# Imported inside the tests, plainly (an import error fails them): the no-TensorFlow script above imports this module
# for make_tasks, and the τ² adapter's import chain (litellm) does not run under its import hook.


def test_tau2_configs_match_the_adapter():
  from envace_jax.envs import tau2

  assert set(datasets.configs("tau2")) == set(tau2.DOMAINS)
  for config in datasets.EnvaceTau2.BUILDER_CONFIGS:
    assert set(config.splits) <= set(tau2.splits(config.name)), config.name


def test_prepare_real_tau2_mock_domain(tmp_path, monkeypatch):
  produced = []  # what the real adapter returned at preparation time (its criteria carry load-time timestamps)
  real_loader = datasets._load_tau2_tasks

  def recording_loader(domain: str, split: str) -> list[Task]:
    produced.extend(real_loader(domain, split))
    return produced

  monkeypatch.setattr(datasets, "_load_tau2_tasks", recording_loader)
  b = datasets.prepare("tau2", "mock", tmp_path)
  assert set(b.info.splits) == {"base"}
  source = datasets.load("tau2", "mock", "base", tmp_path)
  assert len(source) == 9
  assert list(source) == produced
  assert any(t.reference_interactions for t in source)  # the gold actions were replayed at preparation time


def test_bfcl_configs_match_the_adapter_and_prepare_for_real(tmp_path):
  from envace_jax.envs import bfcl

  assert datasets.configs("bfcl") == bfcl.CATEGORIES
  datasets.prepare("bfcl", "multi_turn_base", tmp_path)
  source = datasets.load("bfcl", "multi_turn_base", "test", tmp_path)
  assert list(source) == bfcl.load_tasks("multi_turn_base")


def test_prepare_real_checklist_fixture(tmp_path):
  from envace_jax.envs import checklist

  fixture = REPO / "tests" / "envs" / "data" / "checklist_fixture.jsonl"
  expected = checklist.load_tasks(fixture)
  assert [t.id for t in expected] == ["weather-001", "football-002", "chitchat-003"]  # one task per JSONL line
  b = datasets.prepare("checklist", fixture, tmp_path)
  assert sum(b.info.splits[s].num_examples for s in b.info.splits) == len(expected)
  read = [t for s in b.info.splits for t in datasets.load("checklist", fixture, s, tmp_path)]
  assert sorted(read, key=lambda t: t.id) == sorted(expected, key=lambda t: t.id)
