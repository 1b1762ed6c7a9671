"""Demonstrations for the supervised warm-up: a benchmark's reference conversation as training rows of both roles.

``train.sft_warmup_steps`` trains ACT on the task's gold tool calls (τ²'s ``gold_actions``, BFCL's ground truth),
then the information the task requires the agent to communicate, and REHEARSE on the real tools' responses to those
calls (each gold call executed on a fresh real environment, ``ToolEnv.answer``).

`demonstration` replays such a conversation through the rollout's own bookkeeping (`Episode`): the opening, the
views, the chat template's framing, the parsing of each message are exactly those of a self-unfolded rollout, and
each demonstrated message is recorded as if the sampler had generated its tokens. So a demonstration's
`TrainingRow`s have the same layout as a rollout's (prompt tokens with the view's roles, loss mask on the role's own
generations) and go through the same `grpo.build_batch` and update step.

A demonstration has no user simulator: for a task whose user speaks first from a scenario (most of τ²'s), the
scenario stands in for the user's first message (τ²'s user simulator is instructed from the same text).
"""

from __future__ import annotations

from collections.abc import Sequence

from envace_jax.envs import registry
from envace_jax.envs.base import ChatMessage, EnvError, RewardInfo, Task, ToolEnv
from envace_jax.model.roles import Role
from envace_jax.model.tokenizer import Tokenizer
from envace_jax.rehearsal import views
from envace_jax.rehearsal.episode import Episode, UnfoldConfig
from envace_jax.rehearsal.trajectory import Termination, Trajectory
from envace_jax.sampling.stopping import FinishReason


def _one_call_per_message(messages: Sequence[ChatMessage]) -> list[ChatMessage]:
  """Assistant messages with several calls split into one message per call, each followed by its result (the text
  stays on the first), as a rollout without ``parallel_calls`` writes them."""
  out, i = [], 0
  while i < len(messages):
    m = messages[i]
    n = len(m.tool_calls) if m.role == "assistant" else 0
    results = messages[i + 1 : i + 1 + n]
    if n <= 1 or len(results) < n or any(r.role != "tool" for r in results):
      out.append(m)
      i += 1
      continue
    for k, (call, result) in enumerate(zip(m.tool_calls, results, strict=True)):
      out += [ChatMessage("assistant", m.content if k == 0 else "", tool_calls=(call,)), result]
    i += 1 + n
  return out


def demonstration(
  config: UnfoldConfig,
  task: Task,
  conversation: Sequence[ChatMessage],
  tokenizer: Tokenizer,
  chat_format: views.ChatFormat,
  index: int,
  env: ToolEnv | None = None,
) -> Trajectory:
  """``conversation`` replayed as one trajectory of ``task`` whose assistant and tool messages the policy generated.

  The trajectory starts from the rollout's opening (``Episode.opening``; the user is not a token view). Then, in
  order: system messages and the task's initial conversation are skipped (the opening holds them); a user message is
  the next logged user turn (tasks with ``user_turns``) or the simulated user's message; an assistant message is an
  ACT generation (its text and ``<tool_call>`` blocks, one call per generation unless ``config.parallel_calls``); a
  tool message is a REHEARSE generation (the real result in ``config.rehearsal_format``, `views.render_rehearsal`) in
  rehearse mode, and in real mode
  ``env`` answers the call instead. Generated tokens are ``tokenizer.encode`` of the message as the role writes it,
  plus the eos where a sampled message would end with one (replies; not calls or responses, which end at their stop
  string). Their logprobs are 0 (there was no sampler): callers recompute them.

  Args:
    config: the rollout's `UnfoldConfig` (env_mode, capacities, greeting, parallel_calls).
    conversation: its reference conversation (`registry.Benchmark.reference_conversation`).
    tokenizer, chat_format: as the rollout uses them.
    index: the trajectory's index in the batch (``TrainingRow.trajectory``; also its group).
    env: env_mode="real" only: the real environment that answers the calls (reset here).
  Returns:
    A `Trajectory` with ``rows`` for ACT (and REHEARSE in rehearse mode), reward 1.0 (a demonstration is the target)
    and ``counts["demonstration_messages"]``; it ends with the conversation (``USER_STOP`` / ``USER_TURNS_DONE`` /
    ``AGENT_STOP``), or with ``CONTEXT_EXHAUSTED`` when the next message would not fit its view (the rest is dropped).
  Raises:
    EnvError: env_mode="real" without ``env``.
  """
  if config.env_mode == "real" and env is None:
    raise EnvError("demonstration: env_mode='real' needs the real environment that answers the calls")
  ep = Episode.opening(config, task, index, tokenizer, chat_format, user_view=False)
  ep.index = index
  if env is not None and config.env_mode == "real":
    env.reset(task)
    ep.env = env
  eos = next(iter(chat_format.close_after_eos), None)
  eos_ids = tuple(tokenizer.eos_ids)
  skip = len(registry.initial_conversation(task))
  messages = [m for m in list(conversation)[skip:] if m.role != "system"]
  if not config.parallel_calls:
    messages = _one_call_per_message(messages)
  user_seen = 0
  if messages and messages[0].role == "assistant" and not task.user_turns and task.user_scenario and ep.live:
    if ep.need == Role.USER:  # a simulated user speaks first: the scenario stands in for its first message
      ep.after_user(task.user_scenario)

  def generate(role: Role, text: str, ends_with_eos: bool) -> bool:
    ids = tokenizer.encode(text) + ([eos] if ends_with_eos and eos is not None else [])
    view = ep.views[role]
    if len(view) + len(chat_format.header) + len(ids) > config.capacity(role):
      ep.end(Termination.CONTEXT_EXHAUSTED, view=role.name.lower(), detail="the demonstration does not fit the view")
      return False
    ep.record(role, ids, [0.0] * len(ids), FinishReason.STOP, eos_ids)
    ep.traj.count("demonstration_messages")
    return True

  for message in messages:
    if not ep.live:
      break
    if message.role == "user":
      if task.user_turns:
        user_seen += 1
        if user_seen > ep.next_user_turn:  # the episode replays logged turns itself: the opening did the first
          ep.user_turn()
      else:
        ep.after_user(message.content)
    elif message.role == "assistant":
      is_call = bool(message.tool_calls)
      if not generate(Role.ACT, views.assistant_content(message), ends_with_eos=not is_call or config.parallel_calls):
        break
    elif message.role == "tool" and config.env_mode == "rehearse":
      if not ep.calls:  # a result without a pending call (cannot happen for the oracles' conversations)
        continue
      response = views.render_rehearsal(message.content, config.rehearsal_format)  # execution_result: ends at eos
      if not generate(Role.REHEARSE, response, ends_with_eos=config.rehearsal_format == "execution_result"):
        break
  if ep.live:  # the conversation ended without a stop (e.g. BFCL's last turn): its logged turns are done
    ep.end(Termination.USER_TURNS_DONE if task.user_turns else Termination.AGENT_STOP)
  traj = ep.traj
  traj.counts["turns"] = ep.views[Role.ACT].generations
  traj.counts["unencodable_chars"] = sum(view.unencodable for view in ep.views.values())
  traj.rows = {int(role): view.training_row(index) for role, view in ep.views.items() if view.generations}
  traj.extra_rows = [view.training_row(index) for view in ep.finished]
  traj.reward = RewardInfo(reward=1.0, info={"demonstration": True})
  return traj
