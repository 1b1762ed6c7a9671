"""Tokenizer and chat rendering with a role id per token.

``Tokenizer`` wraps a ``tokenizers.Tokenizer`` (no torch, no transformers at runtime), built from a GGUF file's
metadata (``from_gguf``) or a Hugging Face directory (``from_hf_dir``). ``Tokenizer.render`` turns ``Message``s into
token ids and role ids (``roles.Role``) with the model's own jinja2 chat template, or ChatML when it ships none;
``render_turn`` renders only what one more message adds, so each role's view grows append-only and its KV cache can
be kept. Tool schemas, calls and results follow ``tool_format`` (Hermes / Qwen2.5 convention). Every text is
passed through ``sanitize.sanitize`` before it becomes tokens (``encode``, and the rendered text of ``render``,
``render_turn`` and ``render_text``): a lone surrogate, NUL or Unicode noncharacter is U+FFFD, as in the official
EnvACE code, and never an error.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import pathlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox
import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from envace_jax.model import sanitize, tool_format
from envace_jax.model.roles import Role


class TokenizerError(ValueError):
  """A tokenizer source we cannot build from (missing file, unsupported GGUF tokenizer type)."""


class ChatTemplateError(TokenizerError):
  """A chat template failed to render, or rendered a conversation that is not append-only or token-aligned."""


IM_END = "<|im_end|>"

CHATML_TEMPLATE = (
  "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
  "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""Used when a tokenizer ships no chat template. Rendered messages are ChatML blocks, as SmolLM2 and Qwen use."""

# Split regexes of llama.cpp's pre-tokenizer types, as the models' tokenizer.json files write them.
_LLAMA3_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level_pipeline(pre: str) -> tuple[Any, Any, bool]:
  """``(normalizer, pre_tokenizer, ignore_merges)`` for a GGUF ``tokenizer.ggml.pre`` value of a byte-level BPE."""
  if pre == "gpt2":  # GPT-2's own regex, inside ByteLevel
    return None, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False
  if pre in ("smollm", "starcoder"):  # SmolLM2 / StarCoder tokenizer.json: every digit alone, then GPT-2's regex
    digits = pre_tokenizers.Digits(individual_digits=True)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return None, pre_tokenizers.Sequence([digits, byte_level]), False
  split = {"qwen2": _QWEN2_SPLIT, "llama-bpe": _LLAMA3_SPLIT}.get(pre)
  if split is None:
    raise TokenizerError(
      f"GGUF tokenizer.ggml.pre={pre!r} is not supported; supported: gpt2, smollm, starcoder, qwen2, llama-bpe. "
      "Load the model's Hugging Face directory with Tokenizer.from_hf_dir instead."
    )
  pre_tokenizer = pre_tokenizers.Sequence(
    [
      pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
  )
  normalizer = normalizers.NFC() if pre == "qwen2" else None  # Qwen2's tokenizer.json normalises to NFC
  return normalizer, pre_tokenizer, pre == "llama-bpe"  # Llama 3 matches whole words before merging


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
  """GPT-2's byte -> printable character table (``bytes_to_unicode``)."""
  printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
  table, extra = {}, 0
  for b in range(256):
    if b in printable:
      table[b] = chr(b)
    else:
      table[b] = chr(256 + extra)
      extra += 1
  return table


def read_gguf_tokenizer_metadata(path: str | os.PathLike) -> dict[str, Any]:
  """The ``tokenizer.*`` fields of a GGUF file, decoded (lists of str / int, str, int, bool). Takes ~3 s for SmolLM2.

  Raises:
    TokenizerError: the file does not exist.
  """
  import gguf  # only needed here; keeps `import tokenizer` light

  if not os.path.isfile(path):
    raise TokenizerError(f"GGUF file not found: {path}")
  reader = gguf.GGUFReader(str(path))
  return {key: field.contents() for key, field in reader.fields.items() if key.startswith("tokenizer.")}


def _special_name(value: Any) -> str | None:
  """A special token as tokenizer_config.json writes it: a string, or ``{"content": ...}`` (AddedToken)."""
  if isinstance(value, Mapping):
    value = value.get("content")
  return value if isinstance(value, str) else None


class _GenerationTag(jinja2.ext.Extension):
  """``{% generation %}...{% endgeneration %}`` (HF's assistant-mask marker): rendered as its body."""

  tags = {"generation"}

  def parse(self, parser: Any) -> Any:
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> tuple[jinja2.Template, frozenset[str]]:
  """A chat template compiled as ``transformers`` does (sandboxed, trim/lstrip blocks), and its free variables."""
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
  )
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  try:
    names = frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))
    return env.from_string(template), names
  except jinja2.TemplateError as e:
    raise ChatTemplateError(f"chat template does not compile: {e}") from e


_DEFAULT_AUTHOR = {"system": Role.SYSTEM, "user": Role.USER, "assistant": Role.ACT, "tool": Role.OBSERVATION}


@dataclasses.dataclass(frozen=True)
class Message:
  """One chat message.

  Attributes:
    role: chat role, one of 'system', 'user', 'assistant', 'tool' (what the template sees).
    content: the text. Tool calls are ``tool_format.render_tool_call`` blocks inside assistant content; a 'tool'
      message's content is the raw tool result (rendering wraps it in ``<tool_response>``).
    author: the role id every token of this message gets. None (the default) is resolved from ``role``:
      system -> SYSTEM, user -> USER, assistant -> ACT, tool -> OBSERVATION.

  Raises:
    ValueError: unknown ``role`` or non-string ``content``.
  """

  role: str
  content: str
  author: Role | None = None

  def __post_init__(self):
    if self.role not in _DEFAULT_AUTHOR:
      raise ValueError(f"Message.role must be one of {sorted(_DEFAULT_AUTHOR)}, got {self.role!r}")
    if not isinstance(self.content, str):
      raise ValueError(f"Message.content must be a str, got {type(self.content).__name__}")
    object.__setattr__(self, "author", Role(_DEFAULT_AUTHOR[self.role] if self.author is None else self.author))


# A tokenizer.json parsed once per process (SmolLM2's: ≈0.2 s; tests and the main job load the same one many times),
# and the bytes of each id once per backend. The backends are never changed after they are built (`Tokenizer` only
# reads them), so the Tokenizers of one file's content share one.
@functools.lru_cache(maxsize=4)
def _backend(data: bytes) -> tokenizers.Tokenizer:
  return tokenizers.Tokenizer.from_buffer(data)


@functools.lru_cache(maxsize=4)
def _spelled(backend: tokenizers.Tokenizer) -> tuple[bytes, ...]:
  """Each id's bytes (`Tokenizer.token_bytes`), for a backend (hashed by identity, held by the cache)."""
  added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
  to_byte = {c: b for b, c in _byte_alphabet().items()}
  out = []
  for index in range(backend.get_vocab_size(with_added_tokens=True)):
    if index in added:
      out.append(added[index].encode("utf-8"))
      continue
    token = backend.id_to_token(index) or ""
    if all(c in to_byte for c in token):
      out.append(bytes(to_byte[c] for c in token))
    else:  # not a byte-level vocabulary entry: take the decoder's word for it
      out.append(backend.decode([index], skip_special_tokens=False).encode("utf-8"))
  return tuple(out)


class Tokenizer:
  """A text tokenizer plus its chat template.

  Attributes:
    backend: the ``tokenizers.Tokenizer``.
    vocab_size: number of ids, added tokens included (SmolLM2: 49152).
    bos_id: begin-of-sequence id or None. Never added by ``encode``; chat templates write it when they want it.
    eos_ids: ids that end a generation: the eos id, plus ``<|im_end|>`` when the vocabulary has it.
    pad_id: padding id (the eos id when none is configured).
    chat_template: the jinja2 chat template, or None (``render`` then uses ``CHATML_TEMPLATE``).
  """

  def __init__(
    self,
    backend: tokenizers.Tokenizer,
    *,
    bos_token: str | None = None,
    eos_token: str | None = None,
    pad_token: str | None = None,
    unk_token: str | None = None,
    chat_template: str | None = None,
  ):
    self.backend = backend
    named = {"bos_token": bos_token, "eos_token": eos_token, "pad_token": pad_token, "unk_token": unk_token}
    self.special_tokens = {name: token for name, token in named.items() if token is not None}
    self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
    self.bos_id = self.token_to_id(bos_token) if bos_token else None
    eos = [self.token_to_id(t) for t in (eos_token, IM_END) if t]
    self.eos_ids = tuple(dict.fromkeys(i for i in eos if i is not None))
    pad = self.token_to_id(pad_token) if pad_token else None
    self.pad_id = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else None)
    self.chat_template = chat_template

  # ---------------------------------------------------------------------------------------------- construction

  @classmethod
  def from_gguf(cls, path: str | os.PathLike) -> Tokenizer:
    """Build from a GGUF file's tokenizer metadata (see ``from_gguf_metadata``)."""
    return cls.from_gguf_metadata(read_gguf_tokenizer_metadata(path))

  @classmethod
  def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
    """Build a byte-level BPE from GGUF ``tokenizer.*`` metadata (keys as in the file, values decoded).

    Control tokens (``token_type == 3``) spelled in the byte alphabet become special added tokens, user-defined
    ones (4) plain added tokens, as llama.cpp and transformers' GGUF converter do.

    Raises:
      TokenizerError: ``tokenizer.ggml.model`` is not 'gpt2' (e.g. SentencePiece 'llama'), the pre-tokenizer type
        is unsupported, or merges are missing.
    """
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
      raise TokenizerError(
        f"GGUF tokenizer.ggml.model={model!r} is not supported (only byte-level BPE, 'gpt2'). "
        "Load the model's Hugging Face directory with Tokenizer.from_hf_dir instead."
      )
    normalizer, pre_tokenizer, ignore_merges = _byte_level_pipeline(meta.get("tokenizer.ggml.pre", "gpt2"))
    tokens = list(meta.get("tokenizer.ggml.tokens") or [])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if not tokens or len(types) != len(tokens) or "tokenizer.ggml.merges" not in meta:
      raise TokenizerError("GGUF tokenizer metadata is incomplete: no tokens or merges, or token types mismatch")
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    vocab = {}
    for index, (token, kind) in enumerate(zip(tokens, types, strict=True)):
      if kind not in (3, 4) and not set(token) <= spelled:  # a plain token stored as raw text: spell its bytes
        token = "".join(alphabet[b] for b in token.encode("utf-8"))
      vocab.setdefault(token, index)
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=ignore_merges)
    backend = tokenizers.Tokenizer(bpe)
    backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    control = [t for t, k in zip(tokens, types, strict=True) if k == 3 and set(t) <= spelled]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    user = [t for t, k in zip(tokens, types, strict=True) if k == 4]
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    def name(key: str) -> str | None:
      index = meta.get(f"tokenizer.ggml.{key}")
      return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None

    return cls(
      backend,
      bos_token=name("bos_token_id"),
      eos_token=name("eos_token_id"),
      pad_token=name("padding_token_id"),
      unk_token=name("unknown_token_id"),
      chat_template=meta.get("tokenizer.chat_template"),
    )

  @classmethod
  def from_hf_dir(cls, directory: str | os.PathLike) -> Tokenizer:
    """Load ``tokenizer.json`` and, when present, ``tokenizer_config.json`` / ``chat_template.jinja``.

    Raises:
      TokenizerError: ``tokenizer.json`` is missing (save the tokenizer with transformers' ``save_pretrained``).
    """
    directory = pathlib.Path(directory)
    if not (directory / "tokenizer.json").is_file():
      raise TokenizerError(f"{directory} has no tokenizer.json; write one with transformers' save_pretrained")
    backend = _backend((directory / "tokenizer.json").read_bytes())
    config = {}
    if (directory / "tokenizer_config.json").is_file():
      config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
      template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if (directory / "chat_template.jinja").is_file():
      template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    names = {key: _special_name(config.get(key)) for key in ("bos_token", "eos_token", "pad_token", "unk_token")}
    return cls(backend, chat_template=template, **names)

  def save(self, directory: str | os.PathLike) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (special tokens, chat template) into ``directory``.

    ``transformers.AutoTokenizer.from_pretrained(directory)`` and ``Tokenizer.from_hf_dir(directory)`` load them.
    """
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    self.backend.save(str(directory / "tokenizer.json"))
    config = {
      "tokenizer_class": "PreTrainedTokenizerFast",
      "add_bos_token": False,
      "add_eos_token": False,
      "clean_up_tokenization_spaces": False,
      **self.special_tokens,
    }
    if self.chat_template is not None:
      config["chat_template"] = self.chat_template
    text = json.dumps(config, ensure_ascii=False, indent=2)
    (directory / "tokenizer_config.json").write_text(text + "\n", encoding="utf-8")

  def with_chat_template(self, chat_template: str | None) -> Tokenizer:
    """A tokenizer sharing this backend but with another chat template (None: ChatML)."""
    other = object.__new__(Tokenizer)
    other.__dict__.update(self.__dict__)
    other.chat_template = chat_template
    return other

  def __repr__(self) -> str:
    return f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_ids={self.eos_ids})"

  # ---------------------------------------------------------------------------------------------- text <-> ids

  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    """Token ids of ``text``. Special tokens written in the text (``<|im_end|>``) become their ids, as in HF.

    ``add_special_tokens`` runs the backend's post-processor (e.g. a Llama 3 tokenizer.json's BOS); default off.
    Code points the backend refuses (lone surrogates) and the official code's other ones are encoded as U+FFFD
    (``sanitize.sanitize``).
    """
    return self.backend.encode(sanitize.sanitize(text), add_special_tokens=add_special_tokens).ids

  def decode(self, ids: Sequence[int] | np.ndarray, skip_special_tokens: bool = False) -> str:
    """Text of ``ids`` (int[T]); invalid UTF-8 from a partial character decodes to U+FFFD."""
    return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def token_bytes(self) -> tuple[bytes, ...]:
    """The bytes each id stands for, indexed by id (length ``vocab_size``): special tokens as their UTF-8 text,
    byte-level tokens through GPT-2's byte alphabet. Used by the sampler to match stop strings on bytes in jit.
    Computed once per backend (SmolLM2's 49,152 ids: ≈0.25 s) and shared: every sampler of a run asks for it."""
    return _spelled(self.backend)

  def token_to_id(self, token: str) -> int | None:
    """Id of a vocabulary entry (byte-alphabet spelling, e.g. 'Ġthe') or added token; None if absent."""
    return self.backend.token_to_id(token)

  def id_to_token(self, index: int) -> str | None:
    """Vocabulary entry of an id; None if out of range."""
    return self.backend.id_to_token(int(index))

  # ---------------------------------------------------------------------------------------------- chat rendering

  @property
  def template(self) -> str:
    """The template ``render`` uses: ``chat_template`` or ``CHATML_TEMPLATE``."""
    return self.chat_template if self.chat_template is not None else CHATML_TEMPLATE

  @property
  def template_handles_tools(self) -> bool:
    """Whether the chat template reads ``tools`` itself (Qwen2.5/3); otherwise we inject the tools block."""
    return "tools" in _compile(self.template)[1]

  @property
  def template_knows_tool_role(self) -> bool:
    """Whether the template has a 'tool' role branch; otherwise tool results render as 'user' turns."""
    return re.search(r"""['"]tool['"]""", self.template) is not None

  def _prepare(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None):
    """Messages as the template sees them, and their authors: tools block injected, tool role mapped if needed."""
    chat = [{"role": m.role, "content": m.content} for m in messages]
    authors = [m.author for m in messages]
    if not self.template_knows_tool_role:
      for entry in chat:
        if entry["role"] == "tool":
          entry.update(role="user", content=tool_format.render_tool_response(entry["content"]))
    if tools and chat and not self.template_handles_tools:  # an empty conversation stays empty
      block = tool_format.render_tools_block(tools)
      if chat[0]["role"] == "system":
        chat[0]["content"] = chat[0]["content"] + "\n\n" + block
      else:
        chat.insert(0, {"role": "system", "content": block})
        authors.insert(0, Role.SYSTEM)
    return chat, authors

  def _text(self, chat: list[dict], tools: Any, add_generation_prompt: bool, kwargs: Mapping[str, Any]) -> str:
    template, _ = _compile(self.template)
    variables = {**self.special_tokens, **kwargs}
    try:  # the text as it will be tokenised: unencodable code points are U+FFFD (module docstring)
      return sanitize.sanitize(
        template.render(
          messages=chat, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **variables
        )
      )
    except jinja2.TemplateError as e:
      raise ChatTemplateError(f"chat template failed on {len(chat)} messages: {e}") from e

  def render_text(
    self,
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    **template_kwargs: Any,
  ) -> str:
    """The whole conversation as the template renders it (the text ``render``'s ids encode)."""
    chat, _ = self._prepare(messages, tools)
    template_tools = list(tools) if tools and self.template_handles_tools else None
    return self._text(chat, template_tools, add_generation_prompt, template_kwargs)

  def _pieces(self, messages, tools, add_generation_prompt, generation_role, start, template_kwargs):
    """``(text, role)`` pieces of the prepared messages after the first ``start`` input messages (all when None) and
    of the generation prompt, the text before them, and the full text."""
    chat, authors = self._prepare(messages, tools)
    # A system message injected before message 0 belongs to message 0's turn; after that, to the prefix.
    first = start + len(chat) - len(messages) if start else 0
    template_tools = list(tools) if tools and self.template_handles_tools else None

    def text(n: int, gen: bool = False) -> str:
      if n == 0 and not gen:
        try:  # templates that index messages[0] cannot render an empty conversation; it is empty text
          return self._text([], template_tools, False, template_kwargs)
        except ChatTemplateError:
          return ""
      return self._text(chat[:n], template_tools, gen, template_kwargs)

    prefix = prev = text(first)
    pieces = [(prefix, Role.SYSTEM)] if start is None else []  # whatever a template writes for no messages
    for i in range(first, len(chat)):
      cur = text(i + 1)
      if not cur.startswith(prev):
        raise ChatTemplateError(
          f"the chat template is not append-only: appending message {i} ({chat[i]['role']}) rewrites earlier text "
          "(e.g. consecutive tool messages in a Qwen template, or Qwen3 thinking blocks). Use a template that "
          "renders each message on its own (with_chat_template(None) gives ChatML)."
        )
      segment = cur[len(prev) :]
      cut = self._preamble_length(chat[0], template_tools, segment, template_kwargs) if i == 0 else 0
      pieces += [(segment[:cut], Role.SYSTEM), (segment[cut:], authors[i])]
      prev = cur
    if add_generation_prompt:
      full = text(len(chat), gen=True)
      if not full.startswith(prev):
        raise ChatTemplateError("the generation prompt rewrites the conversation's text")
      pieces.append((full[len(prev) :], generation_role))
      prev = full
    return [(t, r) for t, r in pieces if t], ("" if start is None else prefix), prev

  def _preamble_length(self, first: dict, tools: Any, segment: str, template_kwargs: Mapping[str, Any]) -> int:
    """Characters of the first segment the template adds before message 0 itself (BOS, a default system prompt).

    Message 0's own text is what the template adds when the same message comes again; when the first segment ends
    with it, the rest is the preamble. Templates that refuse a repeated message have no detectable preamble.
    """
    if first["role"] == "system":
      return 0
    try:
      once = self._text([first], tools, False, template_kwargs)
      twice = self._text([first, dict(first)], tools, False, template_kwargs)
    except ChatTemplateError:
      return 0
    own = twice[len(once) :] if twice.startswith(once) else ""
    return len(segment) - len(own) if own and segment.endswith(own) else 0

  def _ids(self, pieces: list[tuple[str, int]], full_text: str, prefix_text: str) -> tuple[np.ndarray, np.ndarray]:
    """Tokenise pieces separately; check that this equals tokenising ``full_text`` after ``prefix_text``."""
    encodings = self.backend.encode_batch([t for t, _ in pieces], add_special_tokens=False) if pieces else []
    ids = [i for e in encodings for i in e.ids]
    roles = [int(r) for e, (_, r) in zip(encodings, pieces, strict=True) for _ in e.ids]
    whole = self.encode(full_text)
    head = self.encode(prefix_text) if prefix_text else []
    if whole[: len(head)] != head or whole[len(head) :] != ids:
      raise ChatTemplateError(
        "message boundaries are not token boundaries: tokenising messages one by one differs from tokenising the "
        "whole conversation (a template that joins messages without a special token in between)"
      )
    return np.asarray(ids, dtype=np.int32), np.asarray(roles, dtype=np.int32)

  def render(
    self,
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    generation_role: Role = Role.ACT,
    **template_kwargs: Any,
  ) -> tuple[np.ndarray, np.ndarray]:
    """Render a conversation to token ids and a role id per token.

    Each message's tokens (header, content, trailer) get its ``author``; text the template adds before the first
    non-system message (BOS, a default system prompt) gets SYSTEM; the generation prompt header gets
    ``generation_role``. Tool schemas (``tools``) go to the template when it reads ``tools``, otherwise into the
    system message (``tool_format.render_tools_block``); 'tool' messages become 'user' turns wrapping
    ``<tool_response>`` when the template has no 'tool' role (their author stays OBSERVATION).

    The ids equal ``transformers``' ``apply_chat_template(..., tokenize=True)`` on the same (prepared) messages.

    Args:
      tools: OpenAI function schemas, or None.
      add_generation_prompt: append the assistant header.
      generation_role: role id of the generation prompt's tokens (ACT for the agent's view).
      **template_kwargs: extra template variables (e.g. ``enable_thinking=False``).

    Returns:
      ``(ids, roles)``, both int32[T].

    Raises:
      ChatTemplateError: the template fails, is not append-only, or its message boundaries are not token boundaries.
    """
    pieces, prefix, text = self._pieces(messages, tools, add_generation_prompt, generation_role, None, template_kwargs)
    return self._ids(pieces, text, prefix)

  def render_turn(
    self,
    messages: Sequence[Message],
    new_message: Message,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    generation_role: Role = Role.ACT,
    **template_kwargs: Any,
  ) -> tuple[np.ndarray, np.ndarray]:
    """Only the ids and roles that appending ``new_message`` to ``messages`` adds (append-only views).

    ``render(messages)`` followed by ``render_turn(messages, m)`` equals ``render(messages + [m])``. With
    ``add_generation_prompt`` the header is appended after the new message. Arguments as in ``render``.

    Returns:
      ``(ids, roles)``, both int32[T_new].

    Raises:
      ChatTemplateError: as ``render``.
    """
    full = [*messages, new_message]
    pieces, prefix, text = self._pieces(
      full, tools, add_generation_prompt, generation_role, len(messages), template_kwargs
    )
    return self._ids(pieces, text, prefix)
