"""ttft_bench.run over several models: one whose set-up cannot be measured
does not cost the others their figures, and the run still fails (no engines:
Bench is a fake here)."""
from __future__ import annotations

from typing import Any, List

import pytest

from kvkeeper.connector.bench import ttft_bench
from kvkeeper.connector.bench.ttft_matrix import ModelRun
from kvkeeper.connector.bench.verify import VerificationError
from kvkeeper.server.bench.result import Result


def fake_runs(labels: List[str]) -> List[ModelRun]:
    return [ModelRun(label, {}, (2048,), f"{label}.json") for label in labels]


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> List[str]:
    ran: List[str] = []

    class FakeBench:
        def __init__(self, run: ModelRun, *a: Any) -> None:
            self.m = run

        def run(self) -> List[Result]:
            ran.append(self.m.label)
            if self.m.label.startswith("bad"):
                raise VerificationError(f"ttft {self.m.label}: the floor is no hit")
            return [Result(f"ttft.{self.m.label}.x", 1.0, "s", "y", 2.0, "lower")]

        def close(self) -> None:
            pass

    monkeypatch.setattr(ttft_bench, "Bench", FakeBench)
    monkeypatch.setattr(ttft_bench, "check_vllm", lambda python: None)
    return ran


def test_a_model_that_cannot_be_measured_does_not_stop_the_others(fake, monkeypatch):
    monkeypatch.setattr(ttft_bench, "matrix", lambda *a: fake_runs(["q", "bad", "g"]))
    lines: List[str] = []
    with pytest.raises(VerificationError, match="bad .bad.json.: ttft bad: the floor"):
        ttft_bench.run(models=["x"], log=lines.append, python="python")
    assert fake == ["q", "bad", "g"]
    table = next(line for line in lines if "results of the models measured" in line)
    assert "ttft.q.x" in table and "ttft.g.x" in table


def test_one_model_failing_fails_as_before(fake, monkeypatch):
    monkeypatch.setattr(ttft_bench, "matrix", lambda *a: fake_runs(["bad"]))
    with pytest.raises(VerificationError, match="the floor is no hit"):
        ttft_bench.run(models=["x"], python="python")


def test_all_measured_returns_every_result(fake, monkeypatch):
    monkeypatch.setattr(ttft_bench, "matrix", lambda *a: fake_runs(["q", "g"]))
    out = ttft_bench.run(models=["x"], python="python")
    assert [r.name for r in out] == ["ttft.q.x", "ttft.g.x"]
