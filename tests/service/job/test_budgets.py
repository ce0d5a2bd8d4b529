"""The accuracy budget's rules (service/job/budgets.py): one default rule per metric, in words and numbers;
an explicit budget is a relative drop; `none` is no budget."""

import dataclasses

import pytest

from service.core.outcomes import outcome
from service.job import CompressRequest
from service.job.budgets import (
    AGREEMENT,
    COSINE,
    DEFAULT_BUDGETS,
    METRICS,
    PERPLEXITY,
    TOP1,
    Metric,
    accuracy_rule,
    default_budgets_text,
)


def _request(**fields) -> CompressRequest:
    return CompressRequest(model="m", calibration="c", out_dir="o", uniform_ratio=0.5, **fields)


@pytest.mark.parametrize("metric, baseline, allowed, refused", [
    (Metric("perplexity", False), 51.68, [51.68, 60.0, 103.36], [103.37, 1800.37, float("nan"), float("inf")]),
    (Metric("cosine", True), 1.0, [1.0, 0.95, 0.9], [0.8999, 0.5, float("nan")]),
    (Metric("top1", True), 0.92, [0.92, 0.85, 0.82], [0.8199, 0.5, float("nan")]),
    (Metric("agreement", True), 1.0, [1.0, 0.95, 0.9], [0.8999, 0.32, float("nan")]),
])
def test_the_default_budget_is_one_rule_per_metric(metric, baseline, allowed, refused):
    rule = accuracy_rule(_request(), metric)
    budget = DEFAULT_BUDGETS[metric.name]
    assert rule.default and (rule.kind, rule.limit) == (budget.kind, budget.limit) and budget.why
    assert all(rule.allows(baseline, v) for v in allowed)
    assert not any(rule.allows(baseline, v) for v in refused)


def test_the_default_rules_in_words_and_numbers():
    perplexity = accuracy_rule(_request(), Metric("perplexity", False)).to_dict(51.68)
    assert perplexity["rule"] == "perplexity at most 2x dense" and perplexity["bound"] == "perplexity <= 103.3600"
    assert accuracy_rule(_request(), Metric("cosine", True)).to_dict(1.0)["bound"] == "cosine >= 0.9000"
    top1 = accuracy_rule(_request(), Metric("top1", True)).to_dict(0.92)
    assert top1["rule"] == "top1 at most 10 points below dense" and top1["worst_allowed"] == pytest.approx(0.82)


def test_an_explicit_budget_is_a_relative_drop_and_none_is_no_budget():
    for metric, baseline, ok, blown in ((Metric("perplexity", False), 10.0, 10.4, 10.6),
                                        (Metric("cosine", True), 1.0, 0.96, 0.94)):
        rule = accuracy_rule(_request(accuracy_budget=0.05), metric)
        assert not rule.default and rule.allows(baseline, ok) and not rule.allows(baseline, blown)
        assert metric.relative_drop(baseline, blown) > 0.05 >= metric.relative_drop(baseline, ok)
    assert accuracy_rule(_request(no_accuracy_budget=True), Metric("perplexity", False)) is None


def test_every_text_of_the_default_budget_comes_from_its_one_definition():
    """The rules are defined once (DEFAULT_BUDGETS); the CLI's help and the outcomes table say them from it."""
    words = default_budgets_text()
    assert words == ("perplexity at most 2x dense, cosine at least 0.9, top1 at most 10 points below dense, "
                     "agreement at least 0.9")
    assert set(METRICS) == set(DEFAULT_BUDGETS) and set(METRICS.values()) == {PERPLEXITY, COSINE, TOP1, AGREEMENT}
    help_text = next(f for f in dataclasses.fields(CompressRequest) if f.name == "accuracy_budget").metadata["help"]
    assert words in help_text
    assert words in outcome("accuracy_budget_exceeded").when
