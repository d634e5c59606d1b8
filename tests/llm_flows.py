"""Model calls through ``fleet.llm.recording`` on real workers (``-A tests.llm_flows``),
against the stand-in model of ``tests/provider.py`` at FLEET_TEST_LLM_URL: every form a
step may call the model in (whole, streamed, the Responses API, sync and asyncio), each
step naming a limit of tokens per minute and reserving ``RESERVED`` tokens in it."""

from __future__ import annotations

import os
from typing import Any

from fleet import Fleet, RetryPolicy, StepContext, WorkflowContext
from fleet.llm import recording

fleet = Fleet("llmflows")
celery_app = fleet.celery

fleet.limit("model", tokens_per_minute=100_000, requests_per_minute=600)
RESERVED = 1000
MESSAGES = [{"role": "user", "content": "count to five"}]


def _llm(ctx: StepContext, asyncio_client: bool = False) -> Any:
    from openai import AsyncOpenAI, OpenAI

    make = AsyncOpenAI if asyncio_client else OpenAI
    return recording(
        make(base_url=os.environ["FLEET_TEST_LLM_URL"], api_key="-", max_retries=0), ctx
    )


@fleet.step(limits=["model"], tokens=lambda form: RESERVED)
def call_model(ctx: StepContext, form: str) -> str:
    """One call in ``form``: the text it was given."""
    llm = _llm(ctx)
    if form == "stream":
        chunks = llm.chat.completions.create(model="stub", messages=MESSAGES, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks)
    if form == "early-close":  # the role chunk, one word, then closed by the with block
        with llm.chat.completions.create(model="stub", messages=MESSAGES, stream=True) as s:
            return "".join(next(s).choices[0].delta.content or "" for _ in range(2))
    if form == "responses":
        return str(llm.responses.create(model="stub", input="count to five").output_text)
    if form == "responses-stream":
        events = llm.responses.create(model="stub", input="count to five", stream=True)
        return "".join(e.delta for e in events if e.type == "response.output_text.delta")
    raise ValueError(f"no form {form!r}")


@fleet.step(limits=["model"], tokens=lambda form: RESERVED)
async def acall_model(ctx: StepContext, form: str) -> str:
    """A stream of the asyncio client, read with ``async for``."""
    llm = _llm(ctx, asyncio_client=True)
    text = ""
    async for chunk in await llm.chat.completions.create(
        model="stub", messages=MESSAGES, stream=True
    ):
        text += chunk.choices[0].delta.content or ""
    return text


@fleet.workflow
def calls(wf: WorkflowContext, form: str, n: int) -> list[str]:
    """``n`` calls in ``form`` one after another."""
    step = acall_model if form == "async-stream" else call_model
    return [str(wf.step(step, form)) for _ in range(n)]


@fleet.step(
    limits=["model"],
    tokens=lambda before: RESERVED,
    retry=RetryPolicy(max_attempts=5, initial_delay=0.05, max_delay=0.1),
)
def flaky_call(ctx: StepContext, before: int) -> str:
    """Fails ``before`` times before calling the model, then once at the provider (a
    500), then calls it."""
    llm = _llm(ctx)
    if ctx.attempt <= before:
        raise RuntimeError(f"attempt {ctx.attempt} failed before calling the model")
    model = "broken" if ctx.attempt == before + 1 else "stub"
    reply = llm.chat.completions.create(model=model, messages=MESSAGES)
    return str(reply.choices[0].message.content)


@fleet.workflow
def flaky(wf: WorkflowContext, before: int) -> str:
    return str(wf.step(flaky_call, before))
