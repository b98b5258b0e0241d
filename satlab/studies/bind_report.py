"""The time-to-bind section of a recall ablation's report: per setting (the values of the axes other than the
architecture) and per arm (architecture), how many runs bound with a Wilson interval, the Kaplan-Meier median
time-to-bind with Brookmeyer and Crowley's interval, the restricted mean time-to-bind to the budget with its
interval, and the Kaplan-Meier bind curves (fraction bound by step) in one panel per setting.

Each run's ``recall/steps_to_bind`` is its first step at the bind threshold or, with ``recall/bound`` 0, its last
step: a censored time. A mean over runs of the steps alone would count a run that never bound as bound at its budget;
the Kaplan-Meier estimate counts it as "not bound by then".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from satlab.studies.ablation_claims import arch_names, point_label  # noqa: E402
from satlab.studies.ablation_plots import save_figure
from satlab.studies.ablation_spec import AblationSpec  # noqa: E402
from satlab.studies.results import GroupResult  # noqa: E402
from satlab.studies.survival import KaplanMeier, kaplan_meier, median_time, restricted_mean, wilson  # noqa: E402

BIND_KEY = "recall/steps_to_bind"
"""The MLflow key of a recall run's time-to-bind (censored at its last step when ``recall/bound`` is 0)."""
LEVEL = 0.95


@dataclass
class ArmBind:
    """One arm of one setting: its runs' bind times and the estimates the report shows."""

    setting: str
    arm: str
    km: KaplanMeier
    bound: int
    n: int
    tau: float
    fraction: tuple[float, float, float]
    median: tuple[float | None, float | None, float | None]
    restricted: tuple[float, float, float]

    def summary(self) -> dict:
        """The arm in summary.json (intervals as [lower, upper])."""
        return {"setting": self.setting, "arm": self.arm, "n": self.n, "bound": self.bound, "tau": self.tau,
                "fraction_bound": self.fraction[0], "fraction_bound_ci": list(self.fraction[1:]),
                "median_steps_to_bind": self.median[0], "median_ci": list(self.median[1:]),
                "restricted_mean_steps_to_bind": self.restricted[0], "restricted_mean_ci": list(self.restricted[1:]),
                "curve": {"steps": self.km.times.tolist(), "fraction_bound": (1 - self.km.survival).tolist()}}


def bind_samples(group: GroupResult) -> tuple[list[float], list[float]]:
    """The group's (steps to bind, bound) over the cells that logged both (runs older than the measure did not)."""
    pairs = [(c.metrics["steps_to_bind"], c.metrics["bound"]) for c in group.cells
             if c.metrics.get("steps_to_bind") is not None and c.metrics.get("bound") is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def arm_estimates(groups: Sequence[GroupResult], labels: dict[str, str], by_arch: bool) -> list[ArmBind]:
    """Per setting and arm with runs, the estimates. The restriction time tau of a setting is the smallest budget
    of its runs (every run is followed that far), or its longest time when no run reports a budget."""
    settings: dict[str, list[GroupResult]] = {}
    for group in groups:
        settings.setdefault(point_label(group) if by_arch else "", []).append(group)
    names = arch_names()
    arms = []
    for setting, members in settings.items():
        budgets = [c.budget for g in members for c in g.cells if c.budget]
        times = [t for g in members for t in bind_samples(g)[0]]
        if not times:
            continue
        tau = float(min(budgets)) if budgets else float(max(times))
        for group in members:
            steps, bound = bind_samples(group)
            if not steps:
                continue
            km = kaplan_meier(steps, bound)
            arm = names.get(group.values["model.arch"], group.values["model.arch"]) if by_arch else labels[group.label]
            k = int(sum(b > 0 for b in bound))
            arms.append(ArmBind(setting, arm, km, k, len(steps), tau, wilson(k, len(steps), LEVEL),
                                median_time(km, LEVEL), restricted_mean(km, tau, LEVEL)))
    return arms


def _interval(estimate: tuple, fmt: str = "{:,.0f}") -> str:
    value, lower, upper = (("—" if v is None else fmt.format(v)) for v in estimate)
    if estimate[0] is None:
        return f"not reached [{lower}, {upper}]" if estimate[1] is not None else "not reached"
    return f"{value} [{lower}, {'not reached' if estimate[2] is None else upper}]"


def bind_rows(arms: Sequence[ArmBind]) -> list[list[str]]:
    """The section's table, header first."""
    rows = [["setting", "arm", "bound", "fraction bound [95 % Wilson]", "median steps to bind [95 % CI]",
             "restricted mean steps to bind [95 % CI]", "to step"]]
    for a in arms:
        rows.append([a.setting or "all", a.arm, f"{a.bound}/{a.n}", _interval(a.fraction, "{:.2f}"),
                     _interval(a.median), _interval(a.restricted), f"{a.tau:,.0f}"])
    return rows


def bind_curves(arms: Sequence[ArmBind], path: Path, title: str) -> Path | None:
    """The Kaplan-Meier bind curves (fraction bound by step, 1 - S) as steps, one panel per setting, with a mark
    at each censored run's step folded into the curve's end. None without arms."""
    settings = list(dict.fromkeys(a.setting for a in arms))
    if not settings:
        return None
    columns = min(4, len(settings))
    rows = -(-len(settings) // columns)
    figure, grid = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.4 * rows), squeeze=False, sharey=True)
    for ax in grid.flat[len(settings):]:
        ax.axis("off")
    for ax, setting in zip(grid.flat, settings, strict=False):
        for i, a in enumerate(x for x in arms if x.setting == setting):
            steps = np.concatenate([[0.0], a.km.times, [a.tau]])
            bound = np.concatenate([[0.0], 1 - a.km.survival, [1 - a.km.at(a.tau)]])
            ax.step(steps, bound, where="post", color=plt.get_cmap("tab10")(i % 10),
                    label=f"{a.arm} ({a.bound}/{a.n})")
        ax.set(title=setting or "all", xlabel="step", ylim=(-0.02, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in grid[:, 0]:
        ax.set_ylabel("fraction bound (Kaplan-Meier)")
    return save_figure(figure, path, title, dpi=110)


def bind_section(spec: AblationSpec, groups: Sequence[GroupResult], labels: dict[str, str], out: Path) \
        -> tuple[list[str], list[dict], Path | None]:
    """(markdown lines, summary.json entries, figure) of the time-to-bind section; empty when no run logged it."""
    arms = arm_estimates(groups, labels, "model.arch" in spec.group_axes())
    if not arms:
        return [], [], None
    figure = bind_curves(arms, out / "bind_curves.png", f"{spec.name}: fraction of runs bound by step")
    rows = bind_rows(arms)
    lines = ["## Time to bind", "",
             "A run binds at the first validation whose held-out accuracy reaches its bind threshold "
             "(`data.mqar.stop_at_acc`, else 0.99); a run that never did is censored at its last step (its budget). "
             "Per setting and architecture: how many runs bound, with the Wilson 95 % interval of the fraction; "
             "the Kaplan-Meier median steps to bind with Brookmeyer and Crowley's 95 % interval (log-log "
             "transform, as R's `survfit(conf.type = \"log-log\")`; \"not reached\": fewer than half bound, or the "
             "interval is open to the right); and the restricted mean steps to bind to the setting's budget (the "
             "area under the Kaplan-Meier curve, i.e. the mean of the steps with a censored run counted at its "
             "budget), with a normal 95 % interval from its Greenwood-type variance. The restricted mean is the "
             "measure a sequential plan on `recall/steps_to_bind` compares, pairwise by seed.", "",
             pd.DataFrame(rows[1:], columns=rows[0]).to_markdown(index=False, disable_numparse=True), ""]
    if figure is not None:
        lines += ["![bind curves](bind_curves.png)", ""]
    return lines, [a.summary() for a in arms], figure
