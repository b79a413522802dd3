"""The `narwhal` command line: one subcommand per job, each handing off to its own module."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from narwhal.config.workers import Workers


def _parser() -> argparse.ArgumentParser:
    from narwhal.config.environment import admin_key
    from narwhal.tools.goodput.command import add_goodput_arguments
    from narwhal.tools.sim.options import add_sim_arguments

    parser = argparse.ArgumentParser(prog="narwhal", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the router over the fleet in a config file")
    serve.add_argument("--config", required=True, type=Path, help="FLEET.toml or FLEET.json")
    serve.add_argument("--host", help="override server.host")
    serve.add_argument("--port", type=int, help="override server.port")
    serve.add_argument(
        "--skip-preflight", action="store_true", help="serve even if engine checks fail"
    )
    serve.add_argument(
        "--workers",
        type=_workers,
        help="router processes on the port, or auto (one per usable core); "
        "overrides server.workers",
    )
    _add_log_format(serve)

    reload = sub.add_parser(
        "reload", help="make a running router re-read its config file (as SIGHUP does)"
    )
    reload.add_argument(
        "--config",
        required=True,
        type=Path,
        help="the router's FLEET file: checked here; gives the router's address and admin key",
    )
    reload.add_argument(
        "--url", help="the router, e.g. http://10.0.0.2:8000 (default: from --config)"
    )

    check = sub.add_parser("check", help="preflight: engine contract and KV transfers")
    check.add_argument("--config", required=True, type=Path, help="FLEET.toml or FLEET.json")
    check.add_argument("--mesh", action="store_true", help="probe every ordered engine pair")

    dev = sub.add_parser("dev", help="run a local simulated (or real vLLM) fleet plus the router")
    dev.add_argument(
        "--engine",
        choices=("sim", "vllm"),
        default="sim",
        help="simulated engines (default), or one prefill and one decode real vLLM engine on "
        "the CPU with a tiny model (installs .venv-vllm on first use; needs a source checkout)",
    )
    dev.add_argument("--host", default="127.0.0.1")
    dev.add_argument("--port", type=int, default=8000)
    dev.add_argument("--journal", help="append the request journal to this file")
    _add_log_format(dev)

    journal = sub.add_parser("journal", help="read request journals")
    journal_sub = journal.add_subparsers(dest="journal_command", required=True)
    summarize = journal_sub.add_parser("summarize", help="print a summary of a journal file")
    summarize.add_argument("file", type=Path)

    config = sub.add_parser("config", help="work with fleet configuration files")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    validate = config_sub.add_parser("validate", help="check a config file and report problems")
    validate.add_argument("file", type=Path)

    chaos = sub.add_parser(
        "chaos", help="soak a simulated fleet and the router under random faults, then check"
    )
    amount = chaos.add_mutually_exclusive_group()
    amount.add_argument("--requests", type=_count, default=1000, help="requests to send")
    amount.add_argument("--minutes", type=_span, help="send requests for this long instead")
    chaos.add_argument("--seed", type=int, default=0, help="fixes every random choice")
    chaos.add_argument("--prefill", type=_count, default=2, help="prefill engines")
    chaos.add_argument("--decode", type=_count, default=3, help="decode engines")
    chaos.add_argument("--concurrency", type=_count, default=32, help="clients at once")
    chaos.add_argument(
        "--controller",
        action="store_true",
        help="engines of role both, moved by the role controller during the soak",
    )
    chaos.add_argument(
        "--no-continuation",
        dest="continuation",
        action="store_false",
        help="run the router with stream continuation off (its check then fails)",
    )

    top = sub.add_parser("top", help="a live terminal view of a running router")
    top.add_argument("--url", default="http://127.0.0.1:8000", help="the router's base URL")
    top.add_argument(
        "--admin-key",
        default=admin_key(),
        help="admin key, when the router has server.admin_api_keys (or NARWHAL_ADMIN_KEY)",
    )
    top.add_argument("--interval", type=_span, default=1.0, help="seconds between refreshes")
    top.add_argument("--once", action="store_true", help="print one frame and exit")

    goodput = sub.add_parser(
        "goodput",
        help="replay a load trace over every static prefill/decode split of simulated engines",
    )
    add_goodput_arguments(goodput)

    sim = sub.add_parser("sim", help="run one simulated vLLM engine")
    add_sim_arguments(sim)

    # Listed for --help only: main() hands every argument after `bench` to the harness.
    sub.add_parser(
        "bench",
        help="benchmark the router against the direct path and peers (`narwhal bench --help`)",
        add_help=False,
    )
    return parser


def _count(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _workers(text: str) -> Workers:
    from narwhal.config.workers import parse_workers_flag

    try:
        return parse_workers_flag(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _span(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def _add_log_format(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="event log lines on stderr: human-readable text (default) or JSON",
    )


def _bench(argv: list[str]) -> int:
    """The harness lives in the source tree's benchmarks/, which is not installed."""
    import importlib

    benchmarks = Path(__file__).resolve().parents[3] / "benchmarks"
    if not (benchmarks / "router_bench.py").exists():
        print("narwhal bench: needs a source checkout (benchmarks/)", file=sys.stderr)
        return 2
    sys.path.insert(0, str(benchmarks))
    # `--workers N` compares one process with N workers (benchmarks/workers_bench.py);
    # `--placement` the placement policies on traces (benchmarks/placement_bench.py);
    # `--tenant` multi-tenant load (benchmarks/tenant_bench.py), with its own `--workers`.
    harness = (
        "workers_bench" if any(a.split("=")[0] == "--workers" for a in argv) else "router_bench"
    )
    if "--placement" in argv:
        harness = "placement_bench"
    if any(a.split("=")[0] == "--tenant" for a in argv):
        harness = "tenant_bench"
    status: int = importlib.import_module(harness).main(argv)
    return status


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        sys.exit(_bench(argv[1:]))
    args = _parser().parse_args(argv)
    from narwhal.runtime import main as runtime

    if args.command == "sim":
        from narwhal.tools.sim.serve import run_sim

        sys.exit(run_sim(args))
    if args.command == "config":
        from narwhal.config.report import validate_command

        sys.exit(validate_command(args.file))
    if args.command == "journal":
        from narwhal.observe.journal_summary import summarize_command

        sys.exit(summarize_command(args.file))
    if args.command in ("dev", "serve"):
        from narwhal.observe.events import configure_logging

        configure_logging(args.log_format)
    if args.command == "dev":
        from narwhal.commands.dev import run_dev

        sys.exit(runtime.run(run_dev(args.host, args.port, args.journal, args.engine), server=True))
    if args.command == "serve":
        from narwhal.commands.serve import run_serve

        sys.exit(
            runtime.run(
                run_serve(
                    args.config,
                    args.host,
                    args.port,
                    skip_preflight=args.skip_preflight,
                    workers=args.workers,
                    log_format=args.log_format,
                ),
                server=True,
            )
        )
    if args.command == "chaos":
        from narwhal.tools.chaos import ChaosOptions, chaos_command

        options = ChaosOptions(
            requests=args.requests,
            minutes=args.minutes,
            seed=args.seed,
            prefill=args.prefill,
            decode=args.decode,
            concurrency=args.concurrency,
            controller=args.controller,
            continuation=args.continuation,
        )
        sys.exit(runtime.run(chaos_command(options)))
    if args.command == "goodput":
        from narwhal.tools.goodput.command import goodput_command

        sys.exit(runtime.run(goodput_command(args)))
    if args.command == "reload":
        from narwhal.commands.reload import reload_command

        sys.exit(runtime.run(reload_command(args.config, args.url)))
    if args.command == "top":
        from narwhal.commands.top_terminal import run_top

        sys.exit(runtime.run(run_top(args.url, args.admin_key, args.interval, args.once)))
    if args.command == "check":
        from narwhal.fleet.preflight import check_command

        sys.exit(runtime.run(check_command(args.config, args.mesh)))
