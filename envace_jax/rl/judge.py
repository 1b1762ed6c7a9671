"""The paper's LLM checklist judge over an OpenAI-compatible chat-completions endpoint.

EnvACE (arXiv 2608.06197), following CM2's checklist rewards (github.com/namezhenzhang/CM2-RLCR-Tool-Agent
`verl/utils/reward_score/checklist_reward.py`) and the official EnvACE code (Within-yao/EnvACE,
`agent_system/environments/env_package/checklist/interaction.py`, `checklist_reward.py`, `envs.py`): one request per
checklist item and assistant step (or turn), a JSON verdict back (`ChecklistJudge`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import pathlib
import re
import string
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import httpx

from envace_jax.config import defaults
from envace_jax.config.choices import JUDGE_GRANULARITIES, JUDGE_SCHEMAS, JUDGE_TRANSCRIPTS, UNFINISHED_TURNS
from envace_jax.envs.base import ChatMessage, RewardInfo, Task
from envace_jax.model import sanitize
from envace_jax.rl.rewards import _THINK_RE, RewardConfigError


class JudgeTransportError(RuntimeError):
  """The judge endpoint could not be reached or kept failing (connection, timeout, HTTP 408/409/429/5xx)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class JudgeConfig:
  """An OpenAI-compatible chat-completions endpoint and how `ChecklistJudge` uses it.

  The run settings (``config.reward.judge_*``, ``unfinished_turn``; no defaults here: `from_config` reads them) are
  each explained once in ``envace_jax/config/defaults.py``; the rest are fixed by the client.

  Attributes:
    base_url: the API root; requests go to `{base_url}/chat/completions` (e.g. "http://127.0.0.1:30000/v1").
    model: the model name sent with each request.
    api_key_env: name of the environment variable holding the API key ("" sends no Authorization header).
    timeout_s: per-request timeout (connect, read, write), seconds.
    max_retries: further attempts after the first, for transport failures and unparseable verdicts alike.
    temperature, top_p, max_tokens: the judge's sampling and completion budget, per request.
    schema: "official" (four-field verdict, sent as a json_schema response_format too) or "analysis".
    granularity: "step" or "turn" (annotated tasks; see `ChecklistJudge`).
    unfinished_turn: "zero" or "judge" (a logged turn cut off by the trajectory's end).
    transcript: how messages are written into a prompt: "ours" (`render_messages`) or "official" (`render_official`).
    prompt_file: a judge prompt template (`PROMPT_FIELDS`), "" for ours (`judge_prompt`).
    backoff_s: sleep before retry r (r = 0, 1, ...) is min(backoff_max_s, backoff_s * 2**r).
    backoff_max_s: cap on one backoff sleep.
    max_concurrency: requests in flight at once.
    max_annotations: how many of a record's independent annotations to judge (their rewards are averaged).
    max_history_chars: previous turns in a prompt are cut to their last this-many characters.
    max_turn_chars: the judged turn is cut in the middle to this many characters.
    extra_body: merged into each request body (e.g. {"chat_template_kwargs": {"enable_thinking": False}}).
  """

  base_url: str
  model: str
  api_key_env: str
  timeout_s: float
  max_retries: int
  temperature: float
  top_p: float
  max_tokens: int
  schema: str
  granularity: str
  unfinished_turn: str
  transcript: str
  prompt_file: str
  backoff_s: float = 1.0
  backoff_max_s: float = 30.0
  max_concurrency: int = 8
  max_annotations: int = 1
  max_history_chars: int = 20_000
  max_turn_chars: int = 40_000
  extra_body: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  @classmethod
  def from_config(cls, config=None, **overrides) -> JudgeConfig:
    """``config.reward``'s judge settings, then ``overrides`` (field: value); config None: the defaults.

    Raises:
      RewardConfigError: an invalid value.
    """
    r = defaults.or_defaults(config).reward
    fields = {
      "base_url": r.judge_url,
      "model": r.judge_model,
      "api_key_env": r.judge_api_key_env,
      "timeout_s": r.judge_timeout_s,
      "max_retries": r.judge_max_retries,
      "temperature": r.judge_temperature,
      "top_p": r.judge_top_p,
      "max_tokens": r.judge_max_tokens,
      "schema": r.judge_schema,
      "granularity": r.judge_granularity,
      "unfinished_turn": r.unfinished_turn,
      "transcript": r.judge_transcript,
      "prompt_file": r.judge_prompt_file,
    }
    return cls(**{**fields, **overrides})

  def __post_init__(self):
    positive = {"timeout_s": self.timeout_s, "max_tokens": self.max_tokens, "max_concurrency": self.max_concurrency}
    positive |= {"max_annotations": self.max_annotations, "max_history_chars": self.max_history_chars}
    positive |= {"max_turn_chars": self.max_turn_chars, "top_p": self.top_p}
    for name, value in positive.items():
      if not value > 0:
        raise RewardConfigError(f"JudgeConfig.{name} must be > 0, got {value!r}")
    for name in ("max_retries", "backoff_s", "backoff_max_s", "temperature"):
      if not getattr(self, name) >= 0:
        raise RewardConfigError(f"JudgeConfig.{name} must be >= 0, got {getattr(self, name)!r}")
    if self.top_p > 1:
      raise RewardConfigError(f"JudgeConfig.top_p must be <= 1, got {self.top_p!r}")
    valid = {"schema": JUDGE_SCHEMAS, "granularity": JUDGE_GRANULARITIES, "unfinished_turn": UNFINISHED_TURNS}
    valid["transcript"] = JUDGE_TRANSCRIPTS
    for name, choices in valid.items():
      if getattr(self, name) not in choices:
        raise RewardConfigError(f"JudgeConfig.{name}={getattr(self, name)!r}; valid: {', '.join(choices)}")

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


OFFICIAL_FIELDS = (
  "high_level_understanding_of_the_question",
  "analysis_of_if_focus_on",
  "analysis_of_pass_condition",
  "analysis_of_failure_examples",
  "answer",
)
"""The official verdict's fields, in order (`checklist_reward.py`, `eval_one_check`): four strings, then a boolean."""


def response_format() -> dict[str, Any]:
  """The ``response_format`` of a request with ``schema="official"``: a strict json_schema of `OFFICIAL_FIELDS`
  (four strings and a boolean, all required, nothing else), as the official `eval_one_check` sends it."""
  properties = {name: {"type": "string"} for name in OFFICIAL_FIELDS[:-1]} | {"answer": {"type": "boolean"}}
  schema = {
    "type": "object",
    "properties": properties,
    "required": list(OFFICIAL_FIELDS),
    "additionalProperties": False,
  }
  return {"type": "json_schema", "json_schema": {"name": "evaluation_verdict", "strict": True, "schema": schema}}


_FENCE_RE = re.compile(r"```(?:\s*json)?\s*(.*?)\s*```", re.IGNORECASE | re.DOTALL)


def parse_verdict(text: str) -> tuple[bool, str] | None:
  """(answer, analysis) from a judge reply, or None when there is no usable verdict.

  Accepts the JSON object bare, inside ```json fences (the last fenced block wins), or embedded in prose (first "{"
  to last "}"), after removing `<think>` blocks. `answer` must be a boolean or "true"/"false"; CM2's older `result`
  key is read when `answer` is absent. The analysis is the "analysis" field, or the official verdict's four analyses
  (`OFFICIAL_FIELDS`) joined by newlines.
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
      if "analysis" not in data:  # the official four-field verdict: its analyses, in order
        analysis = "\n".join(str(data[k]) for k in OFFICIAL_FIELDS[:-1] if k in data)
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


_THINK_BLOCK_RE = re.compile(r"<think>(.*?)</think>", re.DOTALL)


def render_official(messages: Sequence[ChatMessage]) -> str:
  """Messages in the official judge's transcript layout (``transcript="official"``; the official `checklist_reward.py`,
  `get_messages_str_v2`): turns numbered from 0 in ``messages`` itself ("# Turn: k"), assistant steps from 0 within a
  turn ("## Step: s"), each message as "Role: ..." and "content..." lines. An assistant message's thinking is its first
  ``<think>`` block and its reply what follows that block ("None" when empty); a message without a ``<think>`` block
  is all thinking and its reply "None". Its calls are the OpenAI ``tool_calls`` list as JSON (arguments a JSON
  string), or "None"; a reply holding ``<tool_call>`` tags without parsed calls is shown as the calls, the tags
  renamed, and the reply as "None".
  """
  out, turn, step = [], -1, 0
  for m in messages:
    if m.role == "system":
      out.append(f"Role: system\ncontent: {m.content}\n")
      step = 0
    elif m.role == "user":
      turn, step = turn + 1, 0
      out.append(f"# Turn: {turn}\nRole: user\ncontent: {m.content}\n")
    elif m.role == "assistant":
      found = _THINK_BLOCK_RE.search(m.content)
      thinking, reply = (found.group(1), m.content.partition(found.group(1) + "</think>")[2].strip()) if found else (
        m.content, "None")  # fmt: skip
      reply = reply or "None"
      if m.tool_calls:
        calls = json.dumps([
          {"id": c.id, "type": "function",
           "function": {"name": c.name, "arguments": json.dumps(dict(c.arguments), ensure_ascii=False)}}
          for c in m.tool_calls
        ])  # fmt: skip
      elif "<tool_call>" in reply or "</tool_call>" in reply:
        calls = reply.replace("<tool_call>", "<|tool_call_start|>").replace("</tool_call>", "<|tool_call_end|>")
        reply = "None"
      else:
        calls = "None"
      out.append(
        f"## Step: {step}\nRole: assistant\ncontent.thinking: {thinking}\ncontent.user_visible_reply: {reply}\n"
        f"tool_call: {calls}\n"
      )
      step += 1
    else:
      out.append(f"Role: tool\ncontent: {m.content}\n")
  return "".join(out)


PROMPT_FIELDS = ("question", "focus_on", "pass_condition", "failure_examples", "evidence", "history", "current")
"""The placeholders of a judge prompt template (``reward.judge_prompt_file``, `string.Template`: ``$question``...):
the item's question, focus and pass condition; its failure examples and its evidence snippets, each a JSON list
(ASCII, indent 2); the earlier turns; the judged messages."""


def load_prompt_template(path: str) -> string.Template:
  """The judge prompt template at ``path`` (see `PROMPT_FIELDS`).

  Raises:
    RewardConfigError: the file cannot be read, or holds a placeholder other than `PROMPT_FIELDS` or a bare "$".
  """
  try:
    template = string.Template(pathlib.Path(path).read_text(encoding="utf-8"))
    template.substitute({name: "" for name in PROMPT_FIELDS})
  except OSError as e:
    raise RewardConfigError(f"judge prompt template {path!r} cannot be read: {e}") from None
  except (KeyError, ValueError) as e:
    raise RewardConfigError(
      f"judge prompt template {path!r}: {type(e).__name__} {e}; its placeholders are ${', $'.join(PROMPT_FIELDS)} "
      "(write $$ for a dollar sign)"
    ) from None
  return template


def fill_template(template: string.Template, item: Mapping[str, Any], history: str, current: str) -> str:
  """One request's prompt from a user-supplied template (`load_prompt_template`)."""
  snippets = [e.get("snippet", "") for e in item.get("evidence") or ()]
  return template.substitute(
    question=item["question"],
    focus_on=item.get("focus_on", ""),
    pass_condition=item["pass_condition"],
    failure_examples=json.dumps(list(item.get("failure_examples") or ()), ensure_ascii=True, indent=2),
    evidence=json.dumps(snippets, ensure_ascii=True, indent=2),
    history=history,
    current=current,
  )


def _clip(text: str, limit: int, keep: Literal["tail", "middle"]) -> str:
  if len(text) <= limit:
    return text
  marker = "\n[... truncated ...]\n"
  if keep == "tail":
    return marker + text[len(text) - limit :]
  half = limit // 2
  return text[:half] + marker + text[len(text) - half :]


def judge_prompt(item: Mapping[str, Any], history: str, current: str, schema: str = "analysis") -> str:
  """The request for one checklist item (normalised layout of `envs/checklist.py`) on one turn (or a turn up to one
  of its steps).

  Modelled on CM2's judge prompt (`get_input_prompt_v2` in `checklist_reward.py`): the item's question, focus,
  pass condition, failure examples and reference evidence, the earlier turns as context, the judged messages, and a
  strict JSON verdict: ``{"analysis", "answer"}`` (schema "analysis") or the four analyses of `OFFICIAL_FIELDS` and
  the answer (schema "official"). The wording is ours.
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
    "applies.\n\n" + (_OUTPUT_OFFICIAL if schema == "official" else _OUTPUT_ANALYSIS)
  )


_OUTPUT_ANALYSIS = '# Output\nReturn only one JSON object: {"analysis": "<brief reasoning>", "answer": true or false}'
_OUTPUT_OFFICIAL = (
  "# Output\nReturn only one JSON object with these keys, in this order: what the item asks "
  "(high_level_understanding_of_the_question), whether the focus part is present (analysis_of_if_focus_on), whether "
  "the pass condition holds (analysis_of_pass_condition), which failure examples apply (analysis_of_failure_examples), "
  "all four strings, then answer (true or false)."
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


def _unjudged(failures: Mapping[str, str], sent: int) -> RewardInfo:
  """The invalid reward of a conversation some of whose ``sent`` judge requests gave no verdict (``failures``: item
  key -> why), naming the first."""
  item, why = next(iter(failures.items()))
  message = f"{len(failures)} of {sent} judge requests gave no verdict; first: {item}: {why}"
  info = {"scoring_error": message, "judge_failures": failures, "requests": sent}
  return RewardInfo(math.nan, valid=False, info=info)


class ChecklistJudge:
  """The paper's checklist reward: an LLM judges each checklist item of each user turn.

  For checklist-format tasks (`task.criteria["checklists"]`, see `envs/checklist.py`) the k-th turn's items are
  judged on the k-th user turn of the conversation, with the earlier turns as context. With ``granularity="step"``
  (the official `interaction.py`) each assistant message of the turn is a step, judged on the turn up to it and its
  tool results, one request per (step, item), and an item passes when any step passes; with ``"turn"`` one request
  per (turn, item) judges the whole turn. A turn the trajectory never reached scores 0 without a request, and so does
  its last turn when it was cut off (``last_turn_finished=False``) and ``unfinished_turn="zero"`` (official: only a
  turn that ends with the agent's reply is judged, `envs.py`). An item about tool calls or their results
  (``focus_on`` "assistant.tool_calls" / "tool.content") fails without a request on a step whose tool result is an
  ``error_tool_call`` object, as officially. Other tasks get `derived_checklist`, one turn over the whole
  conversation. A turn's reward is the weighted sum of its passed items; the trajectory's the sum over annotations
  and turns divided by both counts (the official `reward_manager/checklist.py`; with several annotations,
  `max_annotations`, the mean of theirs).

  Failures never score 0. A reply without a usable verdict after all retries, or a request the server refuses as bad
  (HTTP 400/413/422: the prompt, not the server, is at fault), is a *judge failure*; a transport failure
  (connection refused, timeout, HTTP 408/409/429/5xx after all retries) stops the trajectory's other requests.
  Either makes the whole trajectory invalid: `RewardInfo(reward=nan, valid=False)` with the reason in
  `info["scoring_error"]` (and the failed items in `info["judge_failures"]`), excluded from the update and counted
  as a scoring error (`envace_jax/scoring.py`). (Officially a judge failure scores its item 0 and ends the episode.)
  HTTP 3xx/401/403/404 raise `RewardConfigError`: retrying cannot fix a wrong URL, model or key.

  A turn judged during the rollout (`judge_turn`, the required-item gate of `scoring.turn_gate`) is passed back to
  `score` as ``judged`` and not judged again, so the gate's verdicts are the reward's.

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
    self._template = load_prompt_template(config.prompt_file) if config.prompt_file else None
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

  def _post(self, prompt: str, max_tokens: int | None = None) -> str | None:
    """One request: the reply text, None for a 200 without a chat-completions body."""
    payload = {
      "model": self.config.model,
      # A call's arguments may hold a lone surrogate (the JSON escape \ud800), which cannot be sent as UTF-8: U+FFFD,
      # as the official code's judge reads it (model/sanitize.py).
      "messages": [{"role": "user", "content": sanitize.sanitize(prompt)}],
      "temperature": self.config.temperature,
      "top_p": self.config.top_p,
      "max_tokens": max_tokens or self.config.max_tokens,
      **({"response_format": response_format()} if self.config.schema == "official" else {}),
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

  def probe(self) -> None:
    """One small request to the endpoint, before any trajectory is judged: a misconfigured judge fails here.

    Any 2xx answer passes (its content is not judged); transport failures and HTTP 408/409/429/5xx are retried as
    in `judge`.

    Raises:
      RewardConfigError: HTTP 3xx/401/403/404, or HTTP 400/413/422 (the endpoint refuses even a minimal request:
        a wrong model name on most servers).
      JudgeTransportError: the endpoint cannot be reached after all retries.
    """
    cfg, last = self.config, ""
    prompt = 'Reply with the JSON object {"answer": true}.'
    for attempt in range(cfg.max_retries + 1):
      if attempt:
        time.sleep(min(cfg.backoff_max_s, cfg.backoff_s * 2 ** (attempt - 1)))
      try:
        self._post(prompt, max_tokens=min(cfg.max_tokens, 16))
        return
      except _Retryable as e:
        last = str(e)
      except _Refused as e:
        raise RewardConfigError(f"the judge refused a minimal request ({e}); check the model name") from None
    raise JudgeTransportError(f"{last} (after {cfg.max_retries + 1} attempts)")

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

  def __call__(self, task: Task, conversation: Sequence[ChatMessage], **kwargs) -> RewardInfo:
    return self.score(task, conversation, **kwargs)

  def _annotations(self, task: Task) -> list:
    return (task.criteria.get("checklists") or [])[: self.config.max_annotations]

  def _requests(self, task: Task, conversation: Sequence[ChatMessage], turns: Sequence[int]) -> dict[str, str | None]:
    """The requests that judge the annotated ``turns`` of ``conversation``: key -> prompt, or None for a verdict
    that is False without a request (a tool item on a step answered by an ``error_tool_call``). Keys are
    ``[annotation[a]/]turn[t]/[step[s]/]<item id>``."""
    cfg = self.config
    preamble, segments = split_turns(conversation)
    annotations = self._annotations(task)
    prefix = (lambda a: f"annotation[{a}]/") if len(annotations) > 1 else (lambda a: "")
    requests: dict[str, str | None] = {}
    official = cfg.transcript == "official"
    for t in turns:
      before = list(preamble) + [m for turn in segments[:t] for m in turn]
      history = _clip(
        render_official(before) if official else render_messages(before, 0), cfg.max_history_chars, "tail"
      )
      turn = segments[t]
      parts = [("", turn, False)]  # (key part, the judged messages, a tool result of the step is an error_tool_call)
      if cfg.granularity == "step":
        parts = []
        for s, i in enumerate(i for i, m in enumerate(turn) if m.role == "assistant"):
          end = i + 1
          while end < len(turn) and turn[end].role == "tool":
            end += 1
          parts.append((f"step[{s}]/", turn[:end], any(_error_tool_call(m.content) for m in turn[i + 1 : end])))
      for a, annotation in enumerate(annotations):
        for part, messages, failed_call in parts:
          current = render_official(messages) if official else render_messages(messages, t)
          current = _clip(current, cfg.max_turn_chars, "middle")
          for item in annotation[t]:
            fixed = failed_call and item["focus_on"] in TOOL_FOCUS
            prompt = None if fixed else self._prompt(item, history, current)
            requests[f"{prefix(a)}turn[{t}]/{part}{item['id']}"] = prompt
    return requests

  def _prompt(self, item: Mapping[str, Any], history: str, current: str) -> str:
    if self._template is not None:
      return fill_template(self._template, item, history, current)
    return judge_prompt(item, history, current, self.config.schema)

  def _verdicts(self, requests: Mapping[str, str | None]) -> dict[str, Verdict]:
    """Sends ``requests`` concurrently; a None prompt is a False verdict without a request.

    Raises:
      JudgeTransportError: a request failed in transport (the others are cancelled).
      RewardConfigError: HTTP 3xx/401/403/404.
    """
    verdicts = {k: Verdict(False, "an error_tool_call answered this step") for k, p in requests.items() if p is None}
    stop = threading.Event()
    jobs = {k: self._pool.submit(self.judge, p, stop) for k, p in requests.items() if p is not None}
    keys = {future: key for key, future in jobs.items()}
    try:
      for future in concurrent.futures.as_completed(keys):  # the first failure stops the rest
        verdicts[keys[future]] = future.result()
    except (JudgeTransportError, RewardConfigError):
      stop.set()
      for future in jobs.values():
        future.cancel()
      concurrent.futures.wait(jobs.values())
      raise
    return verdicts

  @staticmethod
  def _items(verdicts: Mapping[str, Verdict]) -> tuple[dict[str, bool], dict[str, str]]:
    """Item verdicts from request verdicts: ({item key: passed at any step}, {request key: why it gave none})."""
    passed: dict[str, bool] = {}
    for key, v in verdicts.items():
      item = re.sub(r"/step\[\d+\]/", "/", key)
      passed[item] = passed.get(item, False) or bool(v.passed)
    return passed, {k: v.error for k, v in verdicts.items() if v.passed is None}

  def judge_turn(self, task: Task, conversation: Sequence[ChatMessage], turn: int) -> dict[str, Any]:
    """Judges the finished annotated turn ``turn`` of ``conversation`` now (the required-item gate,
    `scoring.turn_gate`), for `score`'s ``judged``.

    Returns:
      {"turn": turn, "passed": {item key: bool}, "failures": {key: why no verdict} (a transport failure is one entry
      under ``turn[t]``), "requests": requests sent, "required_failed": annotations in which an item marked
      ``required_for_next_turn`` failed, "annotations": how many were judged}: plain data (kept in the trajectory's
      events).

    Raises:
      RewardConfigError: HTTP 3xx/401/403/404.
    """
    requests = self._requests(task, conversation, [turn])
    try:
      passed, failures = self._items(self._verdicts(requests))
    except JudgeTransportError as e:
      passed, failures = {}, {f"turn[{turn}]": f"judge transport failure: {e}"}
    annotations = self._annotations(task)
    prefix = (lambda a: f"annotation[{a}]/") if len(annotations) > 1 else (lambda a: "")
    required_failed = sum(
      any(item["required_for_next_turn"] and not passed.get(f"{prefix(a)}turn[{turn}]/{item['id']}", False)
          for item in annotation[turn])
      for a, annotation in enumerate(annotations)
    )  # fmt: skip
    sent = sum(p is not None for p in requests.values())
    return {"turn": turn, "passed": passed, "failures": failures, "requests": sent, "required_failed": required_failed,
            "annotations": len(annotations)}  # fmt: skip

  def score(
    self,
    task: Task,
    conversation: Sequence[ChatMessage],
    *,
    last_turn_finished: bool = True,
    judged: Mapping[int, Mapping[str, Any]] | None = None,
  ) -> RewardInfo:
    """Judges `conversation` on `task`'s checklists (see the class docstring).

    Args:
      last_turn_finished: False when the trajectory ended inside its last turn (before the agent's reply to it).
      judged: turns already judged during the rollout, by turn index (`judge_turn`'s results).

    Raises:
      RewardConfigError: the endpoint rejects the configuration (HTTP 3xx/401/403/404).
    """
    if not self._annotations(task):
      return self._score_derived(task, conversation)
    cfg, judged = self.config, dict(judged or {})
    annotations = self._annotations(task)
    prefix = (lambda a: f"annotation[{a}]/") if len(annotations) > 1 else (lambda a: "")
    _, segments = split_turns(conversation)
    reached = len(segments) if last_turn_finished or cfg.unfinished_turn == "judge" else len(segments) - 1
    requests = self._requests(task, conversation, [t for t in range(reached) if t not in judged])
    sent = sum(p is not None for p in requests.values()) + sum(j["requests"] for j in judged.values())
    failures = {k: why for j in judged.values() for k, why in j["failures"].items()}
    passed: dict[str, bool] = {k: v for j in judged.values() for k, v in j["passed"].items()}
    verdicts: dict[str, Verdict] = {}
    if not failures:
      try:
        verdicts = self._verdicts(requests)
      except JudgeTransportError as e:
        return RewardInfo(
          math.nan, valid=False, info={"scoring_error": f"judge transport failure: {e}", "requests": sent}
        )
      now_passed, failures = self._items(verdicts)
      passed |= now_passed
    if failures:
      return _unjudged(failures, sent)
    breakdown: dict[str, float] = {}
    total, turns = 0.0, len(annotations[0])
    for a, annotation in enumerate(annotations):
      for t, items in enumerate(annotation):
        score = 0.0
        for item in items:
          key = f"{prefix(a)}turn[{t}]/{item['id']}"
          breakdown[key] = float(passed.get(key, False))  # a turn not judged scores 0
          score += item["weight"] * breakdown[key]
        breakdown[f"{prefix(a)}turn[{t}]"] = score
        total += score
    info = {
      "requests": sent,
      "judge_failures": {},
      "unreached_turns": [f"turn[{t}]" for t in range(len(segments), turns)],
      "unfinished_turns": [f"turn[{t}]" for t in range(reached, len(segments))],
      "analysis": {k: v.analysis for k, v in verdicts.items()},
    }
    return RewardInfo(reward=min(1.0, max(0.0, total / len(annotations) / turns)), breakdown=breakdown, info=info)

  def _score_derived(self, task: Task, conversation: Sequence[ChatMessage]) -> RewardInfo:
    """A task without annotations: `derived_checklist`'s items, one request each, on the whole conversation."""
    derived = derived_checklist(task)
    if not derived:
      return RewardInfo(1.0, info={"note": "no checklist items: nothing to judge"})
    render = render_official if self.config.transcript == "official" else render_messages
    current = _clip(render(conversation), self.config.max_turn_chars, "middle")
    requests = {f"turn[0]/{item['id']}": self._prompt(item, "", current) for item in derived}
    try:
      verdicts = self._verdicts(requests)
    except JudgeTransportError as e:
      info = {"scoring_error": f"judge transport failure: {e}", "requests": len(requests)}
      return RewardInfo(math.nan, valid=False, info=info)
    failures = {k: v.error for k, v in verdicts.items() if v.passed is None}
    if failures:
      return _unjudged(failures, len(requests))
    breakdown = {k: float(verdicts[k].passed) for k in requests}
    score = 0.0
    for item in derived:
      score += item["weight"] * breakdown[f"turn[0]/{item['id']}"]
    breakdown["turn[0]"] = score
    info = {"requests": len(requests), "judge_failures": {}, "unreached_turns": [], "unfinished_turns": [],
            "analysis": {k: v.analysis for k, v in verdicts.items()}}  # fmt: skip
    return RewardInfo(reward=min(1.0, max(0.0, score)), breakdown=breakdown, info=info)


TOOL_FOCUS = ("assistant.tool_calls", "tool.content")
"""``focus_on`` values of items about tool calls, which fail on a step answered by an ``error_tool_call``."""


def _error_tool_call(content: str) -> bool:
  """Whether a tool result is a JSON object with an ``error_tool_call`` key (the official failed-call marker)."""
  try:
    data = json.loads(content)
  except (json.JSONDecodeError, TypeError):
    return False
  return isinstance(data, dict) and "error_tool_call" in data
