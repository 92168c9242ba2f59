"""Per-table precision plans measured on the test split: the AUC a plan loses against fp32, the
tables whose quantization costs most, and the greedy search of `dlrm-export --search`.

The search starts from every table at fp32 and takes three passes, int4, then int8, then fp16: in
each, the tables still at fp32 are ordered by the AUC they lose alone at that precision (the rest
fp32), and moved one by one while the whole model stays within the budget; a pass ends at the
first table that would break it. Each step is one evaluation of the whole model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from torchrec.models.dlrm import DLRM

from dlrm.precision import serving

PASSES = ("int4", "int8", "fp16")  # lowest first: the search spends the budget on the smallest rows


class PlanEvaluator:
    """The AUC of any plan (table -> precision) of one trained model, each plan evaluated once."""

    def __init__(
        self, trained: DLRM, spec: serving.ServingSpec, evaluate: Callable[[Any], dict[str, Any]], fp32_auc: float
    ) -> None:
        self.trained, self.spec, self.evaluate, self.fp32_auc = trained, spec, evaluate, fp32_auc
        self.tables = [t.name for t in spec.tables]
        self._rows: dict[str, serving.QuantizedRows] = {}  # precision -> every table at it
        self._auc: dict[tuple[str, ...], float] = {}

    def rows(self, plan: Mapping[str, str]) -> serving.QuantizedRows:
        for precision in set(plan.values()) - set(self._rows):
            ebc = self.trained.sparse_arch.embedding_bag_collection
            self._rows[precision] = serving.quantize_rows(ebc, dict.fromkeys(self.tables, precision))
        return {t: self._rows[plan[t]][t] for t in self.tables}

    def spec_for(self, plan: Mapping[str, str]) -> serving.ServingSpec:
        tables = tuple(dataclasses.replace(t, precision=plan[t.name]) for t in self.spec.tables)
        return dataclasses.replace(self.spec, tables=tables)

    def auc(self, plan: Mapping[str, str]) -> float:
        key = tuple(plan[t] for t in self.tables)
        if key not in self._auc:
            dense = serving.dense_state(self.trained, self.spec.dense_precision)
            model = serving.build(self.spec_for(plan), self.rows(plan), dense)
            self._auc[key] = float(self.evaluate(model)["auc"])
        return self._auc[key]

    def drop(self, plan: Mapping[str, str]) -> float:
        """AUC lost against the fp32 model (negative: gained)."""
        return self.fp32_auc - self.auc(plan)


def costliest_tables(plans: PlanEvaluator, plan: Mapping[str, str]) -> dict[str, float]:
    """table -> AUC regained when that table alone goes back to fp32, costliest first (the
    tables already at fp32 are left out)."""
    base = plans.auc(plan)
    costs = {t: plans.auc({**plan, t: "fp32"}) - base for t in plans.tables if plan[t] != "fp32"}
    return dict(sorted(costs.items(), key=lambda kv: kv[1], reverse=True))


def search_plan(plans: PlanEvaluator, budget: float) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """The greedy plan within ``budget`` AUC, and its log: one entry per tried move."""
    plan = dict.fromkeys(plans.tables, "fp32")
    log: list[dict[str, Any]] = []
    for precision in PASSES:
        candidates = [t for t in plans.tables if plan[t] == "fp32"]
        alone = {t: plans.drop({**dict.fromkeys(plans.tables, "fp32"), t: precision}) for t in candidates}
        for table in sorted(candidates, key=lambda t: alone[t]):
            trial = {**plan, table: precision}
            drop = plans.drop(trial)
            kept = drop <= budget
            log.append({"table": table, "precision": precision, "drop_alone": alone[table], "drop": drop, "kept": kept})
            if not kept:
                break
            plan = trial
    return plan, log
