"""The research agent: plan, answer each sub-question from the corpus, synthesize."""

from __future__ import annotations

from typing import Any

from fleet import RetryPolicy, StepContext, WorkflowContext
from tasks.app import MODEL_LIMITS, call_tokens, fleet
from tasks.model import DEFAULT_MODEL, Completion, get_model
from tasks.search import search, search_hits

STEP_RETRY = RetryPolicy(max_attempts=5, initial_delay=0.5, backoff=2.0, max_delay=10.0)
MAX_ROUNDS = 10
FOLLOWUPS: tuple[str, ...] = (
    "How does {topic} recover after a crash?",
    "What are the limits of {topic}?",
    "How is {topic} tested?",
)


def _spend(ctx: StepContext, completion: Completion) -> None:
    """Record one model call's usage on the step attempt."""
    ctx.record_usage(
        model=completion.model,
        input_tokens=completion.input_tokens,
        output_tokens=completion.output_tokens,
        cost=completion.cost,
    )


def _texts(answers: list[Any]) -> list[str]:
    """Answer texts from ``answer`` step outputs (dicts) or plain strings."""
    return [str(a["answer"]) if isinstance(a, dict) else str(a) for a in answers]


@fleet.step(retry=STEP_RETRY, limits=MODEL_LIMITS, tokens=call_tokens)
def llm_plan(ctx: StepContext, topic: str) -> dict[str, Any]:
    """Ask the model for sub-questions: ``{"subquestions": [...]}``."""
    completion = get_model().plan(topic)
    _spend(ctx, completion)
    lines = [line.strip() for line in completion.text.splitlines() if line.strip()]
    data = completion.data or {"subquestions": lines}
    return {"subquestions": [str(q) for q in data["subquestions"]]}


@fleet.step(retry=STEP_RETRY)
def search_docs(ctx: StepContext, question: str) -> list[str]:
    """The corpus paragraphs that best match ``question``."""
    return search(question, k=3)


@fleet.step(retry=STEP_RETRY, limits=MODEL_LIMITS, tokens=call_tokens)
def answer(ctx: StepContext, question: str) -> dict[str, Any]:
    """Search the corpus, then ask the model: ``{"question", "answer", "sources"}``."""
    hits = search_hits(question, k=3)
    completion = get_model().answer(question, [h.passage.text for h in hits])
    _spend(ctx, completion)
    return {
        "question": question,
        "answer": completion.text,
        "sources": [h.passage.ref for h in hits],
    }


@fleet.step(retry=STEP_RETRY, limits=MODEL_LIMITS, tokens=call_tokens)
def llm_critique(ctx: StepContext, topic: str, answers: list[Any], round_no: int) -> dict[str, Any]:
    """Ask the model what the answers say least clearly, and pick a follow-up question."""
    question = f"Which points about {topic} need more support?"
    completion = get_model().answer(question, _texts(answers))
    _spend(ctx, completion)
    followup = FOLLOWUPS[(round_no - 1) % len(FOLLOWUPS)].format(topic=topic)
    return {"round": round_no, "critique": completion.text, "followup": followup}


@fleet.step(retry=STEP_RETRY, limits=MODEL_LIMITS, tokens=call_tokens)
def llm_synthesize(ctx: StepContext, topic: str, answers: list[Any]) -> str:
    """Ask the model for the final report."""
    completion = get_model().synthesize(topic, _texts(answers))
    _spend(ctx, completion)
    return completion.text


@fleet.workflow(version="1", pins={"model": DEFAULT_MODEL})
def research(wf: WorkflowContext, topic: str) -> dict[str, Any]:
    """Plan → answer each sub-question in parallel → synthesize (six steps)."""
    plan = wf.step(llm_plan, topic)
    answers = wf.map(answer, plan["subquestions"])
    report = wf.step(llm_synthesize, topic, answers)
    return {"topic": topic, "report": report, "answers": [a["answer"] for a in answers]}


@fleet.workflow(version="1", pins={"model": DEFAULT_MODEL})
def research_deep(wf: WorkflowContext, topic: str, rounds: int = 2) -> dict[str, Any]:
    """``research`` with ``rounds`` of critique and a follow-up answer each (ten steps
    with the default two rounds)."""
    if not 0 <= rounds <= MAX_ROUNDS:
        raise ValueError(f"rounds must be between 0 and {MAX_ROUNDS}, got {rounds}")
    plan = wf.step(llm_plan, topic)
    answers = wf.map(answer, plan["subquestions"])
    critiques: list[str] = []
    for r in range(1, rounds + 1):
        critique = wf.step(llm_critique, topic, answers, r, key=f"critique#{r}")
        critiques.append(critique["critique"])
        answers = [*answers, wf.step(answer, critique["followup"], key=f"followup#{r}")]
    report = wf.step(llm_synthesize, topic, answers)
    return {
        "topic": topic,
        "report": report,
        "answers": [a["answer"] for a in answers],
        "critiques": critiques,
    }
