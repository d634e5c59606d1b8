"""The example workflows' offline pieces: the stand-in model, corpus search, the outbox.

No services: nothing here enqueues a run or needs a worker.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tasks import model as m
from tasks.notifier import deliver, read_outbox, send_notification
from tasks.search import corpus, search, search_hits

TOPIC = "durable execution"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("FLEET_MODEL", "FLEET_MODEL_LATENCY", "FLEET_OUTBOX"):
        monkeypatch.delenv(name, raising=False)


def _calls(model: m.StandInModel) -> list[m.Completion]:
    plan = model.plan(TOPIC)
    assert plan.data is not None
    questions = plan.data["subquestions"]
    answers = [model.answer(q, search(q)) for q in questions]
    report = model.synthesize(TOPIC, [a.text for a in answers])
    return [plan, *answers, report]


def test_stand_in_is_deterministic() -> None:
    first, second = _calls(m.StandInModel()), _calls(m.StandInModel())
    assert first == second  # text, data and usage alike


def test_plan_gives_four_subquestions_about_the_topic() -> None:
    plan = m.StandInModel().plan(TOPIC)
    assert plan.data is not None
    questions = plan.data["subquestions"]
    assert len(questions) == 4
    assert len(set(questions)) == 4
    assert all(TOPIC in q and q.endswith("?") for q in questions)
    assert plan.text.splitlines() == questions


def test_usage_is_positive_and_priced_per_word() -> None:
    for c in _calls(m.StandInModel()):
        assert c.model == m.DEFAULT_MODEL
        assert c.input_tokens > 0 and c.output_tokens > 0
        assert c.output_tokens == len(c.text.split())
        expected = c.input_tokens * m.INPUT_PRICE + c.output_tokens * m.OUTPUT_PRICE
        assert c.cost == pytest.approx(expected)
        assert c.usage == {
            "model": c.model,
            "input_tokens": c.input_tokens,
            "output_tokens": c.output_tokens,
            "cost": c.cost,
        }


def test_answer_uses_the_passages() -> None:
    question = "How are leases fenced with an epoch?"
    answer = m.StandInModel().answer(question, search(question))
    assert "epoch" in answer.text.lower()
    empty = m.StandInModel().answer(question, [])
    assert "do not answer" in empty.text


def test_search_is_deterministic_and_returns_k() -> None:
    for k in (1, 3, 5):
        results = search("lease fencing epoch", k=k)
        assert len(results) == k
        assert results == search("lease fencing epoch", k=k)
    assert search("lease fencing epoch", k=0) == []
    with pytest.raises(ValueError, match="k must be"):
        search("x", k=-1)


def test_search_finds_the_relevant_passages() -> None:
    hits = search_hits("lease fencing epoch", k=3)
    assert hits[0].passage.source == "leases-and-fencing.md"
    assert "epoch" in hits[0].passage.text.lower()
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)
    assert search("zzz qqq") == []


def test_corpus_is_the_packaged_markdown() -> None:
    sources = {p.source for p in corpus()}
    assert 6 <= len(sources) <= 10
    assert all(s.endswith(".md") for s in sources)
    assert not any(p.text.startswith("#") for p in corpus())


def test_get_model_defaults_to_the_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(m.get_model(), m.StandInModel)
    monkeypatch.setenv("FLEET_MODEL", "tasks.model:StandInModel")
    assert isinstance(m.get_model(), m.StandInModel)
    monkeypatch.setenv("FLEET_MODEL", "no-colon")
    with pytest.raises(ValueError, match="FLEET_MODEL"):
        m.get_model()


def test_latency_is_configurable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_MODEL_LATENCY", "0.05")
    start = time.monotonic()
    m.StandInModel().plan(TOPIC)
    assert time.monotonic() - start >= 0.05
    monkeypatch.setenv("FLEET_MODEL_LATENCY", "soon")
    with pytest.raises(ValueError, match="FLEET_MODEL_LATENCY"):
        m.StandInModel().plan(TOPIC)


def test_outbox_writes_each_key_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    outbox = tmp_path / "out" / "outbox.jsonl"
    monkeypatch.setenv("FLEET_OUTBOX", str(outbox))
    ctx = SimpleNamespace(idempotency_key="run-1:send_notification#1")
    receipts = [send_notification.fn(ctx, "a@example.com", "hi") for _ in range(2)]
    assert receipts == [{"delivered": True, "key": ctx.idempotency_key}] * 2
    assert read_outbox() == [{"key": ctx.idempotency_key, "to": "a@example.com", "body": "hi"}]
    assert deliver("run-2:send_notification#1", "b@example.com", "yo", outbox) is True
    assert len(read_outbox(outbox)) == 2
