"""The testbed: generated multi-turn tasks over BFCL-v4's real executable tool classes, with held-out splits that say
what generalises, sized so that SmolLM2-135M on a CPU is off the floor (docs/testbed.md).

Why it exists. The real benchmarks (τ² airline/retail, BFCL-v4 multi-turn) are out of a 135M model's reach on a CPU:
every held-out number of experiments/evidence.py was 0. A small world where the method can be seen moving with many
seeds (in the spirit of gymnax's diagnostic environments or MinAtar) is an instrument, not a replacement for them.

What is real and what is generated:
- tools: the `bfcl-eval` backends `MessageAPI` and `TicketAPI`, their own function docs
  (`bfcl_eval/data/multi_turn_func_doc/`, with BFCL's Python hint, converted as `envs/bfcl.py` does), their own
  scenario loading (`_load_scenario`) and error responses. Execution and scoring are `bfcl.BfclEnv`'s: the package's
  `multi_turn_checker` (state + execution-response checks after every turn) against the generated ground truth.
- generated: the initial state (users and their ids, sent messages, tickets), the user's request per turn (several
  phrasings per step), the gold calls (executed on the real classes when the task is made: a gold call that errs where
  the step expects success, or succeeds where it expects the tool's error, is a generator bug and raises) and what the
  agent must tell the user (`Task.communicate_info`, scored by τ²'s rule, `rl.rewards.info_communicated`).

A task is one or more user turns; each turn is one *step* (`STEPS`): a request, its gold calls, its answer. Some
steps need a value from an earlier response (the recipient's user id, the id of the ticket just created: the world
model matters); the rule steps (`RULE_STEPS`) meet a precondition that fails, and their gold route is the tool's
error and a report of it, or a different route (log in first).

Splits (`SPLITS`), each deterministic from (level, split, index):
- ``train``: the seen steps, alone and in pairs within one tool class, over the training entities (names, message
  texts, ticket titles; user ids USR100–USR549, ticket ids 100–549);
- ``iid``: the same templates over held-out entities (other names and texts, ids 550–999);
- ``compositional``: pairs of seen steps across the two classes (a messaging step and a ticket step), never paired
  in training, over held-out entities;
- ``rules``: the rule steps (never trained on), alone or after a seen step, over held-out entities.
`split_signature` gives each task's template and entities; tests/envs/test_testbed.py checks the disjointness.

Levels (`LEVELS`): the difficulty knob (turns per task, which schemas are shown, distractor tools). ``cpu`` shows the
task's own functions plus one distractor, 1–2 turns and at most 4 ACT generations; ``full`` shows both classes'
whole function lists and up to 3 turns.

Reward. `TestbedEnv.evaluate` is 1.0 when BFCL's checker passes *and* every `communicate_info` string was told to the
user; its breakdown has both. Training without the real tools scores the same tasks with the rule checklist (gold
actions + communicate_info, `rl.rewards.rule_checklist`).

CLI:

  python -m envace_jax.envs.testbed --level=cpu --split=iid --oracle     # gold replay scored: N/N
  python -m envace_jax.envs.testbed --level=cpu --split=train --show=3   # three tasks, as the agent sees them
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import hashlib
import json
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from envace_jax.envs import bfcl
from envace_jax.envs.base import ChatMessage, EnvError, GoldAction, ReferenceInteraction, RewardInfo, Task, ToolCall
from envace_jax.rl.rewards import info_communicated

BENCHMARK = "testbed"
GENERATOR_VERSION = 1  # bump when a change alters generated tasks (prepared datasets are versioned by it)
SPLITS = ("train", "iid", "compositional", "rules")
HELDOUT_SPLITS = SPLITS[1:]
CLASSES = ("MessageAPI", "TicketAPI")

SYSTEM_PROMPT = (
  "You are an assistant that operates a workspace's messaging and ticketing tools for the user. Use the tools to do "
  "what the user asks, one call at a time, and then tell the user the result in one short sentence. If a tool "
  "returns an error, do not pretend it worked: tell the user what went wrong."
)


@dataclasses.dataclass(frozen=True)
class Level:
  """One difficulty level (the registry's ``env.domain`` of the testbed).

  Attributes:
    name: the level's name.
    max_turns: user turns per task, at most (pairs of steps need 2).
    max_act: ACT generations per task, at most (a call or a reply each); longer combinations are not generated.
    schemas: "task": the functions the task's gold calls use, plus ``distractors`` other functions of the same
      classes; "class": every function of the involved classes.
    distractors: extra functions shown with ``schemas="task"``.
    sizes: tasks per split.
  """

  name: str
  max_turns: int
  max_act: int
  schemas: str
  distractors: int
  sizes: Mapping[str, int]


LEVELS: dict[str, Level] = {
  "cpu": Level("cpu", max_turns=2, max_act=4, schemas="task", distractors=1,
               sizes={"train": 2000, "iid": 320, "compositional": 320, "rules": 320}),
  "full": Level("full", max_turns=3, max_act=12, schemas="class", distractors=0,
                sizes={"train": 4000, "iid": 320, "compositional": 320, "rules": 320}),
}  # fmt: skip
DOMAINS = tuple(LEVELS)


# ---------------------------------------------------------------------------------------------------------------------
# Entities: disjoint pools for training and held-out splits


_NAMES = (
  "Alice Bob Carol Dave Erin Frank Grace Heidi Ivan Judy Karl Laura Mallory Nina Oscar Peggy Quinn Rupert Sybil Trent "
  "Uma Victor Wendy Xavier Yvonne Zack Aaron Bella Caleb Diana Ethan Fiona George Hannah Isaac Julia Kevin Linda "
  "Marcus Naomi Owen Paula Ray Sara Tom Ursula Vera Walter Xena Yusuf Zoe Adrian Beatrice Cedric Daphne Edgar Flora "
  "Gavin Helena Igor Jasmine Kurt Leona Milo Nadia Otto Priya Reza Selma Tariq Ulla Vince Willa Yara Zeno Amir Bianca "
  "Conrad Delia Emil Freya Gustav Hilda Ingrid Jonas Kira Lars Maya Nils Olga Pavel Rosa Sven Thea Ugo Viola Wiktor "
  "Ximena Yosef Zara"
).split()
_TEXTS = (
  "The meeting moved to 3pm",
  "Please review the draft",
  "Lunch is on me today",
  "The build is green again",
  "Can you call me back",
  "Slides are in the shared folder",
  "Happy birthday",
  "The client signed the contract",
  "Remember the standup",
  "Your package arrived",
  "The server is back online",
  "Thanks for the quick fix",
  "Budget approved",
  "See you at the airport",
  "Invoice sent",
  "The demo went well",
  "Please update the wiki",
  "Parking lot is closed tomorrow",
  "New laptop is ready",
  "The report is due Friday",
  "Coffee at 10",
  "Interview moved to Monday",
  "Keys are at the front desk",
  "Printer on floor 2 is fixed",
  "Welcome to the team",
  "Quarterly goals are posted",
  "The release is postponed",
  "Fire drill at noon",
  "Pizza in the kitchen",
  "Timesheets are due",
  "Contract renewal is next week",
  "Training starts at 9",
)
_TITLES = (
  "Printer jam",
  "VPN drops",
  "Login fails",
  "Screen flickers",
  "Email bounce",
  "Slow wifi",
  "Broken chair",
  "Password reset",
  "Disk full",
  "Badge not working",
  "Monitor dead",
  "Keyboard sticky",
  "Projector offline",
  "License expired",
  "Backup failed",
  "Calendar sync",
  "Phone no tone",
  "Door lock stuck",
  "AC too cold",
  "Mouse lag",
  "Server alarm",
  "Sink leaking",
  "Lights flicker",
  "Update stuck",
  "Camera blurry",
  "Mic muted",
  "Fan noisy",
  "Cable missing",
  "Desk wobbly",
  "Toner empty",
  "Router reboot",
  "Laptop overheats",
)
_DESCRIPTIONS = (
  "since this morning",
  "on the third floor",
  "after the update",
  "for the whole team",
  "every few minutes",
  "in meeting room B",
  "since last week",
  "when I plug it in",
  "on my desk",
  "for new hires",
  "at the reception",
  "in the lab",
  "after lunch",
  "on the guest network",
  "in building 2",
  "during calls",
)
_RESOLUTIONS = (
  "Replaced the part",
  "Restarted the service",
  "Reset the settings",
  "Updated the driver",
  "Cleared the cache",
  "Swapped the cable",
  "Reinstalled the app",
  "Renewed the license",
  "Tightened the screws",
  "Refilled the toner",
  "Reconfigured the router",
  "Moved to a new desk",
)
_KEYWORDS = ("upload", "file", "report", "meeting", "draft", "invoice", "demo", "budget")


def _halves(pool: Sequence[Any]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
  """(training, held-out) halves of an entity pool: every third entry is held out."""
  return tuple(x for i, x in enumerate(pool) if i % 3 != 2), tuple(x for i, x in enumerate(pool) if i % 3 == 2)


POOLS: dict[str, dict[str, tuple[Any, ...]]] = {}
for _kind, _pool in (("name", _NAMES), ("text", _TEXTS), ("title", _TITLES), ("description", _DESCRIPTIONS),
                     ("resolution", _RESOLUTIONS)):  # fmt: skip
  POOLS.setdefault("train", {})[_kind], POOLS.setdefault("heldout", {})[_kind] = _halves(_pool)
ID_RANGES = {"train": (100, 549), "heldout": (550, 999)}  # user ids USRnnn and ticket ids


# ---------------------------------------------------------------------------------------------------------------------
# World: a generated initial state, and what the generator knows of it


@dataclasses.dataclass
class _World:
  """The generated state of one task, before any call, and the entities a step may pick."""

  rng: random.Random
  pool: Mapping[str, tuple[Any, ...]]
  ids: tuple[int, int]
  users: dict[str, str]  # name -> user id
  me: str  # the user's own name (a workspace member)
  logged_in: bool
  inbox: list[dict[str, str]]
  tickets: list[dict[str, Any]]
  ticket_user: str
  ticket_logged_in: bool
  user_count: int = 0
  used: set[Any] = dataclasses.field(default_factory=set)
  outsiders: list[str] = dataclasses.field(default_factory=list)  # names not in the workspace

  def pick(self, kind: str) -> Any:
    """An entity of ``kind`` not yet used in this task."""
    choices = [x for x in self.pool[kind] if x not in self.used]
    value = self.rng.choice(choices)
    self.used.add(value)
    return value

  def member(self, exclude: Sequence[str] = ()) -> str:
    name = self.rng.choice([n for n in self.users if n != self.me and n not in exclude and n not in self.used])
    self.used.add(name)
    return name

  def ticket(self, status: str | None = None) -> dict[str, Any]:
    candidates = [t for t in self.tickets if (status is None or t["status"] == status) and t["id"] not in self.used]
    ticket = self.rng.choice(candidates)
    self.used.add(ticket["id"])
    return ticket

  def scenario(self) -> dict[str, Any]:
    """The initial config of both classes, as BFCL's `initial_config` (JSON)."""
    return {
      "MessageAPI": {
        "user_count": self.user_count,
        "user_map": dict(self.users),
        "inbox": copy.deepcopy(self.inbox),
        "message_count": len(self.inbox),
        "current_user": self.users[self.me] if self.logged_in else None,
        "random_seed": self.rng.randrange(1, 10**6),
      },
      "TicketAPI": {
        "ticket_queue": copy.deepcopy(self.tickets),
        "ticket_counter": max(t["id"] for t in self.tickets) + 1,
        "current_user": self.ticket_user if self.ticket_logged_in else None,
      },
    }


def _new_world(rng: random.Random, pool_name: str) -> _World:
  pool = POOLS[pool_name]
  lo, hi = ID_RANGES[pool_name]
  names = rng.sample(pool["name"], 7)
  user_ids = rng.sample(range(lo, hi + 1), len(names))
  users = {n: f"USR{i}" for n, i in zip(names[:5], user_ids, strict=False)}
  me = names[0]
  inbox = [{users[rng.choice(names[1:5])]: rng.choice(pool["text"])} for _ in range(rng.randint(1, 3))]
  statuses = ("Open", "Open", "Open", "Closed", "Closed", "Resolved")
  tickets = []
  for tid, status in zip(rng.sample(range(lo, hi - 20), len(statuses)), statuses, strict=True):
    tickets.append({
      "id": tid, "title": rng.choice(pool["title"]), "description": rng.choice(pool["description"]),
      "status": status, "priority": rng.randint(1, 5), "created_by": me,
    })  # fmt: skip
  rng.shuffle(tickets)
  world = _World(
    rng=rng, pool=pool, ids=(lo, hi), users=users, me=me, logged_in=True, inbox=inbox, tickets=tickets,
    ticket_user=me, ticket_logged_in=True,
  )  # fmt: skip
  world.outsiders = names[5:7]  # not in the workspace: one to add, one to fail to find
  # add_contact numbers the new user USR<user_count + 1>: an unseen value too, and never an existing id
  world.user_count = rng.choice([c for c in range(lo, hi) if f"USR{c + 1}" not in users.values()])
  world.used.add(me)
  return world


# ---------------------------------------------------------------------------------------------------------------------
# Steps: one user turn each


@dataclasses.dataclass(frozen=True)
class Call:
  """A gold call of a step; ``expect_error``: the real tool must answer with its error (rule steps)."""

  name: str
  arguments: Mapping[str, Any]
  expect_error: bool = False


@dataclasses.dataclass(frozen=True)
class Turn:
  """One generated user turn: the request, the gold calls (some filled in from earlier responses by ``resolve``),
  the reply the reference gives and the strings the reply must contain."""

  request: str
  calls: tuple[Call | Callable[[list[Any]], Call], ...]
  reply: Callable[[list[Any]], str]
  communicate: Callable[[list[Any]], tuple[str, ...]]


@dataclasses.dataclass(frozen=True)
class Step:
  """A step template: its tool class, the functions its gold calls use, whether it is a rule step, and ``make``
  (world -> Turn). ``needs``: a state the world must be in (set by ``prepare``) before the task's first turn."""

  name: str
  cls: str
  functions: tuple[str, ...]
  make: Callable[[_World, dict[str, Any]], Turn]
  rule: bool = False
  prepare: Callable[[_World], None] | None = None


def _say(world: _World, *phrasings: str, **values: Any) -> str:
  return world.rng.choice(phrasings).format(**values)


def _user_id(world: _World, memo: dict[str, Any]) -> Turn:
  name = world.member()
  request = _say(world, "What is {n}'s user ID?", "Look up the user ID of {n}, please.", "Can you find {n}'s ID?",
                 "I need the workspace ID of {n}.", n=name)  # fmt: skip
  uid = world.users[name]
  return Turn(
    request, (Call("get_user_id", {"user": name}),), lambda r: f"{name}'s user ID is {uid}.", lambda r: (uid,)
  )


def _send(world: _World, memo: dict[str, Any]) -> Turn:
  name, text = world.member(), world.pick("text")
  memo["last_recipient"] = name
  request = _say(world, "Send {n} the message '{t}'.", "Please message {n}: '{t}'.", "Tell {n} '{t}' via message.",
                 "Can you send '{t}' to {n}?", n=name, t=text)  # fmt: skip
  uid = world.users[name]
  return Turn(
    request,
    (Call("get_user_id", {"user": name}), Call("send_message", {"receiver_id": uid, "message": text})),
    lambda r: f"Sent your message to {name}.",
    lambda r: (),
  )


def _add_contact(world: _World, memo: dict[str, Any]) -> Turn:
  name = world.outsiders[0]
  world.used.add(name)
  request = _say(world, "Add {n} to my contacts.", "Please add {n} as a new contact.", "Create a contact for {n}.",
                 "{n} just joined; add them as a contact.", n=name)  # fmt: skip
  return Turn(
    request,
    (Call("add_contact", {"user_name": name}),),
    lambda r: f"Added {name}; their user ID is {r[0]['user_id']}.",
    lambda r: (r[0]["user_id"],),
  )


def _delete_last(world: _World, memo: dict[str, Any]) -> Turn:
  name = memo.get("last_recipient") or world.member()
  uid = world.users[name]
  if not memo.get("last_recipient"):
    world.inbox.append({uid: world.pick("text")})  # something to delete
  request = _say(world, "Delete my latest message to {n}.", "Please remove the last message I sent {n}.",
                 "Unsend my most recent message to {n}.", n=name)  # fmt: skip
  return Turn(
    request,
    (Call("get_user_id", {"user": name}), Call("delete_message", {"receiver_id": uid})),
    lambda r: f"Deleted your latest message to {name}.",
    lambda r: (),
  )


def _create_ticket(world: _World, memo: dict[str, Any]) -> Turn:
  title, description, priority = world.pick("title"), world.pick("description"), world.rng.randint(1, 5)
  request = _say(world, "Open a ticket '{t}' with description '{d}' and priority {p}, and tell me its ID.",
                 "Create a ticket titled '{t}', description '{d}', priority {p}. What is its ID?",
                 "Please file a priority {p} ticket '{t}' ('{d}') and give me the ticket ID.",
                 t=title, d=description, p=priority)  # fmt: skip
  memo["created"] = True
  return Turn(
    request,
    (Call("create_ticket", {"title": title, "description": description, "priority": priority}),),
    lambda r: f"Created ticket {r[0]['id']}.",
    lambda r: (str(r[0]["id"]),),
  )


def _ticket_status(world: _World, memo: dict[str, Any]) -> Turn:
  ticket = world.ticket(world.rng.choice(["Open", "Resolved", "Closed"]))
  request = _say(world, "What is the status of ticket {i}?", "Is ticket {i} still open? Tell me its status.",
                 "Check ticket {i} and tell me its status.", i=ticket["id"])  # fmt: skip
  return Turn(
    request,
    (Call("get_ticket", {"ticket_id": ticket["id"]}),),
    lambda r: f"Ticket {ticket['id']} is {r[0]['status']}.",
    lambda r: (r[0]["status"],),
  )


def _close_ticket(world: _World, memo: dict[str, Any]) -> Turn:
  ticket = world.ticket("Open")
  request = _say(world, "Close ticket {i}.", "Please close ticket number {i}.", "Ticket {i} can be closed now.",
                 i=ticket["id"])  # fmt: skip
  return Turn(
    request,
    (Call("close_ticket", {"ticket_id": ticket["id"]}),),
    lambda r: f"Closed ticket {ticket['id']}.",
    lambda r: (),
  )


def _resolve_ticket(world: _World, memo: dict[str, Any]) -> Turn:
  ticket, note = world.ticket("Open"), world.pick("resolution")
  request = _say(world, "Resolve ticket {i} with the resolution '{r}'.", "Mark ticket {i} resolved: '{r}'.",
                 "Ticket {i} is fixed ('{r}'); resolve it.", i=ticket["id"], r=note)  # fmt: skip
  return Turn(
    request,
    (Call("resolve_ticket", {"ticket_id": ticket["id"], "resolution": note}),),
    lambda r: f"Resolved ticket {ticket['id']}.",
    lambda r: (),
  )


def _reprioritize(world: _World, memo: dict[str, Any]) -> Turn:
  ticket = world.ticket("Open")
  priority = world.rng.choice([p for p in range(1, 6) if p != ticket["priority"]])
  request = _say(world, "Set the priority of ticket {i} to {p}.", "Change ticket {i} to priority {p}.",
                 "Ticket {i} should have priority {p}; update it.", i=ticket["id"], p=priority)  # fmt: skip
  return Turn(
    request,
    (Call("edit_ticket", {"ticket_id": ticket["id"], "updates": {"priority": priority}}),),
    lambda r: f"Ticket {ticket['id']} now has priority {priority}.",
    lambda r: (),
  )


def _close_created(world: _World, memo: dict[str, Any]) -> Turn:
  """Closes the ticket an earlier turn created: its id is only in that turn's response."""
  request = _say(world, "Now close that ticket.", "Thanks. Please close the ticket you just created.",
                 "Actually, close that new ticket again.")  # fmt: skip
  return Turn(
    request,
    (lambda r: Call("close_ticket", {"ticket_id": r[-1]["created_id"]}),),
    lambda r: "Closed the new ticket.",
    lambda r: (),
  )


# Rule steps: a precondition fails; the gold route is the tool's error and a report, or another route.


def _send_unknown(world: _World, memo: dict[str, Any]) -> Turn:
  name, text = world.outsiders[1], world.pick("text")
  world.used.add(name)
  request = _say(world, "Send {n} the message '{t}'.", "Please message {n}: '{t}'.", "Can you send '{t}' to {n}?",
                 n=name, t=text)  # fmt: skip
  return Turn(
    request,
    (Call("get_user_id", {"user": name}, expect_error=True),),
    lambda r: f"I could not send it: {name} was not found in the workspace.",
    lambda r: ("not found",),
  )


def _send_logged_out_prepare(world: _World) -> None:
  world.logged_in = False


def _send_logged_out(world: _World, memo: dict[str, Any]) -> Turn:
  name, text = world.member(), world.pick("text")
  my_id = world.users[world.me]
  request = _say(world, "I'm {me} ({i}). Send {n} the message '{t}'.", "This is {me}, user {i}: please message {n} "
                 "'{t}'.", me=world.me, i=my_id, n=name, t=text)  # fmt: skip
  uid = world.users[name]
  return Turn(
    request,
    (Call("get_user_id", {"user": name}), Call("message_login", {"user_id": my_id}),
     Call("send_message", {"receiver_id": uid, "message": text})),
    lambda r: f"Logged you in and sent your message to {name}.",
    lambda r: (),
  )  # fmt: skip


def _close_closed(world: _World, memo: dict[str, Any]) -> Turn:
  ticket = world.ticket("Closed")
  request = _say(world, "Close ticket {i}.", "Please close ticket number {i}.", i=ticket["id"])
  return Turn(
    request,
    (Call("close_ticket", {"ticket_id": ticket["id"]}, expect_error=True),),
    lambda r: f"Ticket {ticket['id']} is already closed.",
    lambda r: ("already closed",),
  )


def _bad_priority(world: _World, memo: dict[str, Any]) -> Turn:
  title, description, priority = world.pick("title"), world.pick("description"), world.rng.choice([0, 6, 7, 9])
  request = _say(world, "Open a ticket '{t}' with description '{d}' and priority {p}, and tell me its ID.",
                 "Create a ticket titled '{t}', description '{d}', priority {p}. What is its ID?",
                 t=title, d=description, p=priority)  # fmt: skip
  return Turn(
    request,
    (Call("create_ticket", {"title": title, "description": description, "priority": priority}, expect_error=True),),
    lambda r: "I could not create it: the priority must be between 1 and 5.",
    lambda r: ("between 1 and 5",),
  )


def _missing_ticket(world: _World, memo: dict[str, Any]) -> Turn:
  taken = {t["id"] for t in world.tickets}
  tid = world.rng.choice([i for i in range(world.ids[1] - 19, world.ids[1] + 1) if i not in taken])
  request = _say(world, "What is the status of ticket {i}?", "Check ticket {i} and tell me its status.", i=tid)
  return Turn(
    request,
    (Call("get_ticket", {"ticket_id": tid}, expect_error=True),),
    lambda r: f"Ticket {tid} was not found.",
    lambda r: ("not found",),
  )


STEPS: dict[str, Step] = {
  s.name: s
  for s in (
    Step("user_id", "MessageAPI", ("get_user_id",), _user_id),
    Step("send", "MessageAPI", ("get_user_id", "send_message"), _send),
    Step("add_contact", "MessageAPI", ("add_contact",), _add_contact),
    Step("delete_last", "MessageAPI", ("get_user_id", "delete_message"), _delete_last),
    Step("create_ticket", "TicketAPI", ("create_ticket",), _create_ticket),
    Step("ticket_status", "TicketAPI", ("get_ticket",), _ticket_status),
    Step("close_ticket", "TicketAPI", ("close_ticket",), _close_ticket),
    Step("resolve_ticket", "TicketAPI", ("resolve_ticket",), _resolve_ticket),
    Step("reprioritize", "TicketAPI", ("edit_ticket",), _reprioritize),
    Step("close_created", "TicketAPI", ("close_ticket",), _close_created),
    Step("send_unknown", "MessageAPI", ("get_user_id", "send_message"), _send_unknown, rule=True),
    Step("send_logged_out", "MessageAPI", ("get_user_id", "message_login", "send_message"), _send_logged_out,
         rule=True, prepare=_send_logged_out_prepare),
    Step("close_closed", "TicketAPI", ("close_ticket",), _close_closed, rule=True),
    Step("bad_priority", "TicketAPI", ("create_ticket",), _bad_priority, rule=True),
    Step("missing_ticket", "TicketAPI", ("get_ticket",), _missing_ticket, rule=True),
  )
}  # fmt: skip
RULE_STEPS = tuple(n for n, s in STEPS.items() if s.rule)
SEEN_STEPS = tuple(n for n, s in STEPS.items() if not s.rule and n != "close_created")


def _gold_calls(step: str) -> int:
  return {"send": 2, "delete_last": 2, "send_unknown": 1, "send_logged_out": 3}.get(step, 1)


def _conflict(earlier: str, rule: str) -> bool:
  """Whether a rule step's precondition (logged out) would make an earlier step of the task fail."""
  return rule == "send_logged_out" and bool({"send_message", "delete_message"} & set(STEPS[earlier].functions))


def templates(level: Level, split: str) -> list[tuple[str, ...]]:
  """The step combinations (task templates) of a split at a level, in a fixed order.

  A combination is a tuple of step names, one per user turn; it is generated only where its ACT generations (gold
  calls + one reply per turn) fit ``level.max_act``.
  """

  def fits(combo: tuple[str, ...]) -> bool:
    return len(combo) <= level.max_turns and sum(_gold_calls(s) + 1 for s in combo) <= level.max_act

  seen = SEEN_STEPS
  within = [(a, b) for a in seen for b in seen if a != b and STEPS[a].cls == STEPS[b].cls]
  within.append(("create_ticket", "close_created"))  # the id comes from the first turn's response
  across = [(a, b) for a in seen for b in seen if STEPS[a].cls != STEPS[b].cls]
  if split in ("train", "iid"):
    combos = [(s,) for s in seen] + within
  elif split == "compositional":
    combos = across
  elif split == "rules":
    combos = [(r,) for r in RULE_STEPS] + [
      (a, r) for r in RULE_STEPS for a in seen if STEPS[a].cls == STEPS[r].cls and not _conflict(a, r)
    ]
  else:
    raise EnvError(f"unknown testbed split {split!r}; choose one of {SPLITS}")
  if level.max_turns >= 3 and split != "rules":
    more = [c + (d,) for c in (within if split != "compositional" else across) for d in seen if d not in c]
    combos += [c for c in more if (split == "compositional") == (len({STEPS[s].cls for s in c}) > 1)]
  return [c for c in combos if fits(c)]


# ---------------------------------------------------------------------------------------------------------------------
# Tasks


@functools.cache
def _function_docs() -> dict[str, dict[str, Any]]:
  """BFCL's function docs of `CLASSES`, with the package's Python hint, by function name."""
  utils = bfcl._import_bfcl("bfcl_eval.utils")
  entries = [{"id": "multi_turn_base_0", "involved_classes": list(CLASSES)}]
  entries = utils.add_language_specific_hint_to_function_doc(
    utils.populate_test_cases_with_predefined_functions(entries)
  )
  return {doc["name"]: doc for doc in entries[0]["function"]}


@functools.cache
def _class_functions() -> dict[str, tuple[str, ...]]:
  return {c: tuple(bfcl._public_methods(bfcl._backend_class(c))) for c in CLASSES}


def _execute(instances: Mapping[str, Any], owners: Mapping[str, str], call: Call) -> Any:
  return getattr(instances[owners[call.name]], call.name)(**copy.deepcopy(dict(call.arguments)))


def _is_error(result: Any) -> bool:
  return (isinstance(result, dict) and "error" in result) or (
    isinstance(result, list) and bool(result) and isinstance(result[0], dict) and "error" in result[0]
  )


def task_seed(level: str, split: str, index: int) -> int:
  """The seed of task ``index`` of a split: each task depends only on (level, split, index, GENERATOR_VERSION)."""
  digest = hashlib.sha256(f"envace-testbed/{GENERATOR_VERSION}/{level}/{split}/{index}".encode()).digest()
  return int.from_bytes(digest[:8], "little")


def make_task(level: str | Level, split: str, index: int) -> Task:
  """Task ``index`` of a split, generated and checked on the real classes.

  Returns:
    A `Task` (benchmark "testbed", domain = the level, id "tb_<level>_<split>_<index>"): logged user turns, the
    gold calls as `gold_actions` (and as BFCL call strings per turn in ``criteria["ground_truth"]``), their real
    results as `reference_interactions`, the replies in ``criteria["replies"]``, and the template and entities in
    ``criteria["template"]`` / ``criteria["entities"]``.

  Raises:
    EnvError: unknown level or split; a gold call whose real result contradicts its step (a generator bug).
  """
  if isinstance(level, str) and level not in LEVELS:
    raise EnvError(f"unknown testbed level {level!r}; choose one of {list(LEVELS)}")
  level = LEVELS[level] if isinstance(level, str) else level
  if split not in SPLITS:
    raise EnvError(f"unknown testbed split {split!r}; choose one of {SPLITS}")
  rng = random.Random(task_seed(level.name, split, index))
  combos = templates(level, split)
  combo = combos[rng.randrange(len(combos))]
  world = _new_world(rng, "train" if split == "train" else "heldout")
  for name in combo:
    if STEPS[name].prepare is not None:
      STEPS[name].prepare(world)
  memo: dict[str, Any] = {}
  turns = [STEPS[name].make(world, memo) for name in combo]
  scenario = world.scenario()
  involved = sorted({STEPS[name].cls for name in combo}, key=CLASSES.index)
  instances = bfcl._make_instances(involved, scenario, long_context=False)
  class_functions = _class_functions()
  owners = {f: c for c in involved for f in class_functions[c]}

  results: list[Any] = []
  ground_truth, golds, references, replies, communicate = [], [], [], [], []
  for name, turn in zip(combo, turns, strict=True):
    turn_results, turn_calls = [], []
    for spec in turn.calls:
      call = spec(results) if callable(spec) else spec
      result = _execute(instances, owners, call)
      if _is_error(result) != call.expect_error:
        raise EnvError(f"testbed {split}/{index} step {name}: {call.name}({dict(call.arguments)}) returned {result!r}")
      turn_results.append(result)
      turn_calls.append(call)
      golds.append(GoldAction(call.name, dict(call.arguments)))
      references.append(ReferenceInteraction(call.name, dict(call.arguments), bfcl._format_result(result),
                                             is_error=_is_error(result)))  # fmt: skip
    ground_truth.append([bfcl.render_call(ToolCall(c.name, dict(c.arguments)), frozenset(owners)) for c in turn_calls])
    if name == "create_ticket":
      turn_results.append({"created_id": turn_results[0]["id"]})
    reply_results = [r for r in turn_results if not (isinstance(r, dict) and "created_id" in r)]
    replies.append(turn.reply(reply_results))
    communicate += list(turn.communicate(reply_results))
    results += turn_results

  docs = _function_docs()
  shown = sorted({f for name in combo for f in STEPS[name].functions})
  if level.schemas == "class":
    shown = [f for c in involved for f in class_functions[c]]
  else:
    others = sorted(f for c in involved for f in class_functions[c] if f not in shown)
    shown += rng.sample(others, min(level.distractors, len(others)))
    shown = sorted(shown)
  entities = sorted(str(x) for x in world.used) + sorted(world.users.values())
  return Task(
    id=f"tb_{level.name}_{split}_{index:05d}",
    benchmark=BENCHMARK,
    domain=level.name,
    split=split,
    system_prompt=SYSTEM_PROMPT,
    tools=tuple(bfcl._to_openai_tools([docs[f] for f in shown])),
    user_turns=tuple(t.request for t in turns),
    gold_actions=tuple(golds),
    communicate_info=tuple(communicate),
    reference_interactions=tuple(references),
    criteria={
      "initial_config": {c: scenario[c] for c in involved},
      "involved_classes": involved,
      "ground_truth": ground_truth,
      "long_context": False,
      "replies": replies,
      "template": list(combo),
      "entities": entities,
      "generator_version": GENERATOR_VERSION,
    },
  )


def load_tasks(level: str = "cpu", split: str = "train", limit: int | None = None) -> list[Task]:
  """The tasks of a split at a level (``LEVELS[level].sizes[split]`` of them, or the first ``limit``).

  Raises:
    EnvError: unknown level or split (the message lists the valid ones).
  """
  if level not in LEVELS:
    raise EnvError(f"unknown testbed level {level!r}; choose one of {list(LEVELS)}")
  if split not in SPLITS:
    raise EnvError(f"unknown testbed split {split!r}; choose one of {SPLITS}")
  n = LEVELS[level].sizes[split] if limit is None else min(limit, LEVELS[level].sizes[split])
  return [make_task(level, split, i) for i in range(n)]


def split_signature(task: Task) -> tuple[tuple[str, ...], frozenset[str]]:
  """(template, entities) of a task: what the splits are disjoint by (module docstring)."""
  return tuple(task.criteria["template"]), frozenset(task.criteria["entities"])


# ---------------------------------------------------------------------------------------------------------------------
# Environment, reference conversation, oracle


class TestbedEnv(bfcl.BfclEnv):
  """`bfcl.BfclEnv` on a testbed task: the real classes and BFCL's checker; the reward also needs the answers told.

  `evaluate` returns 1.0 when the checker passes and every ``communicate_info`` string was told (τ²'s rule), with
  ``breakdown = {"multi_turn": ..., "communicate": ...}``; invalid when the checker crashed.
  """

  __test__ = False  # not a pytest class

  def reset(self, task: Task) -> None:
    if task.benchmark != BENCHMARK:
      raise EnvError(f"task {task.id!r} is not a testbed task (benchmark {task.benchmark!r})")
    super().reset(dataclasses.replace(task, benchmark=bfcl.BENCHMARK))
    self._task = task

  def evaluate(self, conversation: Sequence[ChatMessage]) -> RewardInfo:
    checked = super().evaluate(conversation)
    if not checked.valid:
      return checked
    task = self._require_task()
    told = [info_communicated(info, conversation) for info in task.communicate_info]
    communicate = sum(told) / len(told) if told else 1.0
    breakdown = {"multi_turn": checked.breakdown.get("multi_turn", 0.0), "communicate": communicate}
    reward = float(checked.reward == 1.0 and all(told))
    info = dict(checked.info, not_told=[i for i, ok in zip(task.communicate_info, told, strict=True) if not ok])
    return RewardInfo(reward, breakdown, info=info)


def oracle_conversation(task: Task, env: TestbedEnv) -> list[ChatMessage]:
  """``task``'s reference conversation, every gold call executed on ``env`` (reset here): per turn the user's
  request, one assistant message per gold call and its real result, then the reply (``criteria["replies"]``)."""
  env.reset(task)
  messages = [ChatMessage("system", task.system_prompt)]
  golds = iter(task.gold_actions)
  for turn, (request, calls, reply) in enumerate(
    zip(task.user_turns, task.criteria["ground_truth"], task.criteria["replies"], strict=True)
  ):
    messages.append(ChatMessage("user", request))
    for i in range(len(calls)):
      gold = next(golds)
      call = ToolCall(gold.name, dict(gold.arguments), id=f"call_{turn}_{i}")
      messages += [ChatMessage("assistant", tool_calls=(call,)), env.answer(call)]
    messages.append(ChatMessage("assistant", reply))
  return messages


def run_oracle(level: str, split: str, limit: int | None = None) -> list[tuple[Task, RewardInfo]]:
  """Reference conversations of a split's tasks, each scored by `TestbedEnv.evaluate`."""
  env = TestbedEnv()
  return [(task, env.evaluate(oracle_conversation(task, env))) for task in load_tasks(level, split, limit)]


def _main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m envace_jax.envs.testbed", description=__doc__.splitlines()[0])
  parser.add_argument("--level", default="cpu", choices=DOMAINS)
  parser.add_argument("--split", default="train", choices=SPLITS)
  parser.add_argument("--oracle", action="store_true", help="replay the gold calls and score them (BFCL's checker)")
  parser.add_argument("--limit", type=int, default=None, help="only the first N tasks")
  parser.add_argument("--show", type=int, default=0, help="print the first N tasks' reference conversations")
  args = parser.parse_args(argv)
  start = time.perf_counter()
  if args.show:
    env = TestbedEnv()
    for task in load_tasks(args.level, args.split, args.show):
      print(f"== {task.id}  template={task.criteria['template']}  tools={list(task.tool_names)}")
      for m in oracle_conversation(task, env):
        text = m.content or json.dumps([c.to_dict() for c in m.tool_calls])
        print(f"  {m.role:>9}: {text}")
    return 0
  if not args.oracle:
    tasks = load_tasks(args.level, args.split, args.limit)
    templates_ = {tuple(t.criteria["template"]) for t in tasks}
    print(f"{args.level}/{args.split}: {len(tasks)} tasks, {len(templates_)} templates, "
          f"{sum(len(t.gold_actions) for t in tasks)} gold calls")  # fmt: skip
    return 0
  results = run_oracle(args.level, args.split, args.limit)
  failed = [(t, r) for t, r in results if r.reward != 1.0]
  for task, reward in failed:
    print(f"{task.id}: {reward.reward} {reward.info.get('error_type', '')} {reward.info.get('not_told', '')}")
  print(f"oracle reward: {len(results) - len(failed)}/{len(results)}  ({time.perf_counter() - start:.1f} s)")
  return 0 if not failed else 1


if __name__ == "__main__":
  raise SystemExit(_main())
