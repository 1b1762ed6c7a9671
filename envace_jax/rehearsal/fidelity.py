"""World-model fidelity: how well the rehearsing role predicts the real tools.

During a committed execution every tool call runs for real. For each such call we also ask REHEARSE what it expects
the response to be — its view exactly as in a rehearsed rollout, with the conversation up to the call and the real
results of the earlier calls — and compare the prediction with the real response (`compare`):

  * ``json_valid``: the prediction is a well-formed rehearsed response (``<tool_response>`` + JSON, or "Error..."
    text when error text is accepted), as `views.parse_rehearsal` checks rollouts;
  * ``exact_match``: the two are equal as JSON values (``json.loads`` of each), or as stripped text when either is
    not JSON (error messages);
  * ``key_f1``: F1 between the sets of leaf paths of the two JSON values (``a.b``, ``a[0].c``; a scalar is the path
    ``$``); defined when the real response is JSON (a prediction that is not JSON scores 0);
  * ``value_accuracy``: over the leaf paths both have, the fraction with equal values; defined when they share one;
  * ``error_agreement``: both are errors or both are successes (real: the tool layer's ``is_error``; predicted: an
    "Error..." body).

`summarize` averages each over the pairs where it is defined. The predictions are greedy: the rehearsing role's most
likely response.

The same probe runs on the benchmark's gold calls (`gold_trajectories`), which measures the world model on the calls
that solve the task whatever the acting role does (a policy that never calls a tool leaves the committed-run
fidelity undefined).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from envace_jax import metrics
from envace_jax.envs import registry
from envace_jax.envs.base import ChatMessage, Task, ToolCall, ToolEnv, json_layout
from envace_jax.model import tool_format
from envace_jax.model.roles import Role
from envace_jax.model.tokenizer import Message, Tokenizer
from envace_jax.rehearsal import views
from envace_jax.rehearsal.completion import complete
from envace_jax.rehearsal.trajectory import Trajectory
from envace_jax.sampling.sampler import GREEDY

_MISSING = object()


@dataclasses.dataclass(frozen=True)
class ResponseFidelity:
  """One (rehearsed, real) response pair, compared (see the module docstring). None: not defined for this pair."""

  json_valid: bool
  exact_match: bool
  key_f1: float | None
  value_accuracy: float | None
  error_agreement: bool


def _json(text: str) -> Any:
  try:
    return json_layout(json.loads(text))
  except (ValueError, RecursionError):
    return _MISSING


def leaf_paths(value: Any, prefix: str = "$") -> dict[str, Any]:
  """The leaves of a JSON value by path: ``{"$.a.b": 1, "$.c[0]": "x"}``; an empty object or list is a leaf."""
  if isinstance(value, dict) and value:
    out = {}
    for k, v in value.items():
      out.update(leaf_paths(v, f"{prefix}.{k}"))
    return out
  if isinstance(value, list) and value:
    out = {}
    for i, v in enumerate(value):
      out.update(leaf_paths(v, f"{prefix}[{i}]"))
    return out
  return {prefix: value}


def compare(predicted: str, real_text: str, real_is_error: bool, accept_error_text: bool = True) -> ResponseFidelity:
  """Compares a REHEARSE generation (raw text, with its ``<tool_response>`` tags) with the real response.

  Args:
    predicted: the rehearsing role's output for the call.
    real_text: the real tool's response text (JSON, or the benchmark's error text).
    real_is_error: the real tool layer reported an error.
    accept_error_text: an "Error..." body is a valid prediction (as in rollouts).
  """
  parsed = views.parse_rehearsal(predicted, accept_error_text)
  body = parsed.content
  pred_json = _json(body) if parsed.valid and not parsed.is_error else _MISSING
  real_json = _json(real_text.strip())
  if pred_json is not _MISSING and real_json is not _MISSING:
    exact = pred_json == real_json
  else:
    exact = body.strip() == real_text.strip()
  key_f1 = value_acc = None
  if real_json is not _MISSING:
    real_leaves = leaf_paths(real_json)
    pred_leaves = leaf_paths(pred_json) if pred_json is not _MISSING else {}
    shared = set(real_leaves) & set(pred_leaves)
    if pred_leaves:
      precision, recall = len(shared) / len(pred_leaves), len(shared) / len(real_leaves)
      key_f1 = 2 * precision * recall / (precision + recall) if shared else 0.0
    else:
      key_f1 = 0.0
    if shared:
      value_acc = sum(pred_leaves[p] == real_leaves[p] for p in shared) / len(shared)
  return ResponseFidelity(
    json_valid=parsed.valid,
    exact_match=bool(exact),
    key_f1=key_f1,
    value_accuracy=value_acc,
    error_agreement=parsed.is_error == bool(real_is_error),
  )


def summarize(pairs: Sequence[ResponseFidelity], prefix: str = "fidelity/") -> dict[str, float]:
  """Means over the pairs where each measure is defined, and the counts: ``{prefix}json_valid``, ``exact_match``,
  ``key_f1``, ``value_accuracy``, ``error_agreement`` (NaN when never defined), ``calls``, ``key_f1_calls``,
  ``value_calls``; ``exact_match/lo``, ``/hi`` and ``key_f1/lo``, ``/hi``: 95% intervals over calls
  (`metrics.interval95`)."""
  out = {f"{prefix}calls": float(len(pairs))}
  for name in ("json_valid", "exact_match", "key_f1", "value_accuracy", "error_agreement"):
    values = [float(getattr(p, name)) for p in pairs if getattr(p, name) is not None]
    out[f"{prefix}{name}"] = float(np.mean(values)) if values else float("nan")
    if name in ("exact_match", "key_f1"):  # the headline measures: their 95% interval over calls
      out[f"{prefix}{name}/lo"], out[f"{prefix}{name}/hi"] = metrics.interval95(values)
  out[f"{prefix}key_f1_calls"] = float(sum(p.key_f1 is not None for p in pairs))
  out[f"{prefix}value_calls"] = float(sum(p.value_accuracy is not None for p in pairs))
  return out


@dataclasses.dataclass(frozen=True)
class Probe:
  """One real tool call of a committed trajectory and the REHEARSE view that predicts it.

  Attributes:
    trajectory: index of the trajectory.
    message: index of the real tool message in ``trajectory.messages``.
    view: the REHEARSE chat up to and including the call (system, dialogue, earlier calls with real results).
    real: the real tool message.
  """

  trajectory: int
  message: int
  view: tuple[Message, ...]
  real: ChatMessage


def probes(trajectories: Sequence[Trajectory], rehearse_prompt: str = views.REHEARSE_PROMPT, dialogue: bool = True):
  """Every tool call the agent made in ``trajectories`` and got a real answer to, with its REHEARSE view (no
  grounding: at test time the rehearsing role has only the tools and the conversation). Calls in the benchmark's
  logged initial conversation (τ² mock tasks have some) are context, not probed."""
  out = []
  for t, traj in enumerate(trajectories):
    system = Message("system", views.rehearse_system_prompt(traj.task, rehearse_prompt, ""))
    logged = len(registry.initial_conversation(traj.task))
    pending: list = []
    for i, m in enumerate(traj.messages):
      if m.role == "assistant":
        pending = list(m.tool_calls)
      elif m.role == "tool" and pending:
        call = next((c for c in pending if c.id and c.id == m.tool_call_id), pending[0])
        pending.remove(call)
        if i < logged:
          continue  # the benchmark's logged history: context, not a call of this run
        # The view before this result: the history with the earlier results (earlier answered calls of the same
        # message included), then the pending call.
        history = views.rehearse_history(traj.messages[:i], dialogue)
        out.append(Probe(t, i, (system, *history, views.rehearse_call(call.name, call.arguments)), m))
  return out


def gold_trajectories(
  openings: Sequence[tuple[Task, Sequence[ChatMessage]]], make_env: Callable[[Task], ToolEnv]
) -> list[Trajectory]:
  """The benchmark's gold calls as conversations to probe, each executed on a fresh real environment
  (``make_env(task)``, reset with the task) in the benchmark's order; a gold action the real tools refuse keeps its
  error response (``is_error``). Tasks without assistant-side gold actions are skipped.

  Per (task, opening):
  * a benchmark whose user turns are logged (``registry.Benchmark.logged_user_turns``: BFCL, the testbed) and that
    has reference conversations: that conversation (`registry.Benchmark.reference_conversation`), so each turn's gold
    calls come after that turn's user message, as in a rollout (the opening, the first user turn, is part of it);
  * otherwise (τ²: a simulated user): the task's logged initial conversation, the opening, then each gold action as
    one assistant tool call.

  Args:
    openings: (task, the messages after its initial conversation and before the agent's first decision), e.g. an
      evaluation's ``Prepared.task`` / ``Prepared.opening``; one per task.
    make_env: a fresh environment for a task.
  Returns:
    one `Trajectory` per task with gold actions (group = its index in ``openings``); `measure` probes every gold call.
  Raises:
    EnvError: a logged-user task's reference conversation cannot be played (``reference_conversation``).
  """
  out = []
  for group, (task, opening) in enumerate(openings):
    gold = [a for a in task.gold_actions if a.requestor == "assistant"]
    if not gold:
      continue
    env = make_env(task)
    benchmark = registry.get(task.benchmark)
    if benchmark.logged_user_turns and benchmark.demonstrations:
      messages = list(benchmark.reference_conversation(task, env))
    else:
      env.reset(task)
      messages = [*registry.initial_conversation(task), *opening]
      for i, action in enumerate(gold):
        call = ToolCall(action.name, dict(action.arguments), id=f"gold_{i}")
        messages += [ChatMessage("assistant", tool_calls=(call,)), env.answer(call)]
    out.append(Trajectory(task=task, group=group, sample=0, messages=messages))
  return out


def measure(
  sampler,
  tokenizer: Tokenizer,
  trajectories: Sequence[Trajectory],
  *,
  key: jax.Array,
  max_new_tokens: int = 256,
  rehearse_prompt: str = views.REHEARSE_PROMPT,
  dialogue: bool = True,
  accept_error_text: bool = True,
) -> tuple[list[ResponseFidelity], list[str], dict[str, float]]:
  """Asks REHEARSE (``sampler``, greedy) for every real tool response of ``trajectories`` and compares.

  Returns:
    (one `ResponseFidelity` per answered call, the predictions' raw texts, `completion.complete`'s stats).
  """
  found = probes(trajectories, rehearse_prompt, dialogue)
  if not found:
    return [], [], {"generated_tokens": 0.0, "prefill_tokens": 0.0, "seconds": 0.0}
  done, stats = complete(
    sampler,
    tokenizer,
    [list(p.view) for p in found],
    key=key,
    max_new_tokens=max_new_tokens,
    role=Role.REHEARSE,
    sampling=GREEDY,
    stop_strings=(tool_format.TOOL_RESPONSE_CLOSE,),
  )
  results = [
    compare(c.text, p.real.content, p.real.is_error, accept_error_text) for p, c in zip(found, done, strict=True)
  ]
  return results, [c.text for c in done], stats
