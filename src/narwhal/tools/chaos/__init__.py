"""`narwhal chaos`: a soak of a simulated fleet and a real router under random faults.

Clients send a steady concurrent load over loopback, some leaving part-way; engines
misbehave in every way the simulator knows, and crash and come back. At the end the run is
judged on what the router promises: one journal line per request, statuses that follow
from their causes, clients seeing what the journal says, nothing left in flight, steady
memory and no unhandled exception. The seed fixes every random choice, not the timing.

| module | job |
|---|---|
| `options` | what a run is asked to do |
| `faults` | fault draws, outages, the injector |
| `load` | the clients and what each was told |
| `downtime` | when each engine did not accept connections |
| `checks` | the rules, as pure functions |
| `tally` | counting outcomes and problems as they come |
| `memory` | the RSS trend |
| `report` | what a run measured and found, as text |
| `run` | the fleet, the router and the run itself |
"""

from narwhal.tools.chaos.checks import (
    CLIENT_CLOSED,
    check_leaks,
    check_service,
    line_problems,
    no_engine_problems,
    status_allowed,
    unavailable_reason,
    view_problems,
)
from narwhal.tools.chaos.downtime import Downtime
from narwhal.tools.chaos.faults import FAULTS, OUTAGE, Outages, inject
from narwhal.tools.chaos.load import Load, Sent, terminal_code
from narwhal.tools.chaos.memory import Trend, memory_trend, rss_bytes
from narwhal.tools.chaos.options import ChaosOptions
from narwhal.tools.chaos.report import Report, format_report
from narwhal.tools.chaos.run import chaos_command, run_chaos
from narwhal.tools.chaos.tally import Problems, Tally

__all__ = [
    "CLIENT_CLOSED",
    "FAULTS",
    "OUTAGE",
    "ChaosOptions",
    "Downtime",
    "Load",
    "Outages",
    "Problems",
    "Report",
    "Sent",
    "Tally",
    "Trend",
    "chaos_command",
    "check_leaks",
    "check_service",
    "format_report",
    "inject",
    "line_problems",
    "memory_trend",
    "no_engine_problems",
    "rss_bytes",
    "run_chaos",
    "status_allowed",
    "terminal_code",
    "unavailable_reason",
    "view_problems",
]
