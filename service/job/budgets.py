"""The accuracy budget: the metrics a job scores and the rule a pruned model must keep, defined once.

`DEFAULT_BUDGETS` is the only definition of the default rules: the request's help text, the outcomes
table, the gRPC descriptor's field comment (which points here) and the README are written from it or point
to it (`default_budgets_text`). A broken model must never be reported "ok".

Light on purpose (no torch): the server's outcome mapping reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .request import CompressRequest


@dataclass(frozen=True)
class Metric:
    name: str  # one of METRICS' keys
    higher_is_better: bool

    def relative_drop(self, baseline: float, value: float) -> float:
        """Relative degradation from `baseline` (>= 0 is worse)."""
        if baseline == 0:
            return 0.0
        change = (baseline - value) if self.higher_is_better else (value - baseline)
        return change / abs(baseline)


TOP1 = Metric("top1", True)  # top-1 accuracy on labelled images
AGREEMENT = Metric("agreement", True)  # top-1 agreement with the dense model (a classifier without labels)
COSINE = Metric("cosine", True)  # mean cosine similarity of the outputs to the dense model's
PERPLEXITY = Metric("perplexity", False)  # a causal LM's perplexity on held-out text
METRICS: dict[str, Metric] = {m.name: m for m in (PERPLEXITY, COSINE, TOP1, AGREEMENT)}
# how the texts name each metric (report.html, the default rules in words)
METRIC_WORDS = {"cosine": "cosine similarity to the dense model's outputs", "perplexity": "perplexity",
                "top1": "top-1 accuracy", "agreement": "top-1 agreement with the dense model"}


@dataclass(frozen=True)
class Budget:
    """A default rule: `kind` and `limit` as AccuracyRule reads them, and why this limit."""

    kind: str
    limit: float
    why: str


DEFAULT_BUDGETS: dict[str, Budget] = {
    "perplexity": Budget("times", 2.0, "at twice the dense perplexity a language model's generations visibly "
                         "degrade (repetition, lost coherence): where one-shot pruning results are read as broken"),
    "cosine": Budget("at_least", 0.9, "outputs below cosine 0.9 to the dense ones reorder nearest-neighbour "
                     "(retrieval) rankings"),
    "top1": Budget("points", 0.10, "10 top-1 points (absolute) is the usual ceiling of \"lossy but usable\" in "
                   "structured-pruning papers"),
    "agreement": Budget("at_least", 0.90, "the same ceiling for a classifier without labels: every changed "
                        "prediction costs at most one correct one, so top-1 drops by at most 10 points"),
}
assert set(DEFAULT_BUDGETS) == set(METRICS), "every metric has a default budget"


@dataclass(frozen=True)
class AccuracyRule:
    """The worst metric a pruned model may reach, given the dense model's.

    kind: "relative" (an explicit --accuracy-budget: at most `limit` relative drop), "times" (a
    lower-is-better metric at most `limit` x dense), "at_least" (an absolute floor) or "points" (at most
    `limit` below dense, absolute)."""

    metric: Metric
    kind: str
    limit: float
    default: bool  # the metric's DEFAULT_BUDGETS rule, not the request's

    def worst(self, baseline: float) -> float:
        """The worst value of the metric still within the budget."""
        better = 1.0 if self.metric.higher_is_better else -1.0
        if self.kind == "relative":
            return baseline - better * self.limit * abs(baseline)
        if self.kind == "times":
            return baseline * self.limit
        if self.kind == "at_least":
            return self.limit
        if self.kind == "points":
            return baseline - better * self.limit
        raise ValueError(f"unknown accuracy rule {self.kind!r}")

    def allows(self, baseline: float, value: float) -> bool:
        """Whether `value` is within the budget (NaN never is)."""
        worst = self.worst(baseline)
        slack = 1e-9 * max(1.0, abs(worst))  # a value on the bound is within it (0.92 - 0.1 rounds above 0.82)
        return value >= worst - slack if self.metric.higher_is_better else value <= worst + slack

    def describe(self) -> str:
        """The rule in words, e.g. "perplexity at most 2x dense"."""
        name = self.metric.name
        return {"relative": f"{name} at most {self.limit:g} relative drop from dense",
                "times": f"{name} at most {self.limit:g}x dense",
                "at_least": f"{name} at least {self.limit:g}",
                "points": f"{name} at most {100 * self.limit:g} points below dense"}[self.kind]

    def to_dict(self, baseline: float) -> dict:
        worst = self.worst(baseline)
        return {"rule": self.describe(), "kind": self.kind, "limit": self.limit, "default": self.default,
                "worst_allowed": worst,
                "bound": f"{self.metric.name} {'>=' if self.metric.higher_is_better else '<='} {worst:.4f}"}


def default_rule(metric: Metric) -> AccuracyRule:
    budget = DEFAULT_BUDGETS[metric.name]
    return AccuracyRule(metric, budget.kind, budget.limit, default=True)


def default_budgets_text() -> str:
    """The default rules in words, one per metric ("perplexity at most 2x dense, cosine at least 0.9, ...")."""
    return ", ".join(default_rule(metric).describe() for metric in METRICS.values())


def accuracy_rule(request: CompressRequest, metric: Metric) -> AccuracyRule | None:
    """The budget in force: the request's relative drop, else the metric's default rule; None with
    `--accuracy-budget none` (no_accuracy_budget)."""
    if request.no_accuracy_budget:
        return None
    if request.accuracy_budget is not None:
        return AccuracyRule(metric, "relative", request.accuracy_budget, default=False)
    return default_rule(metric)
