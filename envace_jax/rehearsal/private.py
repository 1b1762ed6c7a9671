"""Test-time private rehearsal: imagine the task N times, assess each rehearsal, condense them into a rehearsal memory,
then act for real once with the memory in context (committed execution). Paper §4 ("Private rehearsal at test time").

For each (task, trial):

  1. **Opening** (`openings`): the agent's greeting and the real user's first message, from the evaluation's user
     simulator. This is what the agent knows before it rehearses: the policy, the tools and that message.
  2. **Rehearsal** (`rehearse`): N imagined trajectories with the rollout machinery (`unfold`, ``env_mode="rehearse"``):
     the policy acts, rehearses every tool response and imagines the user, told only the first message
     (`rehearsal_task`: nothing of the benchmark's answer leaks in). ``parallel``: one batched rollout (G = N);
     ``sequential``: rehearsal n's system message holds an account of rehearsals 1..n-1 (``ACCOUNT_HEADER``).
  3. **Self-assessment** after each rehearsal (``ASSESS_PROMPT``: outcome, what went wrong, which tool results
     mattered), and the **rehearsal memory** m_x (``MEMORY_PROMPT``): the rehearsals and assessments condensed by the
     policy into at most ``memory_max_tokens`` tokens.
  4. **Committed execution** (`commit`): ACT with m_x appended to its system message (``MEMORY_HEADER``), against the
     real tools and the real user simulator, continuing from the opening. The caller scores it with the benchmark.

``mode="off"`` skips 2-3: the committed execution starts from the same opening without a memory. Every phase's cost is
recorded (`PhaseCost`).

Two controls (``control``; experiments/evidence.py, claim 4) ask whether imagining the environment is what helps,
under the same generation cap (what each spends is recorded: `PhaseCost`). ``"no_world_model"`` makes the same N
rehearsals, assessments and memory but withholds every imagined tool result from what the assessments, a sequential
rehearsal's account and the memory see (`transcript` with ``tool_results=False``; the agent's own later calls and
replies, which may restate a result, stay). ``"drafts"`` writes N plans from the agent's own view with no tool result
at all (``DRAFT_PROMPT``; each capped at one rehearsal's ``max_turns`` ACT and REHEARSE generations), assesses each
(``DRAFT_ASSESS_PROMPT``) and commits with the best assessed plan in the memory's place (``DRAFT_HEADER``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from envace_jax.config import defaults
from envace_jax.config.choices import REHEARSAL_CONTROLS as CONTROLS
from envace_jax.config.choices import REHEARSAL_MODES as MODES
from envace_jax.config.choices import REHEARSAL_USERS
from envace_jax.envs import registry
from envace_jax.envs.base import ChatMessage, Task, ToolEnv
from envace_jax.model import tool_format
from envace_jax.model.roles import Role
from envace_jax.model.tokenizer import Message, Tokenizer
from envace_jax.rehearsal import views
from envace_jax.rehearsal.completion import complete
from envace_jax.rehearsal.episode import UnfoldConfig
from envace_jax.rehearsal.trajectory import Trajectory
from envace_jax.rehearsal.unfold import generated_tokens, sampler_for, unfold
from envace_jax.rehearsal.users import UserSimulator, UserSimulatorError
from envace_jax.sampling.sampler import GREEDY, SamplingParams

# Streams of `run`'s key: the openings, the rehearsals, the committed execution; within the rehearsals, round n
# unfolds with fold_in(key, n), assesses with fold_in(key, _ASSESS_STREAM + n) and memorises with _MEMORY_STREAM.
_OPENING_STREAM, _REHEARSAL_STREAM, _COMMIT_STREAM = 0, 1, 2
_ASSESS_STREAM, _MEMORY_STREAM = 1000, 2000

IMAGINED_USER = (
  'You are imagining the user of this conversation. All you know is the user\'s first message:\n"{first}"\n'
  "Continue as that user would: answer the agent's questions with plausible details consistent with that message, "
  "one message at a time."
)
"""The rehearsal's user scenario (the real one is hidden from the agent); ``{first}`` is the user's first message."""

ASSESS_PROMPT = (
  "# Review of a rehearsal\n\nBefore talking to the real user you rehearsed the conversation privately: the user and "
  "every tool result in the transcript below were imagined. Assess the rehearsal in exactly three lines:\n"
  "Outcome: success, partial or failure (did the agent do what the user needed, within the policy above?)\n"
  "What went wrong: the mistakes to avoid, or 'nothing'\n"
  "Key tool results: the calls and results that mattered, to check against the real tools"
)
"""Appended to the agent's policy in the self-assessment prompt (the transcript follows as the user message)."""

MEMORY_PROMPT = (
  "# Rehearsal memory\n\nBefore talking to the real user you rehearsed the conversation privately (the user and the "
  "tool results were imagined). Condense the rehearsals and their assessments below into short notes for the real "
  "conversation: what to ask the user, which tools to call with which arguments and in which order, and which "
  "mistakes to avoid."
)
"""Appended to the agent's policy in the memory prompt (the rehearsals and assessments follow as the user message)."""

ACCOUNT_HEADER = (
  "# Earlier private rehearsals\n\nYou are rehearsing this conversation privately before the real one: the user and "
  "the tool results are imagined. Your earlier rehearsals and your assessment of each follow; do better this time."
)
"""Opens the account of earlier rehearsals in a sequential rehearsal's system message."""

MEMORY_HEADER = (
  "# Notes from your private rehearsals\n\nYou rehearsed this conversation privately before (the user and the tool "
  "results there were imagined: trust the real tools now). Your notes:"
)
"""Opens the rehearsal memory in the committed execution's system message."""

WITHHELD = "(not shown)"
"""What a tool result reads as in a ``no_world_model`` rehearsal's transcript."""

DRAFT_PROMPT = (
  "# Private draft\n\nBefore answering the real user, draft privately how you will handle this conversation: the "
  "tool calls you will make, in order and with their arguments, and what you will tell the user. Nothing is executed "
  "now and no tool result will be shown: write the plan only."
)
"""Appended to the agent's policy and tools in a ``drafts`` control's prompt (the conversation so far follows)."""

DRAFT_ASSESS_PROMPT = (
  "# Review of a draft\n\nBefore talking to the real user you drafted privately how to handle the conversation "
  "(below; nothing was executed). Assess the draft in exactly three lines:\n"
  "Outcome: success, partial or failure (would it do what the user needed, within the policy above?)\n"
  "What went wrong: the mistakes to avoid, or 'nothing'\n"
  "Key tool results: the calls whose results matter, to check against the real tools"
)
"""Appended to the agent's policy in a draft's assessment prompt (the draft follows as the user message)."""

DRAFT_HEADER = (
  "# Your private draft\n\nYou drafted this conversation privately before (nothing was executed: trust the real "
  "tools now). The draft you judged best:"
)
"""Opens the chosen draft in the committed execution's system message (``control="drafts"``)."""

_OUTCOME_RANK = {"success": 2, "partial": 1}  # an assessment's outcome word -> rank; anything else ranks 0


class PrivateRehearsalError(ValueError):
  """Private rehearsal is misconfigured (mode, N, budgets, missing sampler)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrivateRehearsalConfig:
  """How a task is rehearsed before the committed execution (paper: test-time private rehearsal).

  Attributes:
    mode: one of ``eval.rehearsal``'s ("off", "parallel", "sequential").
    num_rehearsals, assessment_max_tokens, memory_max_tokens, digest_max_tokens, user: ``config.eval``'s
      ``rehearsal_n``, ``assessment_max_tokens``, ``memory_max_tokens``, ``digest_max_tokens`` and
      ``rehearsal_user`` (explained in ``envace_jax/config/defaults.py``; `from_config` reads them). Either user is
      told only the first message (``IMAGINED_USER``).
    control: ``eval.rehearsal_control``: "none" (private rehearsal), or a control at the same budget (module
      docstring).
    sampling: `SamplingParams` of the assessments and the memory (greedy).
  """

  mode: str
  num_rehearsals: int
  assessment_max_tokens: int
  memory_max_tokens: int
  digest_max_tokens: int
  user: str
  control: str
  sampling: SamplingParams = GREEDY

  @classmethod
  def from_config(cls, config=None, *, mode: str, **overrides) -> PrivateRehearsalConfig:
    """``config.eval``'s rehearsal settings with ``mode``, then ``overrides``; config None: the defaults.

    Raises:
      PrivateRehearsalError: an invalid value.
    """
    e = defaults.or_defaults(config).eval
    fields = dict(
      num_rehearsals=e.rehearsal_n,
      assessment_max_tokens=e.assessment_max_tokens,
      memory_max_tokens=e.memory_max_tokens,
      digest_max_tokens=e.digest_max_tokens,
      user=e.rehearsal_user,
      control=e.rehearsal_control,
    )
    return cls(mode=mode, **{**fields, **overrides})

  def __post_init__(self):
    if self.mode not in MODES:
      raise PrivateRehearsalError(f"PrivateRehearsalConfig.mode={self.mode!r}; valid: {', '.join(MODES)}")
    if self.control not in CONTROLS:
      raise PrivateRehearsalError(f"PrivateRehearsalConfig.control={self.control!r}; valid: {', '.join(CONTROLS)}")
    if self.user not in REHEARSAL_USERS:
      raise PrivateRehearsalError(f"PrivateRehearsalConfig.user={self.user!r}; valid: {', '.join(REHEARSAL_USERS)}")
    for name in ("num_rehearsals", "assessment_max_tokens", "memory_max_tokens", "digest_max_tokens"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise PrivateRehearsalError(f"PrivateRehearsalConfig.{name} must be a positive int, got {value!r}")


@dataclasses.dataclass
class PhaseCost:
  """What one phase cost, summed over its calls: generated and prefilled tokens, wall seconds."""

  generated_tokens: float = 0.0
  prefill_tokens: float = 0.0
  seconds: float = 0.0

  def add(self, generated: float, prefill: float, seconds: float) -> None:
    self.generated_tokens += generated
    self.prefill_tokens += prefill
    self.seconds += seconds

  def add_unfold(self, stats: Mapping[str, float]) -> None:
    generated = generated_tokens(stats)
    prefill = stats.get("prefill_tokens", 0.0) + stats.get("prefill_tokens_shared", 0.0)
    self.add(generated, prefill, stats.get("time_total_s", 0.0))


@dataclasses.dataclass
class Rehearsal:
  """One imagined trajectory and what the policy made of it.

  Attributes:
    trajectory: the rehearsed `Trajectory` (its task is the `rehearsal_task`: no gold, no hidden scenario).
    assessment: the self-assessment text ("Outcome: ...").
    account: the account of earlier rehearsals this one's agent saw ("" for parallel rehearsals and the first
      sequential one).
  """

  trajectory: Trajectory
  assessment: str = ""
  account: str = ""


@dataclasses.dataclass
class Draft:
  """One plan of a ``drafts`` control: its text (no tool was run) and the policy's assessment of it."""

  text: str
  assessment: str = ""


@dataclasses.dataclass
class Prepared:
  """One (task, trial) ready for its committed execution.

  Attributes:
    task: the original task.
    trial: the trial index (0..k-1).
    opening: the messages before the agent's first decision (greeting, the real user's first message).
    rehearsals: the N rehearsals in order (empty with mode "off").
    memory: the rehearsal memory m_x ("" with mode "off"); with ``control="drafts"``, the chosen draft.
    memory_tokens: its length in tokens (<= ``memory_max_tokens``).
    drafts: a ``drafts`` control's N plans, in order (else empty).
    header: what opens the memory in the committed execution's system message.
  """

  task: Task
  trial: int
  opening: tuple[ChatMessage, ...] = ()
  rehearsals: list[Rehearsal] = dataclasses.field(default_factory=list)
  memory: str = ""
  memory_tokens: int = 0
  drafts: list[Draft] = dataclasses.field(default_factory=list)
  header: str = MEMORY_HEADER

  @property
  def committed_task(self) -> Task:
    """The task as the committed execution's agent sees it: the policy followed by the memory."""
    if not self.memory:
      return self.task
    return dataclasses.replace(self.task, system_prompt=f"{self.task.system_prompt}\n\n{self.header}\n{self.memory}")


# -------------------------------------------------------------------------------------------------------------------
# Rendering.


def _clip(text: str, limit: int = 400) -> str:
  text = " ".join(text.split())
  return text if len(text) <= limit else text[: limit - 3] + "..."


def transcript(messages: Sequence[ChatMessage], tool_results: bool = True) -> str:
  """A conversation as plain lines: "User: ...", "Agent: ...", "Agent calls f({...})", "Tool result: ..." (each
  result's content replaced by ``WITHHELD`` unless ``tool_results``)."""
  lines = []
  for m in messages:
    if m.role == "user":
      lines.append(f"User: {_clip(m.content)}")
    elif m.role == "assistant":
      if m.content:
        lines.append(f"Agent: {_clip(m.content)}")
      for c in m.tool_calls:
        lines.append(f"Agent calls {c.name}({_clip(tool_format.compact_json(dict(c.arguments)), 300)})")
    elif m.role == "tool":
      if tool_results:
        lines.append(f"Tool result{' (error)' if m.is_error else ''}: {_clip(m.content)}")
      else:
        lines.append(f"Tool result: {WITHHELD}")
  return "\n".join(lines)


def bounded(tokenizer: Tokenizer, text: str, max_tokens: int) -> str:
  """``text`` within ``max_tokens`` tokens: unchanged if it fits, else its head and tail around an elision mark."""
  ids = tokenizer.encode(text)
  if len(ids) <= max_tokens:
    return text
  mark = "\n[...]\n"
  room = max(max_tokens - len(tokenizer.encode(mark)), 2)
  head, tail = ids[: room // 2], ids[len(ids) - (room - room // 2) :]
  out = tokenizer.decode(head) + mark + tokenizer.decode(tail)
  while len(tokenizer.encode(out)) > max_tokens and len(head) + len(tail) > 2:  # re-tokenisation can merge
    head, tail = head[:-1], tail[1:]
    out = tokenizer.decode(head) + mark + tokenizer.decode(tail)
  return out


def digest(tokenizer: Tokenizer, rehearsal: Rehearsal, max_tokens: int, tool_results: bool = True) -> str:
  """One rehearsal as later prompts show it: the transcript after the opening, within ``max_tokens`` (its imagined
  tool results withheld unless ``tool_results``)."""
  traj = rehearsal.trajectory
  ending = traj.termination.value if traj.termination else "unfinished"
  text = transcript(traj.messages, tool_results) + f"\n(The rehearsal ended: {ending}.)"
  return bounded(tokenizer, text, max_tokens)


def account(tokenizer: Tokenizer, rehearsals: Sequence[Rehearsal], max_tokens: int, tool_results: bool = True) -> str:
  """Rehearsals 1..n with their assessments, each transcript within ``max_tokens`` (`digest`)."""
  parts = []
  for i, r in enumerate(rehearsals, 1):
    text = digest(tokenizer, r, max_tokens, tool_results)
    parts.append(f"## Rehearsal {i}\n{text}\nSelf-assessment:\n{r.assessment.strip()}")
  return "\n\n".join(parts)


def rehearsal_task(task: Task, opening: Sequence[ChatMessage], account_text: str = "") -> Task:
  """``task`` as a rehearsal may see it: the user scenario replaced by ``IMAGINED_USER`` around the first user
  message, and the gold actions, required information and reference interactions removed (the benchmark's answer
  must not leak into the rehearsal). ``account_text`` (sequential) is appended to the agent's system message.
  Tasks with logged user turns keep only the first one."""
  history = [*registry.initial_conversation(task), *opening]
  first = next((m.content for m in history if m.role == "user"), "")
  if not first and task.user_turns:
    first = task.user_turns[0]
  system = task.system_prompt + (f"\n\n{ACCOUNT_HEADER}\n\n{account_text}" if account_text else "")
  return dataclasses.replace(
    task,
    system_prompt=system,
    user_scenario=IMAGINED_USER.format(first=first) if not task.user_turns else "",
    user_turns=task.user_turns[:1],
    gold_actions=(),
    communicate_info=(),
    reference_interactions=(),
  )


# -------------------------------------------------------------------------------------------------------------------
# The phases.


def openings(
  tasks: Sequence[Task],
  num_trials: int,
  tokenizer: Tokenizer,
  config: UnfoldConfig,
  key: jax.Array,
  *,
  user_sampler=None,
  user_simulator: UserSimulator | None = None,
  cost: PhaseCost | None = None,
) -> list[tuple[ChatMessage, ...]]:
  """The messages before the agent's first decision, per (task, trial), task-major: the greeting and the user's first
  message, written by the evaluation's user (``user_sampler`` playing ``config.user_prompt``, or
  ``user_simulator``), or with ``config.scenario_opening`` the task's user scenario itself (no user is asked). Tasks
  with logged user turns or a benchmark initial conversation get () (their first user message is already given). A
  user that fails gets () too: the committed execution then asks it again.

  Raises:
    PrivateRehearsalError: a simulated user but neither ``user_sampler`` nor ``user_simulator``.
  """
  out: list[tuple[ChatMessage, ...]] = [() for _ in range(len(tasks) * num_trials)]
  need = [b for b, t in enumerate(tasks) if not t.user_turns and not registry.initial_conversation(t)]
  if not need:
    return out
  greeting = (ChatMessage("assistant", config.greeting),) if config.greeting else ()
  if config.scenario_opening:
    for b in need:
      for trial in range(num_trials):
        out[b * num_trials + trial] = (*greeting, ChatMessage("user", tasks[b].user_scenario))
    return out
  if user_sampler is None and user_simulator is None:
    raise PrivateRehearsalError("the opening needs the user simulator: a user_sampler or a user_simulator")
  chats = []
  for b in need:
    chat = [Message("system", views.user_system_prompt(tasks[b], config.user_prompt))]
    chat += [m for g in greeting for m in views.user_messages(g)]
    chats += [chat] * num_trials
  start = time.perf_counter()
  if user_simulator is not None:
    texts = []
    for chat in chats:
      try:
        texts.append(user_simulator.reply([{"role": m.role, "content": m.content} for m in chat]))
      except UserSimulatorError:
        texts.append(None)
    if cost is not None:
      cost.add(0, 0, time.perf_counter() - start)
  else:
    done, stats = complete(
      user_sampler,
      tokenizer,
      chats,
      key=key,
      max_new_tokens=config.user_max_new_tokens,
      role=Role.USER,
      sampling=config.user_sampling,
    )
    texts = [c.text for c in done]
    if cost is not None:
      cost.add(stats["generated_tokens"], stats["prefill_tokens"], stats["seconds"])
  for j, b in enumerate(need):
    for trial in range(num_trials):
      text = texts[j * num_trials + trial]
      if text is not None:
        out[b * num_trials + trial] = (*greeting, ChatMessage("user", text.strip()))
  return out


def _reflect(policy, tokenizer, chats, max_tokens: int, cfg: PrivateRehearsalConfig, key, cost, answer_prefix=""):
  """The policy's (ACT parameters) answers to ``chats`` (self-assessments, the memory), stripped; cost added."""
  done, stats = complete(
    sampler_for(policy, Role.ACT),
    tokenizer,
    chats,
    key=key,
    max_new_tokens=max_tokens,
    sampling=cfg.sampling,
    answer_prefix=answer_prefix,
  )
  cost.add(stats["generated_tokens"], stats["prefill_tokens"], stats["seconds"])
  return [c.text.strip() for c in done]


def _assess(prepared, index_pairs, policy, tokenizer, cfg: PrivateRehearsalConfig, key, cost):
  """Fills ``assessment`` of the rehearsals at ``index_pairs`` [(prepared index, rehearsal index)], one batch."""
  chats = []
  for p, r in index_pairs:
    item = prepared[p]
    system = f"{item.task.system_prompt}\n\n{ASSESS_PROMPT}"
    shown = cfg.control != "no_world_model"
    body = "Transcript of the rehearsal:\n" + digest(tokenizer, item.rehearsals[r], cfg.digest_max_tokens, shown)
    chats.append([Message("system", system), Message("user", body)])
  texts = _reflect(policy, tokenizer, chats, cfg.assessment_max_tokens, cfg, key, cost, answer_prefix="Outcome:")
  for (p, r), text in zip(index_pairs, texts, strict=True):
    prepared[p].rehearsals[r].assessment = text


def _memorize(prepared, policy, tokenizer, cfg: PrivateRehearsalConfig, key, cost):
  """Fills ``memory`` of every item: the policy condenses its rehearsals into <= memory_max_tokens tokens."""
  chats = []
  for item in prepared:
    shown = cfg.control != "no_world_model"
    body = "My rehearsals and their assessments:\n\n" + account(
      tokenizer, item.rehearsals, cfg.digest_max_tokens, shown
    )
    chats.append([Message("system", f"{item.task.system_prompt}\n\n{MEMORY_PROMPT}"), Message("user", body)])
  texts = _reflect(policy, tokenizer, chats, cfg.memory_max_tokens, cfg, key, cost)
  for item, text in zip(prepared, texts, strict=True):
    # The generation has <= memory_max_tokens tokens; its text re-tokenised may differ slightly: bound that too.
    item.memory = bounded(tokenizer, text, cfg.memory_max_tokens)
    item.memory_tokens = len(tokenizer.encode(item.memory))


def _draft(prepared, policy, tokenizer: Tokenizer, unfold_config: UnfoldConfig, cfg, key, costs) -> None:
  """The ``drafts`` control, in place: N independent plans per item from the agent's own view (its policy, tools and
  the conversation before its first decision; no tool result), each assessed, the best assessed (success > partial >
  anything else; the first on a tie) as the item's memory under ``DRAFT_HEADER``. A draft's budget is one
  rehearsal's: ``max_turns`` ACT and REHEARSE generations."""
  n = cfg.num_rehearsals
  chats = []
  for item in prepared:
    history = [*registry.initial_conversation(item.task), *item.opening]
    if not any(m.role == "user" for m in history) and item.task.user_turns:
      history.append(ChatMessage("user", item.task.user_turns[0]))
    system = item.task.system_prompt
    if item.task.tools:
      system += "\n\n" + tool_format.render_tools_block(item.task.tools)
    chat = [Message("system", f"{system}\n\n{DRAFT_PROMPT}"), *(m for h in history for m in views.act_messages(h))]
    chats += [chat] * n
  budget = unfold_config.max_turns * (unfold_config.act_max_new_tokens + unfold_config.rehearse_max_new_tokens)
  done, stats = complete(
    sampler_for(policy, Role.ACT),
    tokenizer,
    chats,
    key=jax.random.fold_in(key, 0),
    max_new_tokens=budget,
    sampling=unfold_config.act_sampling,
  )
  costs["rehearsal"].add(stats["generated_tokens"], stats["prefill_tokens"], stats["seconds"])
  assess = []
  for p, item in enumerate(prepared):
    item.drafts = [Draft(c.text.strip()) for c in done[p * n : (p + 1) * n]]
    for d in item.drafts:
      body = "My draft:\n" + bounded(tokenizer, d.text, cfg.digest_max_tokens)
      assess.append([Message("system", f"{item.task.system_prompt}\n\n{DRAFT_ASSESS_PROMPT}"), Message("user", body)])
  texts = _reflect(
    policy, tokenizer, assess, cfg.assessment_max_tokens, cfg, jax.random.fold_in(key, _ASSESS_STREAM),
    costs["assessment"], answer_prefix="Outcome:",
  )  # fmt: skip
  for p, item in enumerate(prepared):
    for d, text in zip(item.drafts, texts[p * n : (p + 1) * n], strict=True):
      d.assessment = text
    best = max(range(n), key=lambda i: (_outcome_rank(item.drafts[i].assessment), -i))
    item.memory = bounded(tokenizer, item.drafts[best].text, cfg.memory_max_tokens)
    item.memory_tokens = len(tokenizer.encode(item.memory))
    item.header = DRAFT_HEADER


def _outcome_rank(assessment: str) -> int:
  """The rank of an assessment's outcome ("Outcome: success" > "partial" > anything else)."""
  words = assessment.removeprefix("Outcome:").split()
  return _OUTCOME_RANK.get(words[0].strip(".,;:").lower(), 0) if words else 0


def rehearse(
  prepared: Sequence[Prepared],
  policy,
  tokenizer: Tokenizer,
  unfold_config: UnfoldConfig,
  config: PrivateRehearsalConfig,
  key: jax.Array,
  *,
  reference_sampler=None,
  costs: Mapping[str, PhaseCost] | None = None,
) -> None:
  """Rehearses every item privately (``config.mode``), assesses each rehearsal and writes the rehearsal memory, in
  place (``Prepared.rehearsals``, ``.memory``); ``config.control`` runs a control instead (module docstring;
  ``"drafts"``: ``Prepared.drafts``, whatever the mode but "off"). Calls no real tool: only the policy (and, with
  ``config.user == "reference"``, ``reference_sampler``) generates.

  Args:
    prepared: the (task, trial) items with their openings.
    policy: the policy's `Sampler`, or {Role: Sampler} with per-role parameters.
    unfold_config: the rollout settings (capacities, budgets, sampling); env mode, group size, user mode and
      grounding are set here (rehearse, N or 1, ``config.user``, none).
    config: mode "off" does nothing.
    costs: {"rehearsal", "assessment", "memory"} -> `PhaseCost`, added to.

  Raises:
    PrivateRehearsalError: ``config.user == "reference"`` without ``reference_sampler``.
  """
  if config.mode == "off" or not prepared:
    return
  costs = costs if costs is not None else {k: PhaseCost() for k in ("rehearsal", "assessment", "memory")}
  if config.control == "drafts":
    _draft(prepared, policy, tokenizer, unfold_config, config, key, costs)
    return
  if config.user == "reference" and reference_sampler is None:
    raise PrivateRehearsalError("PrivateRehearsalConfig.user='reference' needs reference_sampler")
  parallel = config.mode == "parallel"
  ucfg = dataclasses.replace(
    unfold_config,
    env_mode="rehearse",
    group_size=config.num_rehearsals if parallel else 1,
    user_mode=config.user,
    grounding_max_tokens=0,
  )
  histories = [item.opening for item in prepared]
  rounds = 1 if parallel else config.num_rehearsals
  for n in range(rounds):
    shown = config.control != "no_world_model"
    accounts = [
      "" if parallel else account(tokenizer, item.rehearsals, config.digest_max_tokens, shown) for item in prepared
    ]
    tasks = [rehearsal_task(item.task, item.opening, text) for item, text in zip(prepared, accounts, strict=True)]
    out = unfold(
      tasks,
      policy,
      tokenizer,
      ucfg,
      jax.random.fold_in(key, n),
      reference_sampler=reference_sampler,
      histories=[() if t.user_turns else h for t, h in zip(tasks, histories, strict=True)],
    )
    costs["rehearsal"].add_unfold(out.stats)
    g = ucfg.group_size
    pairs = []
    for p, item in enumerate(prepared):
      for s in range(g):
        item.rehearsals.append(Rehearsal(out.trajectories[p * g + s], account=accounts[p]))
        pairs.append((p, len(item.rehearsals) - 1))
    _assess(
      prepared, pairs, policy, tokenizer, config, jax.random.fold_in(key, _ASSESS_STREAM + n), costs["assessment"]
    )
  _memorize(prepared, policy, tokenizer, config, jax.random.fold_in(key, _MEMORY_STREAM), costs["memory"])


def commit(
  prepared: Sequence[Prepared],
  policy,
  tokenizer: Tokenizer,
  unfold_config: UnfoldConfig,
  key: jax.Array,
  envs: Sequence[ToolEnv],
  *,
  reference_sampler=None,
  user_simulator: UserSimulator | None = None,
  cost: PhaseCost | None = None,
) -> list[Trajectory]:
  """The committed execution of every item: ACT with its memory, the real tools (``envs``, one per item, reset
  here), the real user simulator, continuing from the opening. One batched rollout (G = 1 per item).

  Returns:
    one `Trajectory` per item, in order (its task is ``Prepared.committed_task``); unscored.
  """
  ucfg = dataclasses.replace(unfold_config, env_mode="real", group_size=1)
  tasks = [item.committed_task for item in prepared]
  out = unfold(
    tasks,
    policy,
    tokenizer,
    ucfg,
    key,
    reference_sampler=reference_sampler,
    envs=list(envs),
    user_simulator=user_simulator,
    histories=[item.opening for item in prepared],
  )
  if cost is not None:
    cost.add_unfold(out.stats)
  return out.trajectories


@dataclasses.dataclass
class PrivateRun:
  """What `run` returns: the items (task-major, trial-minor), their committed trajectories and the phase costs."""

  prepared: list[Prepared]
  committed: list[Trajectory]
  costs: dict[str, PhaseCost]


def run(
  tasks: Sequence[Task],
  policy,
  tokenizer: Tokenizer,
  unfold_config: UnfoldConfig,
  config: PrivateRehearsalConfig,
  key: jax.Array,
  envs: Sequence[ToolEnv],
  *,
  num_trials: int = 1,
  reference_sampler=None,
  user_simulator: UserSimulator | None = None,
) -> PrivateRun:
  """Opening, private rehearsal (``config.mode``), memory and committed execution of ``num_trials`` trials per task.

  The opening's user is the evaluation's (``unfold_config.user_mode``: the reference sampler, the policy, or an
  external ``user_simulator``); its key is the same whatever the mode, so every mode starts from the same first
  messages.

  Args:
    envs: one real `ToolEnv` per (task, trial), task-major; only the committed execution touches them.

  Raises:
    PrivateRehearsalError: a missing sampler for a user; ``envs`` not one per (task, trial).
  """
  n = len(tasks) * num_trials
  if len(envs) != n:
    raise PrivateRehearsalError(f"run needs one ToolEnv per (task, trial): {n}, got {len(envs)}")
  costs = {name: PhaseCost() for name in ("opening", "rehearsal", "assessment", "memory", "execution")}
  user_mode = unfold_config.user_mode
  user_sampler = {"reference": reference_sampler, "policy": sampler_for(policy, Role.ACT)}.get(user_mode)
  heads = openings(
    tasks,
    num_trials,
    tokenizer,
    unfold_config,
    jax.random.fold_in(key, _OPENING_STREAM),
    user_sampler=user_sampler,
    user_simulator=user_simulator if user_mode == "external" else None,
    cost=costs["opening"],
  )
  prepared = [
    Prepared(task, trial, heads[b * num_trials + trial]) for b, task in enumerate(tasks) for trial in range(num_trials)
  ]
  rehearse(
    prepared,
    policy,
    tokenizer,
    unfold_config,
    config,
    jax.random.fold_in(key, _REHEARSAL_STREAM),
    reference_sampler=reference_sampler,
    costs=costs,
  )
  committed = commit(
    prepared,
    policy,
    tokenizer,
    unfold_config,
    jax.random.fold_in(key, _COMMIT_STREAM),
    envs,
    reference_sampler=reference_sampler,
    user_simulator=user_simulator,
    cost=costs["execution"],
  )
  return PrivateRun(prepared, committed, costs)


def summary_costs(costs: Mapping[str, PhaseCost]) -> dict[str, float]:
  """Flat metrics: ``cost/<phase>/{generated_tokens,prefill_tokens,seconds}``."""
  out: dict[str, Any] = {}
  for phase, c in costs.items():
    for field in ("generated_tokens", "prefill_tokens", "seconds"):
      out[f"cost/{phase}/{field}"] = float(getattr(c, field))
  return out
