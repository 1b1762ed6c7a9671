"""One self-unfolded trajectory, host side: the rollout's configuration and what each generation means.

`Episode` holds a trajectory in flight: its views (`views.View`, one per role that generates), the conversation
(`Trajectory.messages`) and whose generation is next. It renders the task's opening, turns each generation into
conversation (parse ACT output, check rehearsed JSON, read user stop markers, execute real tool calls in real mode),
and records faults and terminations on the trajectory; it never raises on model output. The batched device side
(continuous batching or lockstep rounds) lives in `unfold.py`.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from envace_jax.config import defaults
from envace_jax.config.choices import (
  ACT_PARSERS,
  ENV_MODES,
  INVALID_REHEARSAL_POLICIES,
  MALFORMED_POLICIES,
  PARALLEL_REHEARSALS,
  REHEARSAL_FORMATS,
  REHEARSE_CONTEXTS,
  REHEARSED_ERROR_POLICIES,
  USER_MODES,
)
from envace_jax.envs import registry
from envace_jax.envs.base import ChatMessage, Task, ToolCall, ToolEnv
from envace_jax.model import tool_format
from envace_jax.model.roles import Role
from envace_jax.model.tokenizer import Message, Tokenizer
from envace_jax.rehearsal import views
from envace_jax.rehearsal.trajectory import Termination, Trajectory
from envace_jax.rehearsal.users import ExternalUserConfig
from envace_jax.sampling.sampler import SamplingParams
from envace_jax.sampling.stopping import FinishReason

ROLE_NAMES = {Role.ACT: "act", Role.REHEARSE: "rehearse", Role.USER: "user"}


class UnfoldConfigError(ValueError):
  """The rollout is misconfigured (bad `UnfoldConfig` value, missing sampler or environments)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class UnfoldConfig:
  """How a self-unfolded rollout runs. Validated at construction (`UnfoldConfigError`).

  The run settings are ``config.rollout``'s keys and ``group_size`` (G, ``config.train.group_size``), each explained
  once in ``envace_jax/config/defaults.py`` (no defaults here: `from_config` reads them); ``external_user`` is an
  `ExternalUserConfig` or None. The rest are fixed by the protocols:

  Attributes:
    greeting: the agent's fixed first message (τ²'s orchestrator sends "Hi! How can I help you today?") for tasks
      with a simulated user and no logged history; "" lets the user speak first.
    agent_stop_markers: texts in an ACT reply that end the trajectory with ``AGENT_STOP``.
    rehearse_prompt: the REHEARSE view's instructions (`views.REHEARSE_PROMPT`; with ``rehearsal_format=
      "execution_result"`` the default stands for `views.EXECUTION_RESULT_PROMPT`: `rehearse_instructions`).
    user_prompt: the USER view's system template with ``{scenario}`` and ``{stop_markers}`` (`views.USER_PROMPT`).
  """

  group_size: int
  max_turns: int
  act_max_new_tokens: int
  rehearse_max_new_tokens: int
  user_max_new_tokens: int
  act_sampling: SamplingParams
  rehearse_sampling: SamplingParams
  user_sampling: SamplingParams
  act_capacity: int
  rehearse_capacity: int
  user_capacity: int
  user_mode: str
  env_mode: str
  on_malformed: str
  act_parser: str
  on_invalid_rehearsal: str
  accept_error_text: bool
  rehearsal_format: str
  on_rehearsed_error: str
  rehearse_context: str
  parallel_rehearsal: str
  rehearse_instructions_file: str
  rehearse_think: bool
  grounding_max_tokens: int
  parallel_calls: bool
  rehearse_sees_dialogue: bool
  scenario_opening: bool
  external_user: ExternalUserConfig | None
  continuous_batching: bool
  kv_page_size: int
  kv_pages: int
  greeting: str = "Hi! How can I help you today?"
  agent_stop_markers: tuple[str, ...] = ()
  rehearse_prompt: str = views.REHEARSE_PROMPT
  user_prompt: str = views.USER_PROMPT

  def __post_init__(self):
    positive = ("group_size", "max_turns", "act_max_new_tokens", "rehearse_max_new_tokens", "user_max_new_tokens")
    for name in (*positive, "act_capacity", "rehearse_capacity", "user_capacity"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise UnfoldConfigError(f"UnfoldConfig.{name} must be a positive int, got {value!r}")
    flags = (
      "accept_error_text",
      "parallel_calls",
      "rehearse_sees_dialogue",
      "scenario_opening",
      "continuous_batching",
      "rehearse_think",
    )
    for name in flags:
      if not isinstance(getattr(self, name), bool):
        raise UnfoldConfigError(f"UnfoldConfig.{name} must be True or False, got {getattr(self, name)!r}")
    for name in ("kv_page_size", "kv_pages"):
      if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
        raise UnfoldConfigError(f"UnfoldConfig.{name} must be an int >= 0, got {getattr(self, name)!r}")
    if not isinstance(self.grounding_max_tokens, int) or self.grounding_max_tokens < -1:
      raise UnfoldConfigError(
        f"UnfoldConfig.grounding_max_tokens must be an int >= -1, got {self.grounding_max_tokens!r}"
      )
    choices = {
      "user_mode": USER_MODES,
      "env_mode": ENV_MODES,
      "on_malformed": MALFORMED_POLICIES,
      "act_parser": ACT_PARSERS,
      "on_invalid_rehearsal": INVALID_REHEARSAL_POLICIES,
      "rehearsal_format": REHEARSAL_FORMATS,
      "on_rehearsed_error": REHEARSED_ERROR_POLICIES,
      "rehearse_context": REHEARSE_CONTEXTS,
      "parallel_rehearsal": PARALLEL_REHEARSALS,
    }
    for name, valid in choices.items():
      if getattr(self, name) not in valid:
        raise UnfoldConfigError(f"UnfoldConfig.{name}={getattr(self, name)!r}; valid: {', '.join(valid)}")
    for name in ("act_sampling", "rehearse_sampling", "user_sampling"):
      if not isinstance(getattr(self, name), SamplingParams):
        raise UnfoldConfigError(f"UnfoldConfig.{name} must be a SamplingParams, got {getattr(self, name)!r}")
    try:
      self.user_prompt.format(scenario="", stop_markers="")
    except (KeyError, IndexError, ValueError) as e:
      raise UnfoldConfigError(
        f"UnfoldConfig.user_prompt must format with {{scenario}} and {{stop_markers}}: {e}"
      ) from e
    if self.parallel_rehearsal == "independent" and self.rehearse_context == "trajectory":
      raise UnfoldConfigError(
        "UnfoldConfig.parallel_rehearsal='independent' needs rehearse_context='per_call' (one append-only REHEARSE "
        "view shows every earlier response)"
      )
    if not isinstance(self.rehearse_instructions_file, str) or (
      self.rehearse_instructions_file and not os.path.isfile(self.rehearse_instructions_file)
    ):
      raise UnfoldConfigError(
        f"UnfoldConfig.rehearse_instructions_file={self.rehearse_instructions_file!r} is not a readable file"
      )
    if not isinstance(self.agent_stop_markers, tuple) or not all(self.agent_stop_markers):
      raise UnfoldConfigError("UnfoldConfig.agent_stop_markers must be a tuple of non-empty strings")

  @classmethod
  def from_config(cls, config=None, **overrides) -> UnfoldConfig:
    """``config.rollout`` with ``group_size = config.train.group_size``, then ``overrides`` (field: value); config
    None: the defaults.

    Raises:
      UnfoldConfigError: an unknown key or an invalid value.
    """
    c = defaults.or_defaults(config)
    return cls.from_dict({**c.rollout.to_dict(), "group_size": c.train.group_size, **overrides})

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> UnfoldConfig:
    """From plain data (e.g. ``ConfigDict.to_dict()``): sampling params and ``external_user`` as mappings.

    Raises:
      UnfoldConfigError: an unknown key or an invalid value.
    """
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
      raise UnfoldConfigError(f"unknown UnfoldConfig keys {unknown}; valid: {', '.join(sorted(known))}")
    kw = dict(d)
    for name in ("act_sampling", "rehearse_sampling", "user_sampling"):
      if isinstance(kw.get(name), Mapping):
        kw[name] = SamplingParams(**kw[name])
    if isinstance(kw.get("external_user"), Mapping):
      kw["external_user"] = ExternalUserConfig(**kw["external_user"])
    if "agent_stop_markers" in kw:
      kw["agent_stop_markers"] = tuple(kw["agent_stop_markers"])
    return cls(**kw)

  def rehearse_instructions(self) -> str:
    """The REHEARSE view's instructions: the content of ``rehearse_instructions_file`` when set (trailing whitespace
    stripped); else ``rehearse_prompt``, or for ``rehearsal_format="execution_result"`` with the default prompt our
    instructions for that contract (`views.EXECUTION_RESULT_PROMPT`)."""
    if self.rehearse_instructions_file:
      with open(self.rehearse_instructions_file, encoding="utf-8") as f:
        return f.read().rstrip()
    if self.rehearsal_format == "execution_result" and self.rehearse_prompt == views.REHEARSE_PROMPT:
      return views.EXECUTION_RESULT_PROMPT
    return self.rehearse_prompt

  def capacity(self, role: Role) -> int:
    return {Role.ACT: self.act_capacity, Role.REHEARSE: self.rehearse_capacity, Role.USER: self.user_capacity}[role]

  def max_new_tokens(self, role: Role) -> int:
    return {Role.ACT: self.act_max_new_tokens, Role.REHEARSE: self.rehearse_max_new_tokens}.get(
      role, self.user_max_new_tokens
    )

  def sampling(self, role: Role) -> SamplingParams:
    return {Role.ACT: self.act_sampling, Role.REHEARSE: self.rehearse_sampling}.get(role, self.user_sampling)

  def stop_strings(self, role: Role) -> tuple[str, ...]:
    """Stop strings of a role's generations (besides the tokenizer's eos ids). REHEARSE with ``execution_result`` has
    none, as officially: a closing tag inside a ``<think>`` span must not end the generation."""
    if role == Role.ACT:
      return () if self.parallel_calls else (tool_format.TOOL_CALL_CLOSE,)
    if role == Role.REHEARSE and self.rehearsal_format == "tool_response":
      return (tool_format.TOOL_RESPONSE_CLOSE,)
    return ()


class Episode:
  """One trajectory in flight.

  Attributes:
    index: the trajectory's index in the rollout batch (b*G + g).
    traj: the `Trajectory` being filled.
    views: the token views, by role (ACT; REHEARSE in rehearse mode; USER when a sampler plays the user).
    user_chat: with an external user: the USER view's messages (no tokens); else None.
    need: the role whose generation is next; None once ended.
    calls: calls of the last ACT message still to be rehearsed, in order.
    env: the real environment (real mode).
    finished: with ``rehearse_context="per_call"``: the REHEARSE views of the calls answered before the current one
      (each its own training row, `Trajectory.extra_rows`).
    rewind: role -> the tokens its cache row must hold before its next prompt goes out (the view was replaced by a
      fresh copy of its opening: a per-call REHEARSE view); the rollout loop pops it when it places the job.
  """

  def __init__(self, config: UnfoldConfig, index: int, traj: Trajectory, act_view: views.View):
    self.config, self.index, self.traj = config, index, traj
    self.views: dict[Role, views.View] = {Role.ACT: act_view}
    self.user_chat: list[Message] | None = None
    self.need: Role | None = None
    self.calls: collections.deque[ToolCall] = collections.deque()
    self.next_user_turn = 0
    self.env: ToolEnv | None = None
    self.call_count = 0
    self.gate = None  # (trajectory, finished turn) -> Termination | None before the next logged user turn
    self.finished: list[views.View] = []
    self.rewind: dict[Role, int] = {}
    self.rehearse_opening: views.View | None = None  # per_call: the REHEARSE view before its first call
    self.grounding = ""  # per_call: the grounding block each call's prompt shows
    self.act_text = ""  # the ACT generation whose calls are being rehearsed, as sampled
    self.call_message = 0  # its index in traj.messages
    self.held: list[tuple[ToolCall, str, bool]] = []  # parallel_rehearsal="independent": this message's results
    self.failure: str | None = None  # independent: why the trajectory ends after the message's last call

  @property
  def live(self) -> bool:
    return self.traj.termination is None

  @classmethod
  def opening(
    cls,
    config: UnfoldConfig,
    task: Task,
    group: int,
    tokenizer: Tokenizer,
    chat_format: views.ChatFormat,
    user_view: bool,
    history: tuple[ChatMessage, ...] = (),
  ) -> Episode:
    """The state every trajectory of ``task`` starts from: views rendered up to the first sampled token.

    Args:
      user_view: a sampler plays the user (a USER token view); otherwise an external user (``user_chat``).
      history: as `unfold`'s ``histories`` for this task. A history ending with a user message that holds a stop
        marker ends the trajectory at once (``USER_STOP``).

    Raises:
      UnfoldConfigError: the task has neither logged user turns nor a user scenario; a history for a task whose
        user turns are logged (they are replayed from the first).
    """
    if not task.user_turns and not task.user_scenario:
      raise UnfoldConfigError(f"task {task.id!r} has neither logged user_turns nor a user_scenario to simulate")
    if history and task.user_turns:
      raise UnfoldConfigError(f"task {task.id!r} replays logged user turns: it cannot start from a given history")
    history = list(registry.initial_conversation(task)) + list(history)
    traj = Trajectory(task, group, 0, list(history))
    act = views.View(tokenizer, chat_format, Role.ACT, task.tools)
    act.append(Message("system", task.system_prompt), *[m for c in history for m in views.act_messages(c)])
    ep = cls(config, 0, traj, act)
    if config.env_mode == "rehearse":
      fmt = config.rehearsal_format
      grounding, kept, dropped = views.grounding_block(task, tokenizer, config.grounding_max_tokens, fmt)
      traj.count("grounding_kept", kept)
      traj.count("grounding_dropped", dropped)
      rehearse = views.View(tokenizer, chat_format, Role.REHEARSE, None)
      if config.rehearse_context == "per_call":  # the instructions alone; each call's data in its own prompt
        rehearse.append(Message("system", config.rehearse_instructions()))
        ep.grounding = grounding
      else:
        system = views.rehearse_system_prompt(task, config.rehearse_instructions(), grounding)
        dialogue = config.rehearse_sees_dialogue
        rehearse.append(Message("system", system), *views.rehearse_history(history, dialogue, fmt))
      ep.views[Role.REHEARSE] = rehearse
    if task.user_turns:
      ep.user_turn()
      return ep
    opening = [Message("system", views.user_system_prompt(task, config.user_prompt))]
    opening += [m for c in history for m in views.user_messages(c)]
    if user_view:
      ep.views[Role.USER] = views.View(tokenizer, chat_format, Role.USER, None)
      ep.views[Role.USER].append(*opening)
    else:
      ep.user_chat = opening
    markers = task.user_stop_markers or views.DEFAULT_STOP_MARKERS
    if history and history[-1].role == "user" and any(m in history[-1].content for m in markers):
      ep.end(Termination.USER_STOP, detail="the given history ends with the user's stop marker")
    elif history:
      ep.need = Role.ACT if history[-1].role in ("user", "tool") else Role.USER
    else:
      if config.greeting:
        ep.share(ChatMessage("assistant", config.greeting))
      ep.need = Role.USER
      if config.scenario_opening:  # every view, the USER view included (as the user's own message), shows it
        ep.share(ChatMessage("user", task.user_scenario))
        ep.traj.count("scenario_opening")
        ep.need = Role.ACT
    return ep

  def copy(self, index: int, sample: int) -> Episode:
    """Trajectory ``sample`` of the group, starting from this opening (views copied, cache bookkeeping included)."""
    t = self.traj
    other = Episode(self.config, index, Trajectory(t.task, t.group, sample, list(t.messages)), self.views[Role.ACT])
    other.traj.counts, other.traj.events, other.traj.termination = dict(t.counts), list(t.events), t.termination
    other.views = {role: view.copy() for role, view in self.views.items()}
    other.user_chat = list(self.user_chat) if self.user_chat is not None else None
    other.need, other.next_user_turn = self.need, self.next_user_turn
    other.grounding, other.rehearse_opening = self.grounding, self.rehearse_opening
    return other

  def generation_index(self, role: Role) -> int:
    """How many generations of ``role`` this trajectory has recorded (its finished per-call views' included): the
    index of its next one, which keys its sample (`unfold._job_keys`)."""
    return sum(v.generations for v in self.finished if v.role == role) + self.views[role].generations

  def share(self, message: ChatMessage, generated_by: Role | None = None) -> None:
    """Appends a conversation message to the trajectory and to every view that shows it, except the view of
    ``generated_by``, which holds it already (as generated)."""
    self.traj.messages.append(message)
    if generated_by != Role.ACT:
      self.views[Role.ACT].append(*views.act_messages(message))
    if Role.REHEARSE in self.views and self.config.rehearse_context == "trajectory":
      self.views[Role.REHEARSE].append(*views.rehearse_messages(message, self.config.rehearse_sees_dialogue))
    user_side = views.user_messages(message) if not self.traj.task.user_turns else []
    if Role.USER in self.views:
      if generated_by != Role.USER:
        self.views[Role.USER].append(*user_side)
    elif self.user_chat is not None:
      self.user_chat += user_side

  def user_turn(self) -> None:
    """Replays the next logged user turn, or ends the trajectory when none is left, or when ``gate`` (the
    required-item gate, `scoring.turn_gate`) ends it after the turn just finished."""
    turns = self.traj.task.user_turns
    if self.next_user_turn >= len(turns):
      self.end(Termination.USER_TURNS_DONE)
      return
    stop = self.gate(self.traj, self.next_user_turn - 1) if self.gate and self.next_user_turn else None
    if stop is not None:
      self.end(stop, turn=self.next_user_turn - 1)
      return
    self.share(ChatMessage("user", turns[self.next_user_turn]))
    self.next_user_turn += 1
    self.traj.count("user_turns")
    self.need = Role.ACT

  def observe(self, call: ToolCall, text: str, is_error: bool) -> None:
    """A tool result (rehearsed or real) for ``call``: in the conversation, and to the agent as an OBSERVATION."""
    self.traj.messages.append(ChatMessage("tool", text, tool_call_id=call.id, name=call.name, is_error=is_error))
    self.views[Role.ACT].append(Message("tool", text, author=Role.OBSERVATION))

  def end(self, reason: Termination, **event: Any) -> None:
    """Ends the trajectory with ``reason``; ``event`` is logged with it."""
    self.traj.termination, self.need = reason, None
    self.traj.events.append({"type": "end", "termination": reason.value, **event})

  # ------------------------------------------------------------------------------------------------ outputs

  def after_act(self, content: str) -> None:
    """Parses an ACT message: a malformed one is recorded; calls go to REHEARSE or the real env; a reply to the user."""
    traj, task = self.traj, self.traj.task
    out = views.parse_act(content, task.tool_names, self.config.parallel_calls, self.config.act_parser)
    if out.error is not None:
      traj.count("malformed_act")
      if out.error.kind == tool_format.ParseErrorKind.UNKNOWN_TOOL:
        traj.count("unknown_tool")
      event = {"type": "malformed_act", "kind": out.error.kind.value, "message": out.error.message, "raw": content}
      traj.events.append(event)
      traj.messages.append(ChatMessage("assistant", content))
      if self.config.on_malformed == "end":
        self.end(Termination.MALFORMED, kind=out.error.kind.value)
      else:
        self.views[Role.ACT].append(Message("tool", f"Error: {out.error.message}", author=Role.OBSERVATION))
        self.need = Role.ACT
      return
    if out.calls:
      calls = []
      for c in out.calls:
        calls.append(ToolCall(c.name, c.arguments, id=f"call_{self.call_count}"))
        self.call_count += 1
      traj.count("tool_calls", len(calls))
      if unknown := sum(c.name not in task.tool_names for c in calls):  # let through by the official parser
        traj.count("unknown_tool", unknown)
      self.share(ChatMessage("assistant", out.reply, tool_calls=tuple(calls)), generated_by=Role.ACT)
      if self.config.env_mode == "real":
        for call in calls:
          obs = self.env.execute(call)
          self.observe(call, obs.text, obs.is_error)
        self.need = Role.ACT
      else:
        self.calls.extend(calls)
        self.call_message, self.act_text = len(traj.messages) - 1, content
        self.rehearse_next()
        self.need = Role.REHEARSE
      return
    if not out.reply:
      traj.count("empty_reply")
    self.share(ChatMessage("assistant", out.reply), generated_by=Role.ACT)
    if any(m in out.reply for m in self.config.agent_stop_markers):
      self.end(Termination.AGENT_STOP)
    elif task.user_turns:
      self.user_turn()
    else:
      self.need = Role.USER

  def rehearse_next(self) -> None:
    """Puts the next pending call (``calls[0]``) before REHEARSE: with ``rehearse_context="trajectory"`` as a message
    appended to its view; with ``"per_call"`` as a fresh view, the opening (the instructions) and
    `views.per_call_prompt` (the previous call's view, if any, is kept in ``finished`` and its cache row rewound:
    ``rewind``)."""
    call, cfg = self.calls[0], self.config
    if cfg.rehearse_context == "trajectory":
      message = views.rehearse_call(call.name, call.arguments)
      if cfg.rehearse_think:
        message = dataclasses.replace(message, content=message.content + "\n\n" + views.THINK_SWITCH)
      self.views[Role.REHEARSE].append(message)
      return
    view = self.views[Role.REHEARSE]
    if self.rehearse_opening is None:
      self.rehearse_opening = view.copy()  # no call rehearsed yet: the view holds its opening only
    if view.generations:
      self.finished.append(view)
      view = self.views[Role.REHEARSE] = self.rehearse_opening.copy()
      self.rewind[Role.REHEARSE] = view.cached
    # The conversation without the calls' message (its raw text is a section of its own); with "sequential" the
    # results of its earlier calls follow (with "independent" they are held back until its last call is answered).
    messages, dialogue = self.traj.messages, cfg.rehearse_sees_dialogue
    history = messages[: self.call_message] + messages[self.call_message + 1 :] if dialogue else None
    prompt = views.per_call_prompt(
      self.traj.task,
      call.name,
      call.arguments,
      grounding=self.grounding,
      history=history,
      latest=self.act_text if dialogue else None,
      think=cfg.rehearse_think,
    )
    view.append(Message("user", prompt))

  def after_rehearse(self, content: str) -> None:
    """Checks a rehearsed response (``rehearsal_format``'s contract) and shows it to the agent as the pending call's
    observation. An invalid one ends the trajectory with ``on_invalid_rehearsal="end"``, a valid one reporting a
    failed call with ``on_rehearsed_error="end"`` (``MALFORMED``; the observation is in the conversation). With
    ``parallel_rehearsal="independent"`` the results of one message's calls reach the agent together, after its last
    call is rehearsed, and only then does such an end take effect (official: envs.py, ``AWAIT_SIMULATOR``)."""
    cfg = self.config
    call = self.calls.popleft()
    response = views.parse_rehearsal(content, cfg.accept_error_text, cfg.rehearsal_format)
    text, is_error = response.content, response.is_error
    if not response.valid:
      self.traj.count("invalid_rehearsed_json")
      event = {"type": "invalid_rehearsal", "reason": response.reason, "raw": content, "call": call.name}
      self.traj.events.append({**event, "code": response.code} if response.code else event)
      if cfg.on_invalid_rehearsal == "error" and cfg.rehearsal_format == "tool_response":
        text, is_error = f"Error: the tool returned an invalid response ({response.reason})", True
    elif response.is_error:
      self.traj.count("rehearsed_errors")
    failure = None
    if not response.valid and cfg.on_invalid_rehearsal == "end":
      failure = "invalid_rehearsal"
    elif response.valid and response.is_error and cfg.on_rehearsed_error == "end":
      failure = "rehearsed_error"
    if cfg.parallel_rehearsal == "independent":
      self.held.append((call, text, is_error))
      self.failure = self.failure or failure
      if self.calls:
        self.rehearse_next()
        return
      for held in self.held:
        self.observe(*held)
      self.held, failure, self.failure = [], self.failure, None
    else:
      self.observe(call, text, is_error)
    if failure is not None:
      self.end(Termination.MALFORMED, kind=failure)
    elif self.calls:
      self.rehearse_next()
    else:
      self.need = Role.ACT

  def after_user(self, content: str) -> None:
    """Reads a user message (generated, or an external user's reply): a stop marker ends the trajectory."""
    text = content.strip()
    message = ChatMessage("user", text)
    markers = self.traj.task.user_stop_markers or views.DEFAULT_STOP_MARKERS
    if any(m in text for m in markers):
      self.traj.messages.append(message)
      self.end(Termination.USER_STOP)
      return
    self.share(message, generated_by=Role.USER)
    self.need = Role.ACT

  def record(self, role: Role, ids: list[int], logprobs, finish: FinishReason, eos_ids) -> None:
    """Records a generation of ``role`` (int[T] ids and float[T] logprobs exactly as sampled) and moves on."""
    name = ROLE_NAMES[role]
    view = self.views[role]
    content = view.record(ids, logprobs, eos_ids)
    self.traj.count(f"generations_{name}")
    self.traj.count(f"tokens_{name}", len(ids))
    if finish == FinishReason.CONTEXT_EXHAUSTED or view.cached >= self.config.capacity(role):
      if role == Role.ACT:
        self.traj.messages.append(ChatMessage("assistant", content))  # unparsed: nothing of it is executed
      self.end(Termination.CONTEXT_EXHAUSTED, view=name, detail="the view filled up while generating")
      return
    if finish == FinishReason.LENGTH:
      self.traj.count(f"truncated_{name}")
    {Role.ACT: self.after_act, Role.REHEARSE: self.after_rehearse, Role.USER: self.after_user}[role](content)
