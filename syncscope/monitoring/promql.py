"""PromQL text shared by the rules, the alerts and the dashboards: selectors with the rank
selector applied, rates over the configured window, and the template queries alert annotations
run (Prometheus's `query`), declared once."""

from __future__ import annotations

from syncscope import catalog as M
from syncscope.thresholds import Thresholds

# The step-duration histogram's series, which rules read directly.
STEP_SECONDS_SUM = M.STEP_DURATION_SECONDS.name + "_sum"
STEP_SECONDS_COUNT = M.STEP_DURATION_SECONDS.name + "_count"
STEP_SECONDS_BUCKET = M.STEP_DURATION_SECONDS.name + "_bucket"


def sel(cfg: Thresholds, metric: str, *matchers: str) -> str:
    """``metric{<rank selector>, matchers}``; no braces at all when there is nothing to match."""
    parts = [m for m in (cfg.selectors.rank, *matchers) if m]
    return f"{metric}{{{', '.join(parts)}}}" if parts else metric


def rate(cfg: Thresholds, metric: str, *matchers: str, window: str | None = None) -> str:
    return f"rate({sel(cfg, metric, *matchers)}[{window or cfg.windows.rate}])"


def younger_than(series: str, identity: str, window: str) -> str:
    """The series of ``series`` that did not exist ``window`` ago (matched on ``identity``):
    their rates over that window cover only the few scrapes since they appeared, and a ratio
    of two such rates reads whatever the first scrapes' extrapolations make of it."""
    return f"({series} unless on ({identity}) {series} offset {window})"


def indent(expr: str, by: int) -> str:
    """``expr`` with every non-empty line indented by ``by`` spaces, for nesting PromQL."""
    return "\n".join(" " * by + line if line else line for line in expr.strip("\n").splitlines())


def block(expr: str) -> str:
    """Multi-line PromQL keeps its indentation (a literal block in YAML); one-liners stay inline."""
    return expr.strip("\n") + "\n" if "\n" in expr.strip("\n") else expr.strip()


def pct(x: float) -> str:
    return f"{x * 100:g}%"


# Alert annotations may run PromQL of their own (Prometheus' template function `query`): a
# per-job alert names its worst rank or a few examples there, where labels would split it into
# one alert per rank. THIS_JOB stands for the alert's own job in such a query.
THIS_JOB = "job=__this_job__"


def template_query(promql: str) -> str:
    """A template pipeline running ``promql`` (``THIS_JOB`` filled in from ``$labels.job``)."""
    if "`" in promql:
        raise ValueError("annotation queries are Go raw strings: no backquotes")
    n = promql.count(THIS_JOB)
    text = promql.replace("%", "%%").replace(THIS_JOB, "job=%q")
    return f"query (printf `{text}`{' $labels.job' * n})"


def listing(promql: str, item: str, sort_label: str, limit: int = 5, empty: str = "") -> str:
    """``item`` (a template over ``$s``) for the first ``limit`` series of ``promql``, comma
    separated, sorted by ``sort_label`` (as text); an ellipsis when there are more; ``empty``
    where it returns nothing."""
    otherwise = f"{{{{ else }}}}{empty}" if empty else ""
    return (
        f'{{{{ range $i, $s := {template_query(promql)} | sortByLabel "{sort_label}" }}}}'
        f"{{{{ if lt $i {limit} }}}}{{{{ if $i }}}}, {{{{ end }}}}{item}"
        f"{{{{ else if eq $i {limit} }}}}, ...{{{{ end }}}}{otherwise}{{{{ end }}}}"
    )


def seconds(x: float) -> str:
    """A PromQL duration for ``x`` seconds (whole milliseconds)."""
    ms = round(float(x) * 1000)
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"
