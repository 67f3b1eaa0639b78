"""`syncscope rules`, `syncscope dashboards` and `syncscope generate`: the monitoring files on demand."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from syncscope.thresholds import checked_overrides, fast_for_overrides, load_config


def add_subcommands(sub: Any) -> None:
    rules = sub.add_parser(
        "rules", help="print syncscope's Prometheus recording and alerting rules (YAML)"
    )
    _threshold_options(rules)
    rules.add_argument("--out", type=Path, help="write syncscope.rules.yml into this folder")
    rules.add_argument(
        "--engine",
        choices=("prometheus", "vmalert"),
        default="prometheus",
        help="the evaluator: Prometheus (default) or vmalert with VictoriaMetrics",
    )
    rules.set_defaults(func=_rules)

    dash = sub.add_parser("dashboards", help="write syncscope's Grafana dashboards (JSON)")
    _threshold_options(dash)
    dash.add_argument("--out", type=Path, required=True, help="folder to write them into")
    dash.set_defaults(func=_dashboards)

    gen = sub.add_parser(
        "generate", help="rewrite a checkout's generated files (rules, dashboards, contract)"
    )
    gen.add_argument("--root", type=Path, default=Path.cwd(), help="the checkout (default: .)")
    gen.add_argument("--check", action="store_true", help="exit 1 if any of them is stale")
    gen.set_defaults(func=_generate)


def _threshold_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="override one threshold, e.g. alerts.SyncscopeStraggler.levels.0.threshold=0.3",
    )
    p.add_argument(
        "--fast-for",
        metavar="DURATION",
        help="the straggler's for: becomes this, the others keep their ratio to it",
    )


def _overrides(args: argparse.Namespace) -> dict[str, Any] | None:
    """The --fast-for and --set overrides, checked against the thresholds file; None: reported."""
    try:
        fast = fast_for_overrides(load_config(), args.fast_for) if args.fast_for else {}
        overrides, _ = checked_overrides(args.set, fast)  # a bad path is reported here
    except (KeyError, ValueError, IndexError) as exc:
        print(f"syncscope {args.command}: {exc}", file=sys.stderr)
        return None
    return overrides


def _rules(args: argparse.Namespace) -> int:
    from syncscope.monitoring import engines

    overrides = _overrides(args)
    if overrides is None:
        return 2
    if args.out:
        print(engines.write_rules(args.out, overrides, args.engine))
    else:
        sys.stdout.write(engines.render_rules_yaml(load_config(overrides), args.engine))
    return 0


def _dashboards(args: argparse.Namespace) -> int:
    from syncscope.monitoring import dashboards

    overrides = _overrides(args)
    if overrides is None:
        return 2
    for path in dashboards.write_dashboards(args.out, overrides):
        print(path)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from syncscope.monitoring import generate

    return generate.main(args.root.resolve(), args.check)
