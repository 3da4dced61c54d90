"""A pytest plugin that appends one JSON line per finished test to ``--results-jsonl PATH``, as each
test ends, so a run killed at its time limit still leaves every result it reached.

    python -m pytest -p bench.pytest_jsonl --results-jsonl results.jsonl -m gpu tests/test_cuda.py

Each line: ``nodeid``, ``outcome`` (passed, failed, skipped, error), ``seconds`` (setup + call +
teardown), ``message`` (the failure or skip reason, shortened) and ``output`` (what the test printed).
"""

import json

import pytest

_MESSAGE_CHARACTERS = 4000


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--results-jsonl", default=None, help="append one JSON line per finished test here")


class _Collector:
    def __init__(self, path: str):
        self.path = path
        self.seconds: dict[str, float] = {}
        self.outcome: dict[str, tuple[str, str]] = {}
        self.output: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        nodeid = report.nodeid
        self.seconds[nodeid] = self.seconds.get(nodeid, 0.0) + report.duration
        if report.capstdout:
            self.output[nodeid] = self.output.get(nodeid, "") + report.capstdout
        if report.failed:
            outcome = "failed" if report.when == "call" else "error"
            self.outcome.setdefault(nodeid, (outcome, report.longreprtext[-_MESSAGE_CHARACTERS:]))
        elif report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.outcome.setdefault(nodeid, ("skipped", reason))
        elif report.when == "call":
            self.outcome.setdefault(nodeid, ("passed", ""))
        if report.when == "teardown":
            outcome, message = self.outcome.pop(nodeid, ("passed", ""))
            line = {"nodeid": nodeid, "outcome": outcome, "seconds": round(self.seconds.pop(nodeid), 3),
                    "message": message, "output": self.output.pop(nodeid, "")}
            with open(self.path, "a") as results:
                results.write(json.dumps(line) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--results-jsonl")
    if path:
        config.pluginmanager.register(_Collector(path), "oomless_results_jsonl")
