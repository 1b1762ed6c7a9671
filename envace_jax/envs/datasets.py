"""Prepared task datasets: versioned TFDS array_record files, random access, a resumable shuffled stream.

Training does not talk to the benchmark harnesses every step: `prepare` runs an adapter's `load_tasks` once (for τ²
that includes replaying the gold actions for grounding) and writes the tasks as `Task.to_json()` records into a TFDS
dataset in the array_record format (TFDS writes and reads it with numpy alone: no TensorFlow). `load` opens it with
`as_data_source` as an indexable `TaskSource`; `TaskStream` draws resumable batches from it.

One builder per benchmark (`_BUILDERS`, TFDS names `envace_<benchmark>`), one config per τ² domain or BFCL category
(`registry.Benchmark.packaged_splits`, whose splits it has). A checklist config is named after the file and a hash of
its content (`mydata_3f2a9c01b7e4`), so editing the file prepares a new config instead of reading a stale one; its
splits are the tasks' own. VitaBench and FinMCP-Bench configs are "DOMAIN:PATH" (`registry.Benchmark.source_config`),
named after the domain and a hash of the data read, with the one split "test".

On disk, under `data_dir`: `envace_tau2/retail/1.0.0/envace_tau2-train.array_record-00000-of-00001`, next to
`dataset_info.json` and `features.json`. A prepared version is never regenerated: change the data, bump the version.
Elsewhere (no envace code), the files read back with
`tfds.builder_from_directory(data_dir / "envace_tau2/retail/1.0.0").as_data_source("train")`.

Prepare once, before the run (one process): two processes preparing the same config under one `data_dir` at the
same time race on TFDS's final rename. Records keep the adapter's order (TFDS's key-hash shuffling is off).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, overload

import numpy as np
import tensorflow_datasets as tfds

from envace_jax.envs import registry
from envace_jax.envs.base import EnvError, Task

_FILE_FORMAT = "array_record"
_VERSION = tfds.core.Version("1.0.0")
_RELEASE_NOTES = {
  "1.0.0": "First release: one record per task, the task as `Task.to_json()` plus id/benchmark/domain/split."
}


# --- Task loaders -------------------------------------------------------------------------------------------------
# The adapters are imported here, at preparation time only, so this module (and reading prepared data) needs none of
# the benchmark harnesses. Tests replace these functions.


def _load_tau2_tasks(domain: str, split: str) -> list[Task]:
  from envace_jax.envs import tau2

  return tau2.load_tasks(domain, split, with_reference=True)


def _load_bfcl_tasks(category: str) -> list[Task]:
  from envace_jax.envs import bfcl

  return bfcl.load_tasks(category)


def _load_testbed_tasks(level: str, split: str) -> list[Task]:
  from envace_jax.envs import testbed

  return testbed.load_tasks(level, split)


def _load_checklist_tasks(path: str) -> list[Task]:
  from envace_jax.envs import checklist

  return checklist.load_tasks(path)


def _load_vitabench_tasks(path: str, domain: str) -> list[Task]:
  from envace_jax.envs import vitabench

  return vitabench.load_tasks(path, domain)


def _load_finmcp_tasks(path: str, domain: str) -> list[Task]:
  from envace_jax.envs import finmcp

  return finmcp.load_tasks(path, domain)


# --- TFDS builders ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class TaskConfig(tfds.core.BuilderConfig):
  """A builder config: which tasks to load, and the splits.

  Attributes:
    source: the argument the adapter's `load_tasks` gets (domain, category or path).
    splits: the TFDS splits this config has; () for the checklist builder, whose splits come from the tasks.
  """

  source: str = ""
  splits: tuple[str, ...] = ()


def _features() -> tfds.features.FeaturesDict:
  return tfds.features.FeaturesDict(
    {
      "id": tfds.features.Text(doc="Task.id"),
      "benchmark": tfds.features.Text(doc="Task.benchmark"),
      "domain": tfds.features.Text(doc="Task.domain"),
      "split": tfds.features.Text(doc="Task.split"),
      "task_json": tfds.features.Text(doc="Task.to_json(): the whole task; Task.from_json() restores it exactly"),
    }
  )


def _example(task: Task) -> dict[str, str]:
  return {
    "id": task.id,
    "benchmark": task.benchmark,
    "domain": task.domain,
    "split": task.split,
    "task_json": task.to_json(),
  }


def _examples(tasks: Iterable[Task], where: str) -> Iterator[tuple[str, dict[str, str]]]:
  """(key, example) pairs in the adapter's order; a repeated task id is an error (TFDS keys must be unique)."""
  seen: set[str] = set()
  for task in tasks:
    if not isinstance(task, Task):
      raise EnvError(f"{where}: the task loader returned {type(task).__name__}, not a Task")
    if task.id in seen:
      raise EnvError(f"{where}: task id {task.id!r} occurs twice; task ids must be unique within a split")
    seen.add(task.id)
    yield task.id, _example(task)


class _TaskBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """Shared by the task builders: the features, the info, and order-preserving writes (no TFDS shuffling)."""

  VERSION = _VERSION
  RELEASE_NOTES = _RELEASE_NOTES
  DESCRIPTION = ""
  # TFDS looks for a checksums file next to the builder's code via `code_path`, and on Python >= 3.9 that lookup
  # imports `importlib_resources`, which TFDS only declares for Python < 3.9. Nothing is downloaded here, so there
  # is no checksums file: no code path.
  code_path = None

  def _info(self) -> tfds.core.DatasetInfo:
    # DatasetInfo directly, not `dataset_info_from_configs`: that one reads README/CITATIONS files from this
    # module's folder.
    return tfds.core.DatasetInfo(
      builder=self,
      description=self.DESCRIPTION,
      features=_features(),
      disable_shuffling=True,  # record i is the adapter's i-th task; TaskStream shuffles
    )


class EnvaceTau2(_TaskBuilder):
  """τ²-bench tasks of one domain, with reference tool interactions replayed at preparation time."""

  name = "envace_tau2"
  DESCRIPTION = "tau2-bench tasks (one config per domain) as envace Task JSON, with replayed reference interactions."
  BUILDER_CONFIGS = [
    TaskConfig(name=d, source=d, splits=s, description=f"tau2-bench {d} domain")
    for d, s in registry.get("tau2").packaged_splits.items()
  ]

  def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict[str, Iterator]:
    del dl_manager  # nothing to download: the tasks ship with the tau2 package
    return {split: self._generate_examples(split) for split in self.builder_config.splits}

  def _generate_examples(self, split: str) -> Iterator[tuple[str, dict[str, str]]]:
    domain = self.builder_config.source
    yield from _examples(_load_tau2_tasks(domain, split), f"tau2 {domain}/{split}")


class EnvaceBfcl(_TaskBuilder):
  """BFCL multi-turn tasks of one category (BFCL has no training split: everything is "test")."""

  name = "envace_bfcl"
  DESCRIPTION = "BFCL multi-turn tasks (one config per category) as envace Task JSON."
  BUILDER_CONFIGS = [
    TaskConfig(name=c, source=c, splits=s, description=f"BFCL {c}")
    for c, s in registry.get("bfcl").packaged_splits.items()
  ]

  def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict[str, Iterator]:
    del dl_manager  # nothing to download: the tasks ship with the bfcl-eval package
    return {split: self._generate_examples(split) for split in self.builder_config.splits}

  def _generate_examples(self, split: str) -> Iterator[tuple[str, dict[str, str]]]:
    del split  # one split
    category = self.builder_config.source
    yield from _examples(_load_bfcl_tasks(category), f"bfcl {category}")


class EnvaceTestbed(_TaskBuilder):
  """The testbed's generated tasks of one level (envs/testbed.py), one split per testbed split.

  The version's major number is the generator's (`testbed.GENERATOR_VERSION`): a generator change prepares anew.
  """

  name = "envace_testbed"
  VERSION = tfds.core.Version("1.0.0")
  RELEASE_NOTES = {
    "1.0.0": "Generator version 1: MessageAPI and TicketAPI tasks, splits train/iid/compositional/rules."
  }
  DESCRIPTION = "Generated multi-turn tasks over BFCL-v4's MessageAPI and TicketAPI (one config per level)."
  BUILDER_CONFIGS = [
    TaskConfig(name=level, source=level, splits=s, description=f"testbed level {level}")
    for level, s in registry.get("testbed").packaged_splits.items()
  ]

  def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict[str, Iterator]:
    del dl_manager  # generated here, from the bfcl-eval package's classes
    return {split: self._generate_examples(split) for split in self.builder_config.splits}

  def _generate_examples(self, split: str) -> Iterator[tuple[str, dict[str, str]]]:
    level = self.builder_config.source
    yield from _examples(_load_testbed_tasks(level, split), f"testbed {level}/{split}")


class EnvaceChecklist(_TaskBuilder):
  """Tasks in the paper's checklist format from a user-supplied file or folder; one TFDS split per `Task.split`.

  TFDS reserves the split name "all" (the union of all splits), so tasks whose `split` is "all" (data without
  splits) are written to the TFDS split "train"; the task itself keeps `split="all"`.
  """

  name = "envace_checklist"
  DESCRIPTION = "Tasks in the checklist training-data format, from a user-supplied path, as envace Task JSON."

  def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict[str, Iterator]:
    del dl_manager
    path = self.builder_config.source
    by_split: dict[str, list[Task]] = {}
    for task in _load_checklist_tasks(path):
      split = "train" if task.split == "all" else task.split
      if not re.fullmatch(r"[A-Za-z0-9_]+", split):
        raise EnvError(f"checklist {path}: task {task.id!r} has split {task.split!r}; use letters, digits and _")
      by_split.setdefault(split, []).append(task)
    if not by_split:
      raise EnvError(f"checklist {path}: no tasks")
    return {split: self._generate_examples(tasks, split) for split, tasks in by_split.items()}

  def _generate_examples(self, tasks: list[Task], split: str) -> Iterator[tuple[str, dict[str, str]]]:
    yield from _examples(tasks, f"checklist {self.builder_config.source}/{split}")


class _UserDataBuilder(_TaskBuilder, skip_registration=True):
  """Tasks of a benchmark whose data the user supplies (config source "DOMAIN:PATH"), all in the split "test"."""

  def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict[str, Iterator]:
    del dl_manager
    return {"test": self._generate_examples()}

  def _generate_examples(self) -> Iterator[tuple[str, dict[str, str]]]:
    domain, _, path = self.builder_config.source.partition(":")
    yield from _examples(self._load(path, domain), f"{self.name} {self.builder_config.source}")

  def _load(self, path: str, domain: str) -> list[Task]:
    raise NotImplementedError


class EnvaceVitabench(_UserDataBuilder):
  """VitaBench tasks of one domain from the user's clone (envs/vitabench.py); VitaBench has only test tasks."""

  name = "envace_vitabench"
  DESCRIPTION = "VitaBench tasks (one domain, user-supplied data) as envace Task JSON, each with its own database."

  def _load(self, path: str, domain: str) -> list[Task]:
    return _load_vitabench_tasks(path, domain)


class EnvaceFinmcp(_UserDataBuilder):
  """FinMCP-Bench samples (all, or one sample type) from the user's download (envs/finmcp.py)."""

  name = "envace_finmcp"
  DESCRIPTION = "FinMCP-Bench samples (user-supplied data) as envace Task JSON, with their reference tool calls."

  def _load(self, path: str, domain: str) -> list[Task]:
    return _load_finmcp_tasks(path, domain)


_BUILDERS: dict[str, type[_TaskBuilder]] = {
  "tau2": EnvaceTau2,
  "bfcl": EnvaceBfcl,
  "testbed": EnvaceTestbed,
  "checklist": EnvaceChecklist,
  "vitabench": EnvaceVitabench,
  "finmcp": EnvaceFinmcp,
}


def configs(benchmark: str) -> tuple[str, ...]:
  """The config names of `benchmark` ("checklist" has none: its config is a path).

  Raises:
    EnvError: unknown benchmark.
  """
  return tuple(c.name for c in builder_class(benchmark).BUILDER_CONFIGS)


def builder_class(benchmark: str) -> type[_TaskBuilder]:
  """The TFDS builder class of ``benchmark``.

  Raises:
    EnvError: unknown benchmark.
  """
  if benchmark not in _BUILDERS:
    raise EnvError(f"unknown benchmark {benchmark!r} for prepared datasets; choose one of {list(_BUILDERS)}")
  return _BUILDERS[benchmark]


def _checklist_config(path: str | Path) -> TaskConfig:
  """A config named after the path's stem and a hash of its content (file, or every file under a folder)."""
  path = Path(path).expanduser().resolve()
  if not path.exists():
    raise EnvError(f"checklist data {str(path)!r} does not exist; the checklist config is the path of the data")
  digest = hashlib.sha256()
  files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
  for f in files:
    digest.update(str(f.relative_to(path) if f != path else f.name).encode() + b"\0")
    digest.update(f.read_bytes() + b"\0")
  stem = re.sub(r"[^a-z0-9]+", "_", path.stem.lower()).strip("_") or "data"
  return TaskConfig(name=f"{stem}_{digest.hexdigest()[:12]}", source=str(path), description=f"checklist data {path}")


def _user_data_config(benchmark: str, config: str | Path) -> TaskConfig:
  """A "DOMAIN:PATH" config named after the domain and a hash of the data files it reads."""
  domain, sep, raw_path = str(config).partition(":")
  if not sep or not domain or not raw_path:
    raise EnvError(f"a {benchmark} dataset config is 'DOMAIN:PATH' (Benchmark.source_config), got {str(config)!r}")
  path = Path(raw_path).expanduser().resolve()
  files = registry.get(benchmark).data_files(path, domain)
  digest = hashlib.sha256()
  for f in files:
    digest.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
  name = f"{re.sub(r'[^a-z0-9]+', '_', domain.lower()).strip('_')}_{digest.hexdigest()[:12]}"
  return TaskConfig(name=name, source=f"{domain}:{path}", description=f"{benchmark} {domain} data {path}")


def builder(benchmark: str, config: str | Path, data_dir: str | Path) -> _TaskBuilder:
  """The TFDS builder of one benchmark config under `data_dir` (array_record); prepares nothing.

  Args:
    benchmark: one of `registry.BENCHMARKS`.
    config: a config of `configs(benchmark)`; for "checklist" the path of the checklist-format data; for "vitabench"
      and "finmcp" "DOMAIN:PATH" (`registry.Benchmark.source_config`).
    data_dir: root folder of the prepared datasets.

  Raises:
    EnvError: unknown benchmark or config; missing checklist data.
  """
  cls = builder_class(benchmark)
  data = registry.get(benchmark).data
  if data == "path":
    builder_config: TaskConfig | str = _checklist_config(config)
  elif data == "download":
    builder_config = _user_data_config(benchmark, config)
  else:
    names = configs(benchmark)
    if config not in names:
      raise EnvError(f"unknown {benchmark} config {config!r}; choose one of {list(names)}")
    builder_config = str(config)
  return cls(config=builder_config, data_dir=str(data_dir), file_format=_FILE_FORMAT)


def prepare(benchmark: str, config: str | Path, data_dir: str | Path) -> _TaskBuilder:
  """Load the tasks through the benchmark's adapter and write them as array_record; no-op when already prepared.

  Args:
    benchmark, config, data_dir: as for `builder`.

  Returns:
    The prepared builder (`builder.info.splits` has the split sizes).

  Raises:
    EnvError: unknown benchmark or config, missing checklist data, repeated task ids, or an adapter's own error.
  """
  b = builder(benchmark, config, data_dir)
  download_config = tfds.download.DownloadConfig(try_download_gcs=False)
  b.download_and_prepare(file_format=_FILE_FORMAT, download_config=download_config)
  return b


class TaskSource(Sequence[Task]):
  """Random access to the tasks of one prepared split: `len(source)`, `source[i] -> Task`, `source[i:j]`.

  Records are decoded on access (nothing is held in memory). `records` is any random-access sequence of TFDS
  examples, normally the `ArrayRecordDataSource` of `tfds.data_source` / `builder.as_data_source(split)`.

  Attributes:
    name: "benchmark/config/split", for messages and logs.
  """

  def __init__(self, records: Sequence[Mapping[str, Any]], name: str = ""):
    self._records = records
    self.name = name

  def __len__(self) -> int:
    return len(self._records)

  @overload
  def __getitem__(self, index: int) -> Task: ...

  @overload
  def __getitem__(self, index: slice) -> list[Task]: ...

  def __getitem__(self, index: int | slice) -> Task | list[Task]:
    """The task at `index` (negative counts from the end), or a list for a slice. Raises IndexError out of range."""
    if isinstance(index, slice):
      return self.get_many(range(*index.indices(len(self))))
    return _decode(self._records[self._check(index)])

  def get_many(self, indices: Iterable[int]) -> list[Task]:
    """The tasks at `indices`, in that order, read in one batched call where the records support it.

    Raises:
      IndexError: an index out of range.
    """
    keys = [self._check(i) for i in indices]
    many = getattr(self._records, "__getitems__", None)
    records = many(keys) if many is not None and keys else [self._records[k] for k in keys]
    return [_decode(r) for r in records]

  def _check(self, index: int) -> int:
    n = len(self)
    i = int(index)
    if not -n <= i < n:
      raise IndexError(f"task index {i} out of range for {self.name or 'the task source'} of {n} tasks")
    return i % n

  def __repr__(self) -> str:
    return f"TaskSource({self.name!r}, {len(self)} tasks)"


def _decode(record: Mapping[str, Any]) -> Task:
  text = record["task_json"]
  return Task.from_json(text.decode("utf-8") if isinstance(text, bytes) else text)


def load(benchmark: str, config: str | Path, split: str, data_dir: str | Path) -> TaskSource:
  """Open one split of a prepared dataset for random access (`prepare` it first).

  Args:
    benchmark, config, data_dir: as for `builder` (and `prepare`).
    split: a split of that config.

  Raises:
    EnvError: unknown benchmark, config or split; the dataset is not prepared under `data_dir`.
  """
  b = builder(benchmark, config, data_dir)
  if not b.is_prepared():
    raise EnvError(
      f"{benchmark} config {b.builder_config.name!r} is not prepared under {str(data_dir)!r} "
      f"(looked for {b.data_dir}); "
      f"run envace_jax.envs.datasets.prepare({benchmark!r}, {str(config)!r}, {str(data_dir)!r}) first"
    )
  splits = list(b.info.splits)
  if split not in splits:
    raise EnvError(f"{benchmark} config {b.builder_config.name!r} has no split {split!r}; choose one of {splits}")
  return TaskSource(b.as_data_source(split), name=f"{benchmark}/{b.builder_config.name}/{split}")


# --- Resumable stream ---------------------------------------------------------------------------------------------


class TaskStream:
  """Endless batches of tasks, shuffled per epoch, resumable at an exact position.

  Epoch e is `np.random.default_rng([seed, e]).permutation(len(source))`, cut into `len(source) // batch_size`
  full batches; the last `len(source) % batch_size` tasks of each permutation are skipped (other ones each epoch), so
  no batch holds a task twice. Worked example, 5 tasks, batch_size 2: epoch 0 is [3, 0, 4, 1, 2] -> [3, 0], [4, 1]
  (2 skipped); epoch 1 is a new permutation. `position` counts the tasks handed out so far (a multiple of
  batch_size); a stream built with the same source, batch_size, seed and position returns the same batches from
  there on. Store `state()` in a checkpoint and resume with `TaskStream.from_state(source, state)`.

  Args:
    source: the tasks (a `TaskSource`, or any sequence of `Task`).
    batch_size: tasks per batch, 1 <= batch_size <= len(source).
    seed: a non-negative int.
    position: tasks already consumed (0 for a fresh stream), a multiple of batch_size.

  Raises:
    EnvError: empty source, batch_size out of range, negative seed, or a position that is not a multiple of
      batch_size.
  """

  def __init__(self, source: Sequence[Task], batch_size: int, seed: int, position: int = 0):
    n = len(source)
    if n == 0:
      raise EnvError(f"TaskStream needs at least one task; {getattr(source, 'name', '') or 'the source'} is empty")
    if not 1 <= batch_size <= n:
      raise EnvError(f"batch_size must be in [1, {n}] (the number of tasks), got {batch_size}")
    if seed < 0:
      raise EnvError(f"seed must be a non-negative int, got {seed}")
    if position < 0 or position % batch_size:
      raise EnvError(f"position must be a non-negative multiple of batch_size={batch_size}, got {position}")
    self._source = source
    self.batch_size = int(batch_size)
    self.seed = int(seed)
    self.position = int(position)
    self._perm_epoch = -1
    self._perm = np.zeros((0,), np.int64)

  @property
  def batches_per_epoch(self) -> int:
    return len(self._source) // self.batch_size

  @property
  def epoch(self) -> int:
    """The epoch the next batch comes from."""
    return self.position // (self.batches_per_epoch * self.batch_size)

  def permutation(self, epoch: int) -> np.ndarray:
    """int64[N]: the order of the source's tasks in `epoch` (a pure function of seed and epoch)."""
    if epoch != self._perm_epoch:
      self._perm = np.random.default_rng([self.seed, epoch]).permutation(len(self._source))
      self._perm_epoch = epoch
    return self._perm

  def next_indices(self) -> list[int]:
    """The source indices of the next batch; advances `position` by batch_size."""
    per_epoch = self.batches_per_epoch * self.batch_size
    epoch, offset = divmod(self.position, per_epoch)
    indices = self.permutation(epoch)[offset : offset + self.batch_size].tolist()
    self.position += self.batch_size
    return indices

  def next_batch(self) -> list[Task]:
    """The next `batch_size` tasks; advances `position`."""
    indices = self.next_indices()
    get_many = getattr(self._source, "get_many", None)
    return get_many(indices) if get_many is not None else [self._source[i] for i in indices]

  def __iter__(self) -> Iterator[list[Task]]:
    while True:
      yield self.next_batch()

  def state(self) -> dict[str, int]:
    """Plain ints for a checkpoint: seed, batch_size, position, and num_tasks (to catch a changed dataset)."""
    return {
      "seed": self.seed,
      "batch_size": self.batch_size,
      "position": self.position,
      "num_tasks": len(self._source),
    }

  @classmethod
  def from_state(cls, source: Sequence[Task], state: Mapping[str, Any]) -> TaskStream:
    """The stream `state()` described, over `source` (the same dataset it was saved with).

    Raises:
      EnvError: missing keys, or `source` has another number of tasks than the saved stream had.
    """
    missing = {"seed", "batch_size", "position", "num_tasks"} - set(state)
    if missing:
      raise EnvError(f"TaskStream state lacks {sorted(missing)}; got keys {sorted(state)}")
    if int(state["num_tasks"]) != len(source):
      raise EnvError(
        f"TaskStream state was saved over {int(state['num_tasks'])} tasks but the source has {len(source)}; "
        "resume with the dataset (benchmark, config, split, version) the run started with"
      )
    return cls(source, int(state["batch_size"]), int(state["seed"]), int(state["position"]))

  def __repr__(self) -> str:
    return f"TaskStream(batch_size={self.batch_size}, seed={self.seed}, position={self.position}, epoch={self.epoch})"
