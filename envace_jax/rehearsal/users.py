"""User simulators outside the policy: the `UserSimulator` interface and an OpenAI-compatible chat endpoint.

An external user (``rollout.user_mode="external"``: vLLM, SGLang, a hosted API) has no tokens and no training row:
it receives the USER view's messages (`UserSimulator.reply`) and returns one message.
"""

from __future__ import annotations

import abc
import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from envace_jax.model import sanitize


class UserSimulatorError(RuntimeError):
  """A user message could not be obtained (transport failure or unusable replies after all retries). The rollout
  ends that trajectory with ``Termination.USER_ERROR``."""


class UserEndpointError(ValueError):
  """The endpoint is misconfigured (no URL or model, HTTP 3xx/401/403/404): retrying cannot help. Raised out of
  the rollout."""


class UserSimulator(abc.ABC):
  """Plays the user: one message per call."""

  @abc.abstractmethod
  def reply(self, messages: Sequence[Mapping[str, str]]) -> str:
    """The user's next message.

    Args:
      messages: OpenAI chat messages ``{"role", "content"}`` from the user's side: "system" (the scenario), "user"
        (the agent's replies), "assistant" (the simulator's own earlier messages).

    Raises:
      UserSimulatorError: no message could be obtained.
    """

  def close(self) -> None:  # noqa: B027 - optional hook
    """Releases connections."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExternalUserConfig:
  """An OpenAI-compatible chat-completions endpoint playing the user. A run's endpoint is
  ``config.rollout.external_user`` (``UnfoldConfig.from_config``); the request policy below is not a run setting.

  Attributes:
    base_url, model, api_key_env: the endpoint (``envace_jax/config/defaults.py``), ``{base_url}/chat/completions``.
    timeout_s: per-request timeout, seconds.
    max_retries: further attempts after the first (transport failures, HTTP 408/409/429/5xx, replies without text).
    backoff_s: sleep before retry r (r = 0, 1, ...) is ``min(backoff_max_s, backoff_s * 2**r)``.
    backoff_max_s: cap on one backoff sleep.
    temperature: the simulator's sampling temperature.
    max_tokens: completion budget of one user message.
    max_concurrency: requests in flight at once (one per trajectory waiting for its user).
    extra_body: merged into each request body.
  """

  base_url: str
  model: str
  api_key_env: str
  timeout_s: float = 60.0
  max_retries: int = 3
  backoff_s: float = 1.0
  backoff_max_s: float = 30.0
  temperature: float = 1.0
  max_tokens: int = 256
  max_concurrency: int = 8
  extra_body: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    for name in ("timeout_s", "max_tokens", "max_concurrency"):
      if not getattr(self, name) > 0:
        raise UserEndpointError(f"ExternalUserConfig.{name} must be > 0, got {getattr(self, name)!r}")
    for name in ("max_retries", "backoff_s", "backoff_max_s", "temperature"):
      if not getattr(self, name) >= 0:
        raise UserEndpointError(f"ExternalUserConfig.{name} must be >= 0, got {getattr(self, name)!r}")

  def url(self) -> str:
    return self.base_url.rstrip("/") + "/chat/completions"


class _Retryable(Exception):
  pass


class ExternalUser(UserSimulator):
  """A user simulator behind an OpenAI-compatible endpoint (httpx; thread-safe).

  Raises:
    UserEndpointError: no base_url or model, a base_url that is not http(s), ``api_key_env`` names an unset
      variable (at construction); HTTP 3xx/401/403/404 (from ``reply``).
  """

  def __init__(self, config: ExternalUserConfig):
    if not config.base_url or not config.model:
      raise UserEndpointError("user_mode='external' needs ExternalUserConfig.base_url and .model")
    if not config.base_url.startswith(("http://", "https://")):
      raise UserEndpointError(
        f"ExternalUserConfig.base_url must start with http:// or https://, got {config.base_url!r}"
      )
    headers = {}
    if config.api_key_env:
      key = os.environ.get(config.api_key_env)
      if not key:
        raise UserEndpointError(f"ExternalUserConfig.api_key_env names {config.api_key_env!r}, which is not set")
      headers["Authorization"] = f"Bearer {key}"
    self.config = config
    limits = httpx.Limits(max_connections=config.max_concurrency, max_keepalive_connections=config.max_concurrency)
    self._client = httpx.Client(headers=headers, timeout=httpx.Timeout(config.timeout_s), limits=limits)

  def close(self) -> None:
    self._client.close()

  def _post(self, messages: Sequence[Mapping[str, str]]) -> str:
    payload = {
      "model": self.config.model,
      # A lone surrogate (e.g. from this endpoint's own JSON escapes) cannot be sent as UTF-8: U+FFFD, as the model
      # reads it (model/sanitize.py).
      "messages": [{"role": m["role"], "content": sanitize.sanitize(m["content"])} for m in messages],
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
      raise UserEndpointError(
        f"user endpoint {url} answered HTTP {code} ({response.text[:200]!r}); check base_url, model and the API key"
      )
    if code >= 400:
      raise _Retryable(f"HTTP {code} from {url}: {response.text[:200]!r}")
    try:
      content = response.json()["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
      content = None
    if not isinstance(content, str):
      raise _Retryable(f"no chat-completions message content in {response.text[:200]!r}")
    return content

  def reply(self, messages: Sequence[Mapping[str, str]]) -> str:
    """One user message, retrying with exponential backoff. Raises `UserSimulatorError` after the last attempt."""
    cfg, last = self.config, ""
    for attempt in range(cfg.max_retries + 1):
      if attempt:
        time.sleep(min(cfg.backoff_max_s, cfg.backoff_s * 2 ** (attempt - 1)))
      try:
        return self._post(messages)
      except _Retryable as e:
        last = str(e)
    raise UserSimulatorError(f"{last} (after {cfg.max_retries + 1} attempts)")
