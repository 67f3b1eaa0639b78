"""The `syncscope` command: demo, exporter, rules, dashboards, and (syncscope.sim) simulate and project."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="syncscope", description="See and bound synchronization costs of distributed training."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    from syncscope.lab.demo import add_subcommand as add_demo
    from syncscope.monitoring.cli import add_subcommands as add_monitoring

    add_demo(sub)
    add_monitoring(sub)
    exporter = sub.add_parser(
        "exporter", help="run the node sidecar (same as syncscope-exporter)", add_help=False
    )
    exporter.set_defaults(func=lambda args: _exporter(args.rest))
    exporter.add_argument("rest", nargs=argparse.REMAINDER)
    try:
        from syncscope.sim.cli import add_subcommands as add_sim
    except ImportError:  # simulator not installed in this build
        add_sim = None
    if add_sim is not None:
        add_sim(sub)
    return parser


def _exporter(rest: list[str]) -> int:
    from syncscope.exporter.__main__ import main

    return main(rest)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
