"""The `narwhal` command line: one subcommand per job, each handing off to its own module."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="narwhal", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from narwhal.sim.options import add_sim_arguments

    sim = sub.add_parser("sim", help="run one simulated vLLM engine")
    add_sim_arguments(sim)

    args = parser.parse_args(argv)
    if args.command == "sim":
        from narwhal.sim.serve import run_sim

        sys.exit(run_sim(args))
