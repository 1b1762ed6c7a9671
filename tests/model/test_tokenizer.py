"""Tests for envace_jax.model.tokenizer and envace_jax.model.tool_format.

Reference for token ids: transformers. Its GGUF converter (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``)
builds SmolLM2's tokenizer with GPT-2's plain ByteLevel pre-tokenizer: it drops the ``Digits(individual_digits=True)``
step that SmolLM2's published tokenizer.json has before ByteLevel (transformers maps only some ``tokenizer.ggml.pre``
values to splits; 'smollm' is not one). That changes ids on whitespace runs before digits ("x  2024") and on
" ²"-like numerics (``test_transformers_gguf_converter_misses_digits``). So the reference is transformers' converter
(its own GGUF parsing: vocab, merges, special tokens, chat template) with the pre-tokenizer set to the published
SmolLM2 structure; strings without digits are also checked against the unpatched converter.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envace_jax.model import tokenizer as tokenizer_lib
from envace_jax.model import tool_format as tf
from envace_jax.model.roles import Role
from envace_jax.model.tokenizer import (
  CHATML_TEMPLATE,
  ChatTemplateError,
  Message,
  Tokenizer,
  TokenizerError,
  read_gguf_tokenizer_metadata,
)
from envace_jax.model.tool_format import Action, ParseErrorKind, parse_action
from envace_jax.model.weights import smollm2_gguf_path

STRINGS = [
  "Hello, world!",
  "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
  "end of text<|endoftext|>next document",
  "<|im_end|><|im_end|>  <|im_start|>",
  "日本語のテキスト、中文字符和한국어",
  "Emoji: 😀👍🏽🇺🇸 ❤️ family 👨‍👩‍👧",
  "Café naïve résumé façade Ångström e\u0301",
  "مرحبا بالعالم שלום עולם",
  "Numbers 12345 and 3.14159 and 1,000,000 in 2024-07-14",
  "x  2024",
  "row    42\n\n   7\t\t8",
  "a ² b ½ ١٢٣ x  ²",
  "   leading and trailing   \n\n\n",
  "\t\ttabs\r\nand CRLF\r\n",
  "def foo(x):\n    return x ** 2  # comment\n\n\nclass A:\n  pass\n",
  '{"name": "get_user_details", "arguments": {"user_id": "mia_li_3668", "amount": 12.50, "ok": true}}',
  '{"a":  12, "b": [1,  2,   3]}',
  "I'm sure they'll say it's fine, don't you think? We've seen it.",
  "<tool_call>\n{}\n</tool_call>",
  "",
  " ",
]

TOOLS = [
  {
    "type": "function",
    "function": {
      "name": "get_user_details",
      "description": "Get the details of a user.",
      "parameters": {
        "type": "object",
        "properties": {"user_id": {"type": "string", "description": "The user id, such as 'sara_doe_496'."}},
        "required": ["user_id"],
      },
    },
  },
  {
    "type": "function",
    "function": {"name": "transfer_to_human_agents", "description": "Transfer.", "parameters": {"type": "object"}},
  },
]

# Qwen2.5-style template (tools read by the template, a 'tool' role grouped into user turns), for the pass-through path.
QWEN_STYLE_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided \
with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\
\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

CONVERSATION = [
  Message("system", "You are an airline customer service agent. Follow the policy."),
  Message("user", "Hi! I'm Mia Li, user id mia_li_3668. Can you check my reservations?"),
  Message("assistant", tf.render_tool_call("get_user_details", {"user_id": "mia_li_3668"})),
  Message("tool", '{"user_id": "mia_li_3668", "reservations": ["NO6JO3", "AIXC49"], "balance": 1250.5}'),
  Message("assistant", "You have two reservations: NO6JO3 and AIXC49."),
]


@pytest.fixture(scope="module")
def meta():
  return read_gguf_tokenizer_metadata(smollm2_gguf_path())


@pytest.fixture(scope="module")
def tok(meta):
  return Tokenizer.from_gguf_metadata(meta)


@pytest.fixture(scope="module")
def hf_gguf():
  """transformers' own GGUF tokenizer converter, as is."""
  transformers = pytest.importorskip("transformers")
  path = smollm2_gguf_path()
  return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def hf_ref(hf_gguf):
  """The converter's tokenizer with SmolLM2's published pre-tokenizer: Digits(individual) then ByteLevel."""
  import tokenizers
  import transformers

  backend = tokenizers.Tokenizer.from_str(hf_gguf.backend_tokenizer.to_str())
  backend.pre_tokenizer = tokenizers.pre_tokenizers.Sequence(
    [
      tokenizers.pre_tokenizers.Digits(individual_digits=True),
      tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ]
  )
  special = {k: getattr(hf_gguf, k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
  return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=hf_gguf.chat_template, **special)


def hf_chat_ids(hf, chat, **kwargs) -> list[int]:
  out = hf.apply_chat_template(chat, tokenize=True, **kwargs)
  return list(out["input_ids"] if hasattr(out, "keys") else out)


def runs(roles: np.ndarray) -> list[int]:
  """Role ids with consecutive repeats collapsed."""
  return [int(r) for i, r in enumerate(roles) if i == 0 or r != roles[i - 1]]


# ------------------------------------------------------------------------------------------------------ tokenizer


def test_attributes(tok):
  assert tok.vocab_size == 49152
  assert tok.bos_id == 1 and tok.eos_ids == (2,) and tok.pad_id == 2
  assert tok.id_to_token(2) == "<|im_end|>" and tok.token_to_id("<|endoftext|>") == 0
  assert tok.chat_template.startswith("{% for message in messages %}")


def test_ids_match_reference(tok, hf_ref):
  mismatches = [(s, tok.encode(s), hf_ref(s, add_special_tokens=False)["input_ids"]) for s in STRINGS]
  assert [m for m in mismatches if m[1] != m[2]] == []


def test_ids_match_unpatched_converter_without_digits(tok, hf_gguf):
  for s in STRINGS:
    if not any(c.isnumeric() for c in s):
      assert tok.encode(s) == hf_gguf(s, add_special_tokens=False)["input_ids"], s


def test_transformers_gguf_converter_misses_digits(tok, hf_gguf, hf_ref):
  # If this fails, transformers' converter now splits digits for tokenizer.ggml.pre='smollm': compare against it
  # directly and drop the patched reference.
  assert "Digits" not in str(hf_gguf.backend_tokenizer.pre_tokenizer)
  for s in ("x  2024", "a ² b"):
    assert hf_gguf(s)["input_ids"] != tok.encode(s) == hf_ref(s)["input_ids"]


def test_special_tokens_and_decode(tok):
  assert tok.encode("<|im_start|>user\n<|im_end|>") == [1, 4093, 198, 2]
  for s in STRINGS:
    assert tok.decode(tok.encode(s)) == s
  assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>"), skip_special_tokens=True) == "hi"


def test_save_and_load_round_trip(tok, tmp_path):
  tok.save(tmp_path)
  loaded = Tokenizer.from_hf_dir(tmp_path)
  assert (loaded.vocab_size, loaded.bos_id, loaded.eos_ids, loaded.pad_id) == (49152, 1, (2,), 2)
  assert loaded.chat_template == tok.chat_template
  for s in STRINGS:
    assert loaded.encode(s) == tok.encode(s), s
  assert np.array_equal(loaded.render(CONVERSATION, TOOLS)[0], tok.render(CONVERSATION, TOOLS)[0])


def test_a_directory_loaded_again_shares_its_parsed_file_until_the_file_changes(tok, tmp_path):
  """`Tokenizer.from_hf_dir` parses a tokenizer.json once: a second load shares the backend and the bytes of each id
  (the same tuple, equal to what the backend spells), with its own chat template; a file rewritten with other
  content is parsed again, even with the same size and modification time."""
  tok.save(tmp_path)
  first, again = Tokenizer.from_hf_dir(tmp_path), Tokenizer.from_hf_dir(tmp_path).with_chat_template(None)
  assert first.backend is again.backend and first.chat_template == tok.chat_template and again.chat_template is None
  spelled = tokenizer_lib._spelled.__wrapped__(first.backend)  # spelled again, not from the cache
  assert first.token_bytes() is again.token_bytes() and first.token_bytes() == spelled == tok.token_bytes()
  assert spelled[2] == b"<|im_end|>" and spelled[198] == b"\n"
  path = tmp_path / "tokenizer.json"
  text, stat = path.read_text(encoding="utf-8"), path.stat()
  swapped = text.replace('"<|im_start|>"', '"<|im_START|>"')  # id 1 spelled otherwise, the same size
  assert swapped != text and len(swapped) == len(text)
  path.write_text(swapped, encoding="utf-8")
  os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # as `cp -p` leaves it
  changed = Tokenizer.from_hf_dir(tmp_path)
  assert changed.backend is not first.backend and changed.token_bytes()[1] == b"<|im_START|>"
  assert changed.token_bytes()[2:] == first.token_bytes()[2:]


def test_saved_dir_loads_in_transformers(tok, tmp_path):
  transformers = pytest.importorskip("transformers")
  tok.save(tmp_path)
  hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (1, 2, 2)
  for s in STRINGS:
    assert hf(s, add_special_tokens=False)["input_ids"] == tok.encode(s), s
  chat = [{"role": "user", "content": "What is 12 + 30?"}]
  ids, _ = tok.render([Message("user", "What is 12 + 30?")], add_generation_prompt=True)
  assert hf_chat_ids(hf, chat, add_generation_prompt=True) == ids.tolist()


def test_import_needs_no_torch_or_transformers():
  code = "import sys, envace_jax.model.tokenizer, gguf; assert not {'torch', 'transformers'} & set(sys.modules)"
  subprocess.run([sys.executable, "-c", code], check=True, cwd=pathlib.Path(__file__).resolve().parents[2])


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "gpt2"])
def test_other_pre_tokenizers_match_transformers_converter(meta, pre):
  """Our qwen2 / llama-bpe / gpt2 splits on SmolLM2's vocabulary against transformers' converter on the same data."""
  pytest.importorskip("transformers")
  mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
  ours = Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.pre": pre})
  names = {"tokens": "tokens", "merges": "merges", "token_type": "token_type", "model": "tokenizer_type"}
  data = {new: meta[f"tokenizer.ggml.{old}"] for old, new in names.items()}
  theirs, _ = mapping.convert_gguf_tokenizer("llama", {**data, "pre_tokenizer_type": pre})
  theirs.model.ignore_merges = pre == "llama-bpe"  # as in Llama 3's tokenizer.json and llama.cpp
  for s in STRINGS:  # no string here changes under NFC except the decomposed é, which Qwen2's tokenizer.json composes
    if "e\u0301" not in s:
      assert ours.encode(s) == theirs.encode(s, add_special_tokens=False).ids, (pre, s)
  split = [piece for piece, _ in ours.backend.pre_tokenizer.pre_tokenize_str("abc 12345")]
  assert split == {"qwen2": ["abc", "Ġ", "1", "2", "3", "4", "5"], "llama-bpe": ["abc", "Ġ", "123", "45"]}.get(
    pre, ["abc", "Ġ12345"]
  )


def test_unsupported_gguf_tokenizers_raise(meta):
  with pytest.raises(TokenizerError, match="'deepseek-coder'"):
    Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.pre": "deepseek-coder"})
  with pytest.raises(TokenizerError, match="'llama'"):
    Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.model": "llama"})
  with pytest.raises(TokenizerError, match="not found"):
    Tokenizer.from_gguf("/nonexistent.gguf")


# ------------------------------------------------------------------------------------------------------ chat rendering


def smollm_chat(conversation, tools):
  """The conversation as SmolLM2's template must see it: tools block in the system message, tool -> user turn."""
  chat = []
  for m in conversation:
    if m.role == "tool":
      chat.append({"role": "user", "content": tf.render_tool_response(m.content)})
    elif m.role == "system" and tools:
      chat.append({"role": "system", "content": m.content + "\n\n" + tf.render_tools_block(tools)})
    else:
      chat.append({"role": m.role, "content": m.content})
  return chat


def test_render_matches_apply_chat_template(tok, hf_ref):
  assert not tok.template_handles_tools and not tok.template_knows_tool_role
  ids, roles = tok.render(CONVERSATION, TOOLS, add_generation_prompt=True)
  assert ids.dtype == np.int32 and roles.dtype == np.int32 and ids.shape == roles.shape
  assert ids.tolist() == hf_chat_ids(hf_ref, smollm_chat(CONVERSATION, TOOLS), add_generation_prompt=True)
  assert tok.render_text(CONVERSATION, TOOLS, True) == tok.decode(ids)


def test_render_roles(tok):
  ids, roles = tok.render(CONVERSATION, TOOLS, add_generation_prompt=True)
  assert runs(roles) == [Role.SYSTEM, Role.USER, Role.ACT, Role.OBSERVATION, Role.ACT]

  def text(role):
    return tok.decode(ids[roles == role])

  assert text(Role.USER) == f"<|im_start|>user\n{CONVERSATION[1].content}<|im_end|>\n"
  assert text(Role.OBSERVATION) == f"<|im_start|>user\n{tf.render_tool_response(CONVERSATION[3].content)}<|im_end|>\n"
  assert text(Role.SYSTEM).startswith("<|im_start|>system\nYou are an airline")
  assert text(Role.SYSTEM).endswith('"parameters":{"type":"object"}}}\n</tools>\n\nFor each function call, return a '
                                    'json object with function name and arguments within <tool_call></tool_call> XML '
                                    'tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
                                    "</tool_call><|im_end|>\n")  # fmt: skip
  header = tok.encode("<|im_start|>assistant\n")
  assert ids[-len(header) :].tolist() == header and (roles[-len(header) :] == Role.ACT).all()
  assert tok.decode(ids[roles == Role.ACT]).endswith(f"{CONVERSATION[4].content}<|im_end|>\n<|im_start|>assistant\n")


def test_generation_role_and_author_override(tok):
  convo = [*CONVERSATION[:3], Message("tool", "{}", author=Role.REHEARSE)]
  ids, roles = tok.render(convo, add_generation_prompt=True, generation_role=Role.USER)
  assert runs(roles) == [Role.SYSTEM, Role.USER, Role.ACT, Role.REHEARSE, Role.USER]
  header = tok.encode("<|im_start|>assistant\n")
  assert ids[-len(header) :].tolist() == header and (roles[-len(header) :] == Role.USER).all()


def test_default_system_prompt_is_system_role(tok, hf_ref):
  convo = [Message("user", "Hi"), Message("assistant", "Hello!")]
  ids, roles = tok.render(convo, add_generation_prompt=True)
  assert ids.tolist() == hf_chat_ids(hf_ref, smollm_chat(convo, None), add_generation_prompt=True)
  assert runs(roles) == [Role.SYSTEM, Role.USER, Role.ACT]
  assert tok.decode(ids[roles == Role.SYSTEM]) == (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
  )


@pytest.mark.parametrize("template", ["smollm", "chatml", "qwen"])
@pytest.mark.parametrize("case", ["full", "no_system", "tools_no_system", "no_tools"])
def test_turns_concatenate_to_whole(tok, template, case):
  tokenizer = {"smollm": tok, "chatml": tok.with_chat_template(None)}.get(
    template, tok.with_chat_template(QWEN_STYLE_TEMPLATE)
  )
  messages = CONVERSATION[1:] if case in ("no_system", "tools_no_system") else CONVERSATION
  tools = None if case in ("no_system", "no_tools") else TOOLS
  whole_ids, whole_roles = tokenizer.render(messages, tools, add_generation_prompt=True)
  ids, roles = tokenizer.render([], tools)
  for i, message in enumerate(messages):
    gen = i == len(messages) - 1
    new_ids, new_roles = tokenizer.render_turn(messages[:i], message, tools, add_generation_prompt=gen)
    ids, roles = np.concatenate([ids, new_ids]), np.concatenate([roles, new_roles])
    if not gen:
      prefix_ids, prefix_roles = tokenizer.render(messages[: i + 1], tools)
      assert np.array_equal(prefix_ids, ids) and np.array_equal(prefix_roles, roles)
  assert np.array_equal(whole_ids, ids) and np.array_equal(whole_roles, roles)
  assert np.array_equal(whole_ids, tokenizer.encode(tokenizer.render_text(messages, tools, True)))


def test_template_with_tools_passes_them_through(tok, hf_ref):
  qwen = tok.with_chat_template(QWEN_STYLE_TEMPLATE)
  assert qwen.template_handles_tools and qwen.template_knows_tool_role
  ids, roles = qwen.render(CONVERSATION, TOOLS, add_generation_prompt=True)
  chat = [{"role": m.role, "content": m.content} for m in CONVERSATION]
  expected = hf_chat_ids(hf_ref, chat, tools=TOOLS, chat_template=QWEN_STYLE_TEMPLATE, add_generation_prompt=True)
  assert ids.tolist() == expected
  assert runs(roles) == [Role.SYSTEM, Role.USER, Role.ACT, Role.OBSERVATION, Role.ACT]
  assert tok.decode(ids[roles == Role.OBSERVATION]).startswith("<|im_start|>user\n<tool_response>\n{")
  # Without a system message, the template's default system prompt with the tools is SYSTEM.
  ids, roles = qwen.render(CONVERSATION[1:2], TOOLS)
  assert runs(roles) == [Role.SYSTEM, Role.USER]
  assert tok.decode(ids[roles == Role.SYSTEM]).startswith("<|im_start|>system\nYou are Qwen")


def test_chatml_fallback_matches_transformers(tok, hf_ref):
  chatml = tok.with_chat_template(None)
  ids, _ = chatml.render(CONVERSATION, TOOLS, add_generation_prompt=True)
  chat = smollm_chat(CONVERSATION, TOOLS)
  assert ids.tolist() == hf_chat_ids(hf_ref, chat, chat_template=CHATML_TEMPLATE, add_generation_prompt=True)


def test_tools_without_system_message_get_their_own(tok):
  ids, roles = tok.render(CONVERSATION[1:2], TOOLS)
  assert runs(roles) == [Role.SYSTEM, Role.USER]
  assert tok.decode(ids).startswith("<|im_start|>system\n# Tools\n\nYou may call")


def test_schemas_are_compact(tok):
  block = tf.render_tools_block(TOOLS)
  assert '{"type":"function","function":{"name":"get_user_details",' in block
  lines = block.split("<tools>\n")[1].split("\n</tools>")[0].split("\n")
  assert [json.loads(line) for line in lines] == TOOLS


def test_non_append_only_template_raises(tok):
  qwen = tok.with_chat_template(QWEN_STYLE_TEMPLATE)
  two_results = [*CONVERSATION[:3], Message("tool", "a"), Message("tool", "b")]
  with pytest.raises(ChatTemplateError, match="append-only"):
    qwen.render(two_results)


def test_template_errors_raise_chat_template_error(tok):
  strict = tok.with_chat_template("{{ raise_exception('roles must alternate') }}")
  with pytest.raises(ChatTemplateError, match="roles must alternate"):
    strict.render([Message("user", "hi")])
  with pytest.raises(ChatTemplateError, match="does not compile"):
    tok.with_chat_template("{% for %}").render([Message("user", "hi")])
  tracked = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
  assert tok.with_chat_template(tracked).render_text([Message("user", "hi")]) == "hi"  # HF's assistant-mask tag


def test_message_validation():
  assert Message("tool", "x").author == Role.OBSERVATION and Message("assistant", "x").author == Role.ACT
  assert Message("user", "x", author=Role.REHEARSE).author == Role.REHEARSE
  with pytest.raises(ValueError, match="role"):
    Message("bot", "x")
  with pytest.raises(ValueError, match="content"):
    Message("user", None)


# ------------------------------------------------------------------------------------------------------ tool calls


def test_render_tool_call_and_response():
  call = tf.render_tool_call("get_user_details", {"user_id": "mia_li_3668"})
  assert call == '<tool_call>\n{"name": "get_user_details", "arguments": {"user_id": "mia_li_3668"}}\n</tool_call>'
  assert parse_action(call).call == tf.ToolCall("get_user_details", {"user_id": "mia_li_3668"})
  assert tf.render_tool_response("ok") == "<tool_response>\nok\n</tool_response>"


def test_parse_reply():
  assert parse_action("  Sure, your flight is booked.\n") == Action(kind="reply", reply="Sure, your flight is booked.")


def test_parse_valid_call_with_text_around():
  text = 'Let me look.\n<tool_call>\n{"name": "get_user_details", "arguments": {"user_id": "u1"}}\n</tool_call>\nok'
  action = parse_action(text, known_tools={"get_user_details"})
  assert action.kind == "tool_call" and action.error is None
  assert action.call == tf.ToolCall("get_user_details", {"user_id": "u1"})
  assert action.reply == "Let me look.\nok"


def test_parse_string_encoded_arguments_and_defaults():
  action = parse_action('<tool_call>{"name": "f", "arguments": "{\\"x\\": [1, 2]}"}</tool_call>')
  assert action.call == tf.ToolCall("f", {"x": [1, 2]})
  assert parse_action('<tool_call>{"name": "f"}</tool_call>').call == tf.ToolCall("f", {})
  assert parse_action('<tool_call>```json\n{"name": "f", "parameters": {"a": 1}}\n```</tool_call>').call.arguments == {
    "a": 1
  }


@pytest.mark.parametrize(
  "text, kind",
  [
    ("<tool_call>\n{name: f}\n</tool_call>", ParseErrorKind.BAD_JSON),
    ("<tool_call>[1, 2]</tool_call>", ParseErrorKind.BAD_JSON),
    ('<tool_call>{"arguments": {}}</tool_call>', ParseErrorKind.MISSING_NAME),
    ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', ParseErrorKind.MISSING_NAME),
    ('<tool_call>{"name": "book_hotel", "arguments": {}}</tool_call>', ParseErrorKind.UNKNOWN_TOOL),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', ParseErrorKind.ARGUMENTS_NOT_OBJECT),
    ('<tool_call>{"name": "f", "arguments": "not json"}</tool_call>', ParseErrorKind.ARGUMENTS_NOT_OBJECT),
    ('<tool_call>{"name": "f", "arguments": "[1]"}</tool_call>', ParseErrorKind.ARGUMENTS_NOT_OBJECT),
    ('<tool_call>{"name": "f", "arguments": null}</tool_call>', ParseErrorKind.ARGUMENTS_NOT_OBJECT),
    ('Checking.\n<tool_call>\n{"name": "f", "arguments": {}}', ParseErrorKind.UNTERMINATED),
    ('<tool_call>{"name": "f"}</tool_call><tool_call>{"name": "f"}</tool_call>', ParseErrorKind.MULTIPLE_CALLS),
  ],
)
def test_parse_errors(text, kind):
  action = parse_action(text, known_tools={"f"})
  assert action.kind == "error" and action.call is None
  assert action.error.kind == kind and action.error.raw == text and action.error.message


def test_parse_error_keeps_text_before_call():
  assert parse_action("Checking.\n<tool_call>\n{").reply == "Checking."


def assert_well_formed(action, text):
  assert isinstance(action, Action) and isinstance(action.reply, str)
  if action.kind == "tool_call":
    assert action.error is None and isinstance(action.call.name, str) and action.call.name
    assert isinstance(action.call.arguments, dict)
  elif action.kind == "reply":
    assert action.call is None and action.error is None and "<tool_call>" not in text
  else:
    assert action.kind == "error" and action.call is None
    assert isinstance(action.error.kind, ParseErrorKind) and action.error.raw == text


FRAGMENTS = st.sampled_from(
  ["<tool_call>", "</tool_call>", "<tool_call", "{", "}", "[", "]", '"name"', '"arguments"', ":", ",", '"f"', '"{}"',
   '"{\\"a\\": 1}"', "null", "1" * 5000, "[" * 3000, "\n", " ", "```", "json", "<|im_end|>", "\\", '"']
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_parse_never_raises_on_random_text(text):
  assert_well_formed(parse_action(text, known_tools={"f"}), text)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.one_of(FRAGMENTS, st.text(max_size=5)), max_size=20), st.booleans())
def test_parse_never_raises_on_near_misses(parts, with_known):
  text = "".join(parts)
  assert_well_formed(parse_action(text, known_tools={"f"} if with_known else None), text)


@settings(max_examples=100, deadline=None)
@given(st.text(min_size=1).filter(lambda s: s.strip()), st.dictionaries(st.text(), st.integers() | st.text()))
def test_render_then_parse_round_trip(name, arguments):
  action = parse_action(tf.render_tool_call(name, arguments))
  if "<tool_call>" in name or "</tool_call>" in name or any("tool_call>" in k + str(v) for k, v in arguments.items()):
    return
  assert action.call == tf.ToolCall(name.strip(), arguments)
