"""Checklist rewards for a trajectory: the rule checklist (offline default) and the paper's LLM checklist judge.

Both score a `Task` and a conversation (`base.ChatMessage`s) and return a `base.RewardInfo`; both are benchmark-free
(they read the task's fields, never a benchmark's code).

**Rule checklist** (`rule_checklist`): for rehearsed trajectories, which have no real DB to compare. Items: every
assistant-side gold action (matched by name and arguments, τ²'s comparison), every `communicate_info` string (τ²'s
substring rule) and one well-formedness item. The reward is the weighted fraction of items passed.

**LLM judge** (`ChecklistJudge`): the paper's reward (EnvACE, arXiv 2608.06197, following CM2's checklist rewards,
github.com/namezhenzhang/CM2-RLCR-Tool-Agent `verl/utils/reward_score/checklist_reward.py`): one chat-completions
request per checklist item and user turn, a JSON verdict back; a turn scores the weighted sum of its passed items, the
episode the mean over turns. A transport failure makes the trajectory invalid (`RewardInfo.valid=False`): excluded
from the update, never scored 0.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import httpx

from envace_jax.envs.base import ChatMessage, GoldAction, RewardInfo, Task, ToolCall

# ----------------------------------------------------------------------------------------------- rule checklist


class RewardConfigError(ValueError):
  """A reward configuration is invalid (negative weight, unknown mode, bad judge settings, missing API key)."""


@dataclasses.dataclass(frozen=True)
class RuleChecklistConfig:
  """Weights and matching rules of `rule_checklist`.

  Attributes:
    action_weight: weight of each gold-action item.
    communicate_weight: weight of each `communicate_info` item.
    well_formed_weight: weight of the well-formedness item.
    malformed_penalty: the well-formedness item scores max(0, 1 - malformed_penalty * malformed_outputs): 1.0 (the
      default) is binary (any malformed output fails it), 0.25 a graded variant that reaches 0 at four.
    arg_keys: which arguments a gold action without `compare_args` compares. "strict": all of them, on both sides
      (full equality). "tau2": exactly τ²'s rule, only the keys the *call* has, so a call that omits gold arguments
      (even a call with no arguments) still matches — exact parity with τ²'s ACTION check, but a reward a policy can
      exploit by leaving arguments out. Every τ² airline gold action states exactly the tool's required arguments,
      so "strict" fails only calls that τ² would accept while missing a required argument.
  """

  action_weight: float = 1.0
  communicate_weight: float = 1.0
  well_formed_weight: float = 1.0
  malformed_penalty: float = 1.0
  arg_keys: Literal["strict", "tau2"] = "strict"

  def __post_init__(self):
    for name in ("action_weight", "communicate_weight", "well_formed_weight", "malformed_penalty"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise RewardConfigError(f"RuleChecklistConfig.{name} must be a finite number >= 0, got {value!r}")
    if self.arg_keys not in ("strict", "tau2"):
      raise RewardConfigError(f"RuleChecklistConfig.arg_keys must be 'strict' or 'tau2', got {self.arg_keys!r}")


def _json_layout(value: Any) -> Any:
  """Mappings -> dicts, tuples -> lists (what JSON decoding produces); values themselves are not coerced."""
  if isinstance(value, Mapping):
    return {k: _json_layout(v) for k, v in value.items()}
  if isinstance(value, list | tuple):
    return [_json_layout(v) for v in value]
  return value


def action_matches(gold: GoldAction, call: ToolCall, arg_keys: Literal["strict", "tau2"] = "strict") -> bool:
  """Whether `call` satisfies `gold`, compared as τ²-bench compares them.

  Mirrors `tau2.data_model.tasks.Action.compare_with_tool_call` (used by `tau2/evaluator/evaluator_action.py`,
  `ActionEvaluator.evaluate_actions`): names must be equal; the compared keys are `gold.compare_args` when given,
  otherwise the call's own keys ("tau2") or the union of both sides' keys ("strict", see `RuleChecklistConfig`);
  no keys to compare -> match; otherwise the two argument dicts restricted to those keys must be equal under
  Python `==` of the decoded JSON values. That is all the normalisation τ² does: 1 == 1.0 and True == 1 match, while
  "1" != 1, "ABC" != "abc", list order matters and dict key order does not. A key missing on one side makes the
  restricted dicts differ. The only addition here is `_json_layout` (tuples -> lists, mappings -> dicts), so a
  `Mapping` or tuple built in Python compares as its JSON would.

  Args:
    gold: the gold action (its `requestor` is not looked at, as in τ²).
    call: the predicted call.
    arg_keys: "strict" or "tau2".
  """
  if gold.name != call.name:
    return False
  call_args, gold_args = _json_layout(call.arguments), _json_layout(gold.arguments)
  if gold.compare_args is not None:
    keys = set(gold.compare_args)
  elif arg_keys == "tau2":
    keys = set(call_args)
  else:
    keys = set(call_args) | set(gold_args)
  if not keys:
    return True
  return {k: v for k, v in call_args.items() if k in keys} == {k: v for k, v in gold_args.items() if k in keys}


_THINK_RE = re.compile(r"<think>.*?</think>", re.DOTALL)


def visible_text(content: str) -> str:
  """An assistant message's user-visible text: the content without `<think>...</think>` blocks."""
  return _THINK_RE.sub("", content)


def info_communicated(info: str, conversation: Sequence[ChatMessage]) -> bool:
  """Whether an assistant message told the user `info`, by τ²-bench's rule.

  Mirrors `tau2/evaluator/evaluator_communicate.py`, `CommunicateEvaluator.evaluate_communicate_info`: only assistant
  messages with non-blank text count, and the test is `info.lower() in content.lower().replace(",", "")` — commas are
  removed from the message but not from `info` (so "1000" matches "$1,000", and an info containing a comma never
  matches). One addition: `<think>` blocks are removed first, since private reasoning is not told to the user.
  """
  needle = info.lower()
  for message in conversation:
    if message.role != "assistant":
      continue
    text = visible_text(message.content)
    if text.strip() and needle in text.lower().replace(",", ""):
      return True
  return False


def match_gold_actions(
  golds: Sequence[GoldAction], calls: Sequence[ToolCall], arg_keys: Literal["strict", "tau2"] = "strict"
) -> list[int | None]:
  """One-to-one matching of gold actions to calls: for each gold action, the index of its call (None: unmatched).

  Each call satisfies at most one gold action and each gold action is matched at most once, so calling a tool twice
  does not pass one gold action twice, and two equal gold actions need two calls (τ² itself lets one call satisfy
  any number of gold actions). The rule: gold actions in order each take the earliest free call that matches
  (greedy); only when none is free may an earlier gold action be moved to another free call it also matches to make
  room (Kuhn's augmenting paths). The result is a largest possible matching, and equals plain greedy-in-order
  whenever greedy already finds one, which is the case unless candidate sets overlap (e.g. `compare_args` subsets).
  """
  ok = [[action_matches(g, c, arg_keys) for c in calls] for g in golds]
  owner: list[int | None] = [None] * len(calls)  # call -> gold

  def assign(g: int, seen: set[int]) -> bool:
    candidates = [c for c in range(len(calls)) if ok[g][c] and c not in seen]
    for c in sorted(candidates, key=lambda c: (owner[c] is not None, c)):  # free calls first, then in order
      seen.add(c)
      if owner[c] is None or assign(owner[c], seen):
        owner[c] = g
        return True
    return False

  for g in range(len(golds)):
    assign(g, set())
  result: list[int | None] = [None] * len(golds)
  for c, g in enumerate(owner):
    if g is not None:
      result[g] = c
  return result


def rule_checklist(
  task: Task,
  conversation: Sequence[ChatMessage],
  malformed_outputs: int = 0,
  config: RuleChecklistConfig | None = None,
) -> RewardInfo:
  """The offline checklist reward: weighted fraction of the task's rule items that the conversation passes.

  Items (breakdown keys): `action[i]:<name>` for each assistant-side gold action (user-side ones, e.g. τ² telecom's,
  are the user simulator's to take and are skipped), passed when `match_gold_actions` pairs it with one of the
  assistant's tool calls (`action_matches`, τ²'s comparison); `communicate[i]` for each `task.communicate_info`
  string (`info_communicated`, τ²'s rule); `well_formed`, scoring max(0, 1 - malformed_penalty * malformed_outputs).
  Each item weighs its kind's weight; reward = sum(weight * score) / sum(weight). Group keys `action` and
  `communicate` give each group's fraction passed. A task with no gold actions and no communicate_info is scored
  by well-formedness alone; if every item weighs 0, the reward is 1.0 (nothing to check, as τ²'s evaluators score a
  task without criteria). Checklist items in `task.criteria["checklists"]` need the LLM judge and are not scored
  here (their count is in `info["unscored_checklist_items"]`).

  Args:
    task: the task (gold_actions, communicate_info).
    conversation: the trajectory's messages.
    malformed_outputs: how many generations of the trajectory could not be parsed (recorded during the rollout).
    config: weights and matching rules; default `RuleChecklistConfig()`.

  Returns:
    RewardInfo with reward in [0, 1], per-item and per-group breakdown, and the matched call per action item in
    `info["matched_calls"]` (index into the assistant's tool calls, in conversation order).

  Raises:
    ValueError: `malformed_outputs` is negative.
  """
  config = config or RuleChecklistConfig()
  if malformed_outputs < 0:
    raise ValueError(f"malformed_outputs must be >= 0, got {malformed_outputs}")
  calls = [c for m in conversation if m.role == "assistant" for c in m.tool_calls]
  golds = [g for g in task.gold_actions if g.requestor == "assistant"]
  matched = match_gold_actions(golds, calls, config.arg_keys)

  items: list[tuple[str, float, float]] = []  # (key, weight, score)
  breakdown: dict[str, float] = {}
  action_keys = [f"action[{i}]:{g.name}" for i, g in enumerate(golds)]
  for key, m in zip(action_keys, matched, strict=True):
    items.append((key, config.action_weight, float(m is not None)))
  communicate = [float(info_communicated(info, conversation)) for info in task.communicate_info]
  for i, score in enumerate(communicate):
    items.append((f"communicate[{i}]", config.communicate_weight, score))
  items.append(("well_formed", config.well_formed_weight, max(0.0, 1.0 - config.malformed_penalty * malformed_outputs)))

  for key, _, score in items:
    breakdown[key] = score
  if golds:
    breakdown["action"] = sum(m is not None for m in matched) / len(golds)
  if communicate:
    breakdown["communicate"] = sum(communicate) / len(communicate)
  total = math.fsum(w for _, w, _ in items)
  reward = math.fsum(w * s for _, w, s in items) / total if total > 0 else 1.0
  checklists = task.criteria.get("checklists") or []
  info: dict[str, Any] = {
    "matched_calls": {k: m for k, m in zip(action_keys, matched, strict=True) if m is not None},
    "tool_calls": len(calls),
    "malformed_outputs": malformed_outputs,
    "user_actions_skipped": len(task.gold_actions) - len(golds),
    "unscored_checklist_items": sum(len(turn) for annotation in checklists[:1] for turn in annotation),
  }
  if total <= 0:
    info["note"] = "every item weighs 0: nothing to check, reward 1.0"
  return RewardInfo(reward=reward, breakdown=breakdown, info=info)


# ----------------------------------------------------------------------------------------------- LLM judge


class JudgeTransportError(RuntimeError):
  """The judge endpoint could not be reached or kept failing (connection, timeout, HTTP 408/409/429/5xx)."""


@dataclasses.dataclass(frozen=True)
class JudgeConfig:
  """An OpenAI-compatible chat-completions endpoint and how `ChecklistJudge` uses it.

  Attributes:
    base_url: the API root; requests go to `{base_url}/chat/completions` (e.g. "http://127.0.0.1:30000/v1").
    model: the model name sent with each request.
    api_key_env: name of the environment variable holding the API key ("" sends no Authorization header).
    timeout_s: per-request timeout (connect, read, write), seconds.
    max_retries: further attempts after the first, for transport failures and unparseable verdicts alike.
    backoff_s: sleep before retry r (r = 0, 1, ...) is min(backoff_max_s, backoff_s * 2**r).
    backoff_max_s: cap on one backoff sleep.
    temperature: sampling temperature of the judge.
    max_tokens: completion budget of one verdict.
    max_concurrency: requests in flight at once.
    max_annotations: how many of a record's independent annotations to judge (their rewards are averaged).
    max_history_chars: previous turns in a prompt are cut to their last this-many characters.
    max_turn_chars: the judged turn is cut in the middle to this many characters.
    extra_body: merged into each request body (e.g. {"chat_template_kwargs": {"enable_thinking": False}}).
  """

  base_url: str = ""
  model: str = ""
  api_key_env: str = ""
  timeout_s: float = 60.0
  max_retries: int = 3
  backoff_s: float = 1.0
  backoff_max_s: float = 30.0
  temperature: float = 0.0
  max_tokens: int = 1024
  max_concurrency: int = 8
  max_annotations: int = 1
  max_history_chars: int = 20_000
  max_turn_chars: int = 40_000
  extra_body: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    positive = {"timeout_s": self.timeout_s, "max_tokens": self.max_tokens, "max_concurrency": self.max_concurrency}
    positive |= {"max_annotations": self.max_annotations, "max_history_chars": self.max_history_chars}
    positive["max_turn_chars"] = self.max_turn_chars
    for name, value in positive.items():
      if not value > 0:
        raise RewardConfigError(f"JudgeConfig.{name} must be > 0, got {value!r}")
    for name in ("max_retries", "backoff_s", "backoff_max_s", "temperature"):
      if not getattr(self, name) >= 0:
        raise RewardConfigError(f"JudgeConfig.{name} must be >= 0, got {getattr(self, name)!r}")

  def url(self) -> str:
    return self.base_url.rstrip("/") + "/chat/completions"


@dataclasses.dataclass(frozen=True)
class Verdict:
  """One judged item. `passed` is None for a judge failure (no usable verdict); `error` then says why."""

  passed: bool | None
  analysis: str = ""
  error: str = ""


class _Retryable(Exception):
  pass


class _Refused(Exception):
  pass


_FENCE_RE = re.compile(r"```(?:\s*json)?\s*(.*?)\s*```", re.IGNORECASE | re.DOTALL)


def parse_verdict(text: str) -> tuple[bool, str] | None:
  """(answer, analysis) from a judge reply, or None when there is no usable verdict.

  Accepts the JSON object bare, inside ```json fences (the last fenced block wins), or embedded in prose (first "{"
  to last "}"), after removing `<think>` blocks. `answer` must be a boolean or "true"/"false"; CM2's older `result`
  key is read when `answer` is absent.
  """
  text = _THINK_RE.sub("", text or "").strip()
  candidates = _FENCE_RE.findall(text)[::-1] + [text]
  if "{" in text:
    candidates.append(text[text.index("{") : text.rindex("}") + 1])
  for candidate in candidates:
    try:
      data = json.loads(candidate)
    except (json.JSONDecodeError, ValueError):
      continue
    if not isinstance(data, dict):
      continue
    answer = data.get("answer", data.get("result"))
    if isinstance(answer, str) and answer.strip().lower() in ("true", "false"):
      answer = answer.strip().lower() == "true"
    if isinstance(answer, bool):
      analysis = data.get("analysis", "")
      return answer, analysis if isinstance(analysis, str) else json.dumps(analysis)
  return None


def split_thinking(content: str) -> tuple[str, str]:
  """(private thinking, user-visible reply) of an assistant message: the reply is what follows `</think>`."""
  if "</think>" in content:
    head, _, reply = content.rpartition("</think>")
    return head.replace("<think>", "").strip(), reply.strip()
  return "", content.strip()


def render_messages(messages: Sequence[ChatMessage], first_turn: int = 0) -> str:
  """Messages as the judge reads them, in CM2's turn / step layout (step 0 is the user message of a turn)."""
  lines, turn, step = [], first_turn - 1, 0
  for m in messages:
    if m.role == "system":
      lines.append(f"[system]\n{m.content}")
    elif m.role == "user":
      turn, step = turn + 1, 0
      lines.append(f"## Turn {turn}\n[step 0] user:\n{m.content}")
    elif m.role == "assistant":
      step += 1
      thinking, reply = split_thinking(m.content)
      calls = json.dumps([{"name": c.name, "arguments": dict(c.arguments)} for c in m.tool_calls], ensure_ascii=False)
      lines.append(
        f"[step {step}] assistant:\n  thinking: {thinking or 'None'}\n  user_visible_reply: {reply or 'None'}\n"
        f"  tool_calls: {calls}"
      )
    else:
      step += 1
      name = f" {m.name}" if m.name else ""
      status = " (error)" if m.is_error else ""
      lines.append(f"[step {step}] tool{name}{status}:\n{m.content}")
  return "\n".join(lines)


def _clip(text: str, limit: int, keep: Literal["tail", "middle"]) -> str:
  if len(text) <= limit:
    return text
  marker = "\n[... truncated ...]\n"
  if keep == "tail":
    return marker + text[len(text) - limit :]
  half = limit // 2
  return text[:half] + marker + text[len(text) - half :]


def judge_prompt(item: Mapping[str, Any], history: str, current: str) -> str:
  """The request for one checklist item (normalised layout of `envs/checklist.py`) on one turn.

  Modelled on CM2's judge prompt (`get_input_prompt_v2` in `checklist_reward.py`): the item's question, focus,
  pass condition, failure examples and reference evidence, the earlier turns as context, the judged turn, and a
  strict JSON verdict.
  """
  failures = "\n".join(f"- {x}" for x in item.get("failure_examples") or ()) or "- (none given)"
  evidence = "\n".join(f"- [{e.get('from', '')}] {e.get('snippet', '')}" for e in item.get("evidence") or ())
  return (
    "# Role\nYou are a strict checklist judge. Decide whether the conversation satisfies ONE checklist item.\n\n"
    "# Checklist item\n"
    f"Question: {item['question']}\n"
    f"Focus on: {item.get('focus_on') or 'the whole turn'}\n"
    f"Pass condition: {item['pass_condition']}\n"
    f"Failure examples (any one of them means the item fails):\n{failures}\n"
    "Reference evidence from an annotated reference conversation (orientation only; the assistant need not match it "
    f"word for word):\n{evidence or '- (none given)'}\n\n"
    f"# Previous turns (context only)\n{history or '(none)'}\n\n"
    f"# Current turn (judge this)\n{current}\n\n"
    "# Rules\n"
    "- Judge the current turn; earlier turns are context.\n"
    "- Only calls in the tool_calls field are tool calls; a call written in thinking or reply text is not one.\n"
    "- A tool call answered by an error did not succeed.\n"
    "- answer is true only if the focus part is present, the pass condition is fully met and no failure example "
    "applies.\n\n"
    '# Output\nReturn only one JSON object: {"analysis": "<brief reasoning>", "answer": true or false}'
  )


def derived_checklist(task: Task) -> list[dict[str, Any]]:
  """Judge items for a task without annotated checklists (e.g. τ²), one turn covering the whole conversation.

  Items, equally weighted: each assistant-side gold action (restricted to `compare_args`), each `communicate_info`
  string, and each natural-language assertion of τ²'s `nl_assertions`, read from
  `task.criteria["evaluation_criteria"]["nl_assertions"]` (where `envs/tau2.py` keeps τ²'s evaluation criteria) or
  `task.criteria["nl_assertions"]`.
  """
  items = []
  for i, g in enumerate(a for a in task.gold_actions if a.requestor == "assistant"):
    args = {k: v for k, v in g.arguments.items() if g.compare_args is None or k in g.compare_args}
    shown = json.dumps(args, ensure_ascii=False, sort_keys=True)
    items.append(
      {
        "id": f"action[{i}]:{g.name}",
        "question": f"Did the assistant call {g.name} with arguments {shown}?",
        "focus_on": "assistant.tool_calls",
        "pass_condition": f"There is an assistant tool call named {g.name} whose arguments equal {shown}.",
        "failure_examples": ["No such tool call", "A different argument value"],
      }
    )
  for i, info in enumerate(task.communicate_info):
    items.append(
      {
        "id": f"communicate[{i}]",
        "question": f"Did the assistant tell the user: {info!r}?",
        "focus_on": "assistant.content.user_visible_reply",
        "pass_condition": f"A user-visible reply states {info!r}.",
        "failure_examples": ["The information only appears in private thinking or not at all"],
      }
    )
  tau2_criteria = task.criteria.get("evaluation_criteria") or {}
  assertions = task.criteria.get("nl_assertions") or tau2_criteria.get("nl_assertions") or ()
  for i, assertion in enumerate(assertions):
    question = f"Is this true of the conversation: {assertion}"
    items.append({"id": f"assertion[{i}]", "question": question, "focus_on": "", "pass_condition": str(assertion)})
  for item in items:
    item.update(evidence=[], weight=1.0 / len(items))
  return items


def split_turns(conversation: Sequence[ChatMessage]) -> tuple[list[ChatMessage], list[list[ChatMessage]]]:
  """(messages before the first user message, [each user message with everything up to the next one])."""
  preamble: list[ChatMessage] = []
  turns: list[list[ChatMessage]] = []
  for m in conversation:
    if m.role == "user":
      turns.append([m])
    elif turns:
      turns[-1].append(m)
    else:
      preamble.append(m)
  return preamble, turns


class ChecklistJudge:
  """The paper's checklist reward: an LLM judges each checklist item of each user turn.

  For checklist-format tasks (`task.criteria["checklists"]`, see `envs/checklist.py`) the k-th turn's items are
  judged on the k-th user turn of the conversation, with the earlier turns as context; a turn the trajectory never
  reached scores 0 without a request. Other tasks get `derived_checklist`, one turn over the whole conversation.
  A turn's reward is the weighted sum of its passed items; an annotation's reward the mean over its turns; with
  several annotations (`max_annotations`), the mean over annotations.

  Failures: a reply without a usable verdict after all retries is a *judge failure*: the item counts as not passed
  and is listed in `info["judge_failures"]`; so is a request the server refuses as bad (HTTP 400/413/422: the
  prompt, not the server, is at fault). A transport failure (connection refused, timeout, HTTP 408/409/429/5xx
  after all retries) makes the whole trajectory invalid: `RewardInfo(reward=nan, valid=False)`, so it cannot be
  mistaken for a 0. HTTP 3xx/401/403/404 raise `RewardConfigError`: retrying cannot fix a wrong URL, model or key.

  Usable as a `ChecklistEnv` scorer: `judge(task, conversation) -> RewardInfo`. Thread-safe (trajectories may be
  scored from several threads at once); close it (or use it as a context manager) to release connections and threads.

  Args:
    config: endpoint and behaviour.

  Raises:
    RewardConfigError: no base_url or model, a base_url that is not http(s), or `api_key_env` names an unset
      variable.
  """

  def __init__(self, config: JudgeConfig):
    if not config.base_url or not config.model:
      raise RewardConfigError(
        "the LLM judge is not configured: JudgeConfig needs base_url (an OpenAI-compatible API root, e.g. "
        "'http://127.0.0.1:30000/v1') and model; or score with rule_checklist instead"
      )
    if not config.base_url.startswith(("http://", "https://")):
      raise RewardConfigError(f"JudgeConfig.base_url must start with http:// or https://, got {config.base_url!r}")
    headers = {}
    if config.api_key_env:
      key = os.environ.get(config.api_key_env)
      if not key:
        raise RewardConfigError(f"JudgeConfig.api_key_env names {config.api_key_env!r}, which is not set")
      headers["Authorization"] = f"Bearer {key}"
    self.config = config
    limits = httpx.Limits(max_connections=config.max_concurrency, max_keepalive_connections=config.max_concurrency)
    self._client = httpx.Client(headers=headers, timeout=httpx.Timeout(config.timeout_s), limits=limits)
    self._pool = concurrent.futures.ThreadPoolExecutor(config.max_concurrency, thread_name_prefix="judge")

  def close(self) -> None:
    self._pool.shutdown(wait=True, cancel_futures=True)
    self._client.close()

  def __enter__(self) -> ChecklistJudge:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _post(self, prompt: str) -> str | None:
    """One request: the reply text, None for a 200 without a chat-completions body."""
    payload = {
      "model": self.config.model,
      "messages": [{"role": "user", "content": prompt}],
      "temperature": self.config.temperature,
      "max_tokens": self.config.max_tokens,
      **self.config.extra_body,
    }
    url = self.config.url()
    try:
      response = self._client.post(url, json=payload)
    except httpx.TransportError as e:
      raise _Retryable(f"{type(e).__name__}: {e}") from e
    code = response.status_code
    if code in (401, 403, 404) or 300 <= code < 400:
      raise RewardConfigError(
        f"judge endpoint {url} answered HTTP {code} ({response.text[:200]!r}); check base_url, model and the API key"
      )
    if code in (408, 409, 429) or code >= 500:
      raise _Retryable(f"HTTP {code} from {url}")
    if code >= 400:
      raise _Refused(f"HTTP {code} from {url}: {response.text[:200]!r}")
    try:
      content = response.json()["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
      return None
    return content if isinstance(content, str) else None

  def judge(self, prompt: str, stop: threading.Event | None = None) -> Verdict:
    """Sends one judge prompt, retrying with exponential backoff.

    Args:
      prompt: the full prompt (`judge_prompt`).
      stop: when set (another request of the trajectory failed), gives up before the next attempt.

    Returns:
      The verdict, or a judge failure (`passed=None`) for unparseable replies after all attempts or a refused request.

    Raises:
      JudgeTransportError: the last attempt failed in transport (see the class docstring).
      RewardConfigError: HTTP 3xx/401/403/404.
    """
    cfg = self.config
    last = ""
    stop = stop or threading.Event()
    for attempt in range(cfg.max_retries + 1):
      if attempt:
        stop.wait(min(cfg.backoff_max_s, cfg.backoff_s * 2 ** (attempt - 1)))
      if stop.is_set():
        raise JudgeTransportError("cancelled: another request of this trajectory failed")
      try:
        text = self._post(prompt)
      except _Retryable as e:
        last = f"transport: {e}"
        continue
      except _Refused as e:
        return Verdict(None, error=f"request refused: {e}")
      parsed = parse_verdict(text) if text is not None else None
      if parsed is not None:
        return Verdict(parsed[0], parsed[1])
      last = f"no usable verdict in reply: {(text or '<no chat-completions content>')[:200]!r}"
    if last.startswith("transport"):
      raise JudgeTransportError(f"{last} (after {cfg.max_retries + 1} attempts)")
    return Verdict(None, error=f"{last} (after {cfg.max_retries + 1} attempts)")

  def __call__(self, task: Task, conversation: Sequence[ChatMessage]) -> RewardInfo:
    return self.score(task, conversation)

  def score(self, task: Task, conversation: Sequence[ChatMessage]) -> RewardInfo:
    """Judges `conversation` on `task`'s checklists (see the class docstring).

    Raises:
      RewardConfigError: the endpoint rejects the configuration (HTTP 3xx/401/403/404).
    """
    cfg = self.config
    preamble, turns = split_turns(conversation)
    annotations = task.criteria.get("checklists") or []
    if annotations:
      annotations = annotations[: cfg.max_annotations]
      segments, before = [], list(preamble)
      for t, turn in enumerate(turns):
        segments.append((render_messages(before, 0), render_messages(turn, t)))
        before += turn
    else:
      derived = derived_checklist(task)
      annotations = [[derived]] if derived else []
      segments = [("", render_messages(conversation, 0))]
    if not annotations:
      return RewardInfo(1.0, info={"note": "no checklist items: nothing to judge"})

    prefix = (lambda a: f"annotation[{a}]/") if len(annotations) > 1 else (lambda a: "")
    jobs: dict[str, concurrent.futures.Future[Verdict]] = {}
    unreached: list[str] = []
    stop = threading.Event()
    for a, annotation in enumerate(annotations):
      for t, items in enumerate(annotation):
        if t >= len(segments):
          unreached.append(f"{prefix(a)}turn[{t}]")
          continue
        history = _clip(segments[t][0], cfg.max_history_chars, "tail")
        current = _clip(segments[t][1], cfg.max_turn_chars, "middle")
        for item in items:
          prompt = judge_prompt(item, history, current)
          jobs[f"{prefix(a)}turn[{t}]/{item['id']}"] = self._pool.submit(self.judge, prompt, stop)
    verdicts: dict[str, Verdict] = {}
    keys = {future: key for key, future in jobs.items()}
    try:
      for future in concurrent.futures.as_completed(keys):  # the first failure stops the rest
        verdicts[keys[future]] = future.result()
    except (JudgeTransportError, RewardConfigError) as e:
      stop.set()
      for future in jobs.values():
        future.cancel()
      concurrent.futures.wait(jobs.values())
      if isinstance(e, RewardConfigError):
        raise
      return RewardInfo(math.nan, valid=False, info={"error": f"judge transport failure: {e}", "requests": len(jobs)})

    breakdown: dict[str, float] = {}
    annotation_rewards = []
    for a, annotation in enumerate(annotations):
      turn_scores = []
      for t, items in enumerate(annotation):
        score = 0.0
        for item in items:
          key = f"{prefix(a)}turn[{t}]/{item['id']}"
          passed = bool(verdicts[key].passed) if key in verdicts else False
          breakdown[key] = float(passed)
          score += item["weight"] * passed
        breakdown[f"{prefix(a)}turn[{t}]"] = score
        turn_scores.append(score)
      annotation_rewards.append(math.fsum(turn_scores) / len(turn_scores))
    reward = min(1.0, max(0.0, math.fsum(annotation_rewards) / len(annotation_rewards)))
    info = {
      "requests": len(jobs),
      "judge_failures": {k: v.error for k, v in verdicts.items() if v.passed is None},
      "unreached_turns": unreached,
      "analysis": {k: v.analysis for k, v in verdicts.items() if v.passed is not None},
    }
    return RewardInfo(reward=reward, breakdown=breakdown, info=info)
