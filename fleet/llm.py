"""Usage recorded automatically from an OpenAI-compatible client (optional extra
``fleet[openai]``; any client with ``chat.completions.create`` returning a ``usage``
with ``prompt_tokens`` and ``completion_tokens`` works, the official one included).

    @fleet.step
    def summarise(ctx, text: str) -> str:
        llm = recording(OpenAI(base_url=..., api_key=...), ctx, prices=PRICES)
        reply = llm.chat.completions.create(model="gpt-x", messages=[...])
        return reply.choices[0].message.content
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol


class UsageSink(Protocol):
    def record_usage(
        self,
        model: str | None = None,
        input_tokens: int = 0,
        output_tokens: int = 0,
        cost: float = 0.0,
    ) -> None: ...


# Prices per token: {"model": (input, output)}.
Prices = Mapping[str, tuple[float, float]]


def _field(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


class _Completions:
    def __init__(self, inner: Any, ctx: UsageSink, prices: Prices) -> None:
        self._inner, self._ctx, self._prices = inner, ctx, prices

    def create(self, **kwargs: Any) -> Any:
        response = self._inner.create(**kwargs)
        usage = _field(response, "usage")
        model = _field(response, "model") or kwargs.get("model")
        tin = int(_field(usage, "prompt_tokens", 0) or 0) if usage is not None else 0
        tout = int(_field(usage, "completion_tokens", 0) or 0) if usage is not None else 0
        price_in, price_out = self._prices.get(str(model), (0.0, 0.0))
        self._ctx.record_usage(
            model=model,
            input_tokens=tin,
            output_tokens=tout,
            cost=tin * price_in + tout * price_out,
        )
        return response


class _Chat:
    def __init__(self, completions: _Completions) -> None:
        self.completions = completions


class RecordingClient:
    """The client, with every chat completion's usage recorded on the step attempt."""

    def __init__(self, client: Any, ctx: UsageSink, prices: Prices | None = None) -> None:
        self._client = client
        self.chat = _Chat(_Completions(client.chat.completions, ctx, prices or {}))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def recording(client: Any, ctx: UsageSink, prices: Prices | None = None) -> RecordingClient:
    return RecordingClient(client, ctx, prices)
