"""Automated search of the mixed-precision plan with Optuna: each trial proposes a format per
group of projections, is measured (bits per weight, mean KL on calibration windows), and Optuna's
multi-objective TPE sampler proposes the next from what it has seen; its non-dominated trials are
the Pareto front of quality against bytes.

    model + calibration windows + formats
      -> every projection quantized once in every format (round to nearest), kept aside
      -> trial: a format per group ("layer": the 4 projections of one decoder layer; "kind": one
         of qkv / o / gate_up / down in every layer) -> modules swapped in -> mean KL to the
         unquantized model's log-probs, and the plan's bits per projection weight
      -> the study's best trials (its Pareto front), to be re-measured on held-out text

The same evaluator measures any plan, so the uniform formats and the sensitivity-driven greedy plan
of mixed.py sit on the same axes as the search. Black-box search spends one forward pass per trial
and knows nothing of the model; the greedy plan spends one per projection once and then predicts.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from workbench.extras import require
from workbench.models.llama import LlamaModel
from workbench.quant.metrics import kl_divergence
from workbench.quant.mixed import (
    FORMATS,
    _logprobs,
    named_projections,
    projection_params,
    quantized,
)

GROUPINGS = ("layer", "kind")


def group_of(name: str, grouping: str) -> str:
    """'layers.3.mlp.down_proj' -> 'layer 3' (grouping 'layer') or 'down_proj' ('kind')."""
    if grouping == "layer":
        return "layer " + name.split(".")[1]
    return name.rsplit(".", 1)[1]


class PlanEvaluator:
    """Mean KL to the unquantized model, and bits per weight, of any {projection: format} plan."""

    @torch.inference_mode()
    def __init__(self, model: LlamaModel, windows: Sequence[Sequence[int]],
                 formats: Sequence[str] = tuple(FORMATS), variants: dict | None = None):
        unknown = sorted(set(formats) - set(FORMATS))
        if unknown:
            raise ValueError(f"formats {unknown} are invalid: allowed are {list(FORMATS)}")
        self.model, self.windows, self.formats = model, list(windows), tuple(formats)
        self.names = named_projections(model)
        self.originals = {n: getattr(o, a) for n, (o, a) in self.names.items()}
        dtype = model.embed_tokens.weight.dtype
        self.variants = variants or {
            n: {f: quantized(linear, f, dtype) for f in self.formats}
            for n, linear in self.originals.items()}
        self.bytes = {n: {f: q.weight_bytes() for f, q in row.items()}
                      for n, row in self.variants.items()}
        self.params = projection_params(model)
        self.reference = _logprobs(model, self.windows)

    def on(self, windows: Sequence[Sequence[int]]) -> "PlanEvaluator":
        """The same quantized modules, measured on other windows (held-out text)."""
        return PlanEvaluator(self.model, windows, self.formats, self.variants)

    def bits(self, plan: dict[str, str]) -> float:
        """Bits per decoder-projection weight, scales included."""
        return 8 * sum(self.bytes[n][plan[n]] for n in self.names) / self.params

    @torch.inference_mode()
    def kl(self, plan: dict[str, str]) -> float:
        missing = sorted(set(self.names) - set(plan))
        if missing:
            raise ValueError(f"plan has no format for {len(missing)} projection(s), such as "
                             f"{missing[0]!r}")
        try:
            for n, (owner, attr) in self.names.items():
                setattr(owner, attr, self.variants[n][plan[n]])
            kl = [kl_divergence(r, c) for r, c in zip(self.reference,
                                                      _logprobs(self.model, self.windows))]
        finally:
            for n, (owner, attr) in self.names.items():
                setattr(owner, attr, self.originals[n])
        return torch.cat(kl).mean().item()

    def uniform(self, fmt: str) -> dict[str, str]:
        return dict.fromkeys(self.names, fmt)


@dataclass
class SearchTrial:
    number: int
    groups: dict[str, str]       # group -> format, as proposed
    bits: float
    kl: float
    pareto: bool = False


@dataclass
class SearchResult:
    grouping: str
    trials: list[SearchTrial] = field(default_factory=list)

    @property
    def front(self) -> list[SearchTrial]:
        return sorted((t for t in self.trials if t.pareto), key=lambda t: t.bits)


def expand(groups: dict[str, str], names, grouping: str) -> dict[str, str]:
    """A plan per projection from a format per group."""
    return {n: groups[group_of(n, grouping)] for n in names}


def search(evaluator: PlanEvaluator, trials: int, grouping: str = "layer",
           max_bits: float | None = None, seed: int = 0) -> SearchResult:
    """`trials` Optuna trials minimizing (mean KL, bits per weight); with `max_bits`, plans above
    it are infeasible (Optuna's constraints) and kept off the front."""
    optuna = require("optuna", "the mixed-precision search")
    if grouping not in GROUPINGS:
        raise ValueError(f"grouping={grouping!r} is invalid: allowed are {list(GROUPINGS)}")
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ValueError(f"trials={trials!r} is invalid: it must be an integer >= 1")
    groups = list(dict.fromkeys(group_of(n, grouping) for n in evaluator.names))

    sampler = optuna.samplers.TPESampler(
        seed=seed, multivariate=True, n_startup_trials=min(10, max(trials // 3, 1)))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(directions=["minimize", "minimize"], sampler=sampler)

    def objective(trial):
        chosen = {g: trial.suggest_categorical(g, list(evaluator.formats)) for g in groups}
        plan = expand(chosen, evaluator.names, grouping)
        bits = evaluator.bits(plan)
        if max_bits is not None:     # feasible when <= 0
            trial.set_constraint("bits", bits - max_bits)
        return evaluator.kl(plan), bits

    study.optimize(objective, n_trials=trials)
    best = {t.number for t in study.best_trials}
    return SearchResult(grouping, [
        SearchTrial(t.number, dict(t.params), t.values[1], t.values[0], t.number in best)
        for t in study.trials])


def pareto(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the non-dominated (bits, kl) points, both minimized, by increasing bits."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front, best_kl = [], float("inf")
    for i in order:
        if points[i][1] < best_kl:
            front.append(i)
            best_kl = points[i][1]
    return front
