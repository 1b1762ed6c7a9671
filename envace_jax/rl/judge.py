"""The paper's LLM checklist judge over an OpenAI-compatible chat-completions endpoint.

EnvACE (arXiv 2608.06197), following CM2's checklist rewards (github.com/namezhenzhang/CM2-RLCR-Tool-Agent
`verl/utils/reward_score/checklist_reward.py`): one request per checklist item and user turn, a JSON verdict back
(`ChecklistJudge`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import re
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import httpx

from envace_jax.envs.base import ChatMessage, RewardInfo, Task
from envace_jax.model import sanitize
from envace_jax.rl.rewards import _THINK_RE, RewardConfigError


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

  Failures never score 0. A reply without a usable verdict after all retries, or a request the server refuses as bad
  (HTTP 400/413/422: the prompt, not the server, is at fault), is a *judge failure*; a transport failure
  (connection refused, timeout, HTTP 408/409/429/5xx after all retries) stops the trajectory's other requests.
  Either makes the whole trajectory invalid: `RewardInfo(reward=nan, valid=False)` with the reason in
  `info["scoring_error"]` (and the failed items in `info["judge_failures"]`), excluded from the update and counted
  as a scoring error (`envace_jax/scoring.py`). HTTP 3xx/401/403/404 raise `RewardConfigError`: retrying cannot fix
  a wrong URL, model or key.

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

  def _post(self, prompt: str, max_tokens: int | None = None) -> str | None:
    """One request: the reply text, None for a 200 without a chat-completions body."""
    payload = {
      "model": self.config.model,
      # A call's arguments may hold a lone surrogate (the JSON escape \ud800), which cannot be sent as UTF-8: U+FFFD,
      # as the official code's judge reads it (model/sanitize.py).
      "messages": [{"role": "user", "content": sanitize.sanitize(prompt)}],
      "temperature": self.config.temperature,
      "max_tokens": max_tokens or self.config.max_tokens,
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
      return RewardInfo(
        math.nan, valid=False, info={"scoring_error": f"judge transport failure: {e}", "requests": len(jobs)}
      )
    failures = {k: v.error for k, v in verdicts.items() if v.passed is None}
    if failures:
      item, why = next(iter(failures.items()))
      return RewardInfo(
        math.nan,
        valid=False,
        info={
          "scoring_error": f"{len(failures)} of {len(jobs)} judge requests gave no verdict; first: {item}: {why}",
          "judge_failures": failures,
          "requests": len(jobs),
        },
      )

    breakdown: dict[str, float] = {}
    annotation_rewards = []
    for a, annotation in enumerate(annotations):
      turn_scores = []
      for t, items in enumerate(annotation):
        score = 0.0
        for item in items:
          key = f"{prefix(a)}turn[{t}]/{item['id']}"
          passed = bool(verdicts[key].passed) if key in verdicts else False  # an unreached turn scores 0
          breakdown[key] = float(passed)
          score += item["weight"] * passed
        breakdown[f"{prefix(a)}turn[{t}]"] = score
        turn_scores.append(score)
      annotation_rewards.append(math.fsum(turn_scores) / len(turn_scores))
    reward = min(1.0, max(0.0, math.fsum(annotation_rewards) / len(annotation_rewards)))
    info = {
      "requests": len(jobs),
      "judge_failures": {},
      "unreached_turns": unreached,
      "analysis": {k: v.analysis for k, v in verdicts.items()},
    }
    return RewardInfo(reward=reward, breakdown=breakdown, info=info)
