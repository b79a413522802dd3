"""What an engine's `/metrics` shows: counters kept by the request path, and their text.

Series names, labels and help texts follow vLLM 0.32's (a subset of them), so the router's
scrapes read a simulated engine exactly as a real one.
"""

from __future__ import annotations

from dataclasses import dataclass

from narwhal.tools.sim.options import SimOptions
from narwhal.tools.sim.scheduler import Scheduler


@dataclass(slots=True)
class Counters:
    """What `/metrics` counts, as vLLM 0.32 names it: prompt tokens by where their KV came
    from (`vllm:prompt_tokens_by_source`) and the NixlConnector's failed and expired pulls."""

    local_compute: int = 0
    local_cache_hit: int = 0
    external_kv_transfer: int = 0
    generation_tokens: int = 0
    nixl_failed_transfers: int = 0
    nixl_expired_requests: int = 0
    # The prefix cache as vLLM counts it (`vllm:prefix_cache_queries`, `…_hits`): every
    # request's prompt tokens queried, and those its local cache held.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # KV pulls whose blocks were computed with another adapter than the request's (the
    # sim's own count; vLLM does not see it, see `/sim/handoffs`).
    crossed_adapter_pulls: int = 0

    def expired(self) -> None:
        self.nixl_expired_requests += 1


def render_metrics(
    options: SimOptions, scheduler: Scheduler, counters: Counters, start_time: float
) -> str:
    """Prometheus text for one engine."""
    labels = f'model_name="{options.model}",engine="0"'
    lines: list[str] = []

    def series(kind: str, name: str, help_text: str, values: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
        suffix = "_total" if kind == "counter" else ""
        lines.extend(f"{name}{suffix}{{{extra}}} {float(value)}" for extra, value in values)

    series(
        "gauge",
        "vllm:num_requests_running",
        "Requests in the running batch.",
        [(labels, scheduler.running)],
    )
    series(
        "gauge",
        "vllm:num_requests_waiting",
        "Requests waiting to be scheduled.",
        [(labels, scheduler.waiting)],
    )
    series(
        "gauge",
        "vllm:kv_cache_usage_perc",
        "KV-cache usage, 1 means 100 percent.",
        [(labels, scheduler.kv_usage)],
    )
    # vLLM's histogram, its sum and count (and the one bucket that holds every request).
    name = "vllm:request_queue_time_seconds"
    lines += [
        f"# HELP {name} Histogram of time spent in WAITING phase for request.",
        f"# TYPE {name} histogram",
        f'{name}_bucket{{{labels},le="+Inf"}} {float(scheduler.queue_time_count)}',
        f"{name}_sum{{{labels}}} {scheduler.queue_time_sum}",
        f"{name}_count{{{labels}}} {float(scheduler.queue_time_count)}",
    ]
    # An info metric: a gauge at 1 whose labels are the cache configuration.
    cache_config = (
        f'block_size="{options.kv_block_size}",cache_dtype="auto",'
        f'enable_prefix_caching="True",num_gpu_blocks="{options.num_kv_blocks}",'
        'engine="0"'
    )
    series(
        "gauge",
        "vllm:cache_config_info",
        "Information of the LLMEngine CacheConfig",
        [(cache_config, 1)],
    )
    sources = {
        "local_compute": counters.local_compute,
        "local_cache_hit": counters.local_cache_hit,
        "external_kv_transfer": counters.external_kv_transfer,
    }
    prompt_tokens = sum(sources.values())
    series(
        "counter",
        "vllm:prompt_tokens",
        "Number of prefill tokens processed.",
        [(labels, prompt_tokens)],
    )
    series(
        "counter",
        "vllm:prompt_tokens_by_source",
        "Number of prompt tokens by source.",
        [(f'{labels},source="{source}"', value) for source, value in sources.items()],
    )
    series(
        "counter",
        "vllm:prompt_tokens_cached",
        "Number of cached prompt tokens (local + external).",
        [(labels, prompt_tokens - counters.local_compute)],
    )
    series(
        "counter",
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        [(labels, counters.prefix_cache_queries)],
    )
    series(
        "counter",
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        [(labels, counters.prefix_cache_hits)],
    )
    series(
        "counter",
        "vllm:generation_tokens",
        "Number of generation tokens processed.",
        [(labels, counters.generation_tokens)],
    )
    series(
        "counter",
        "vllm:nixl_num_failed_transfers",
        "Number of failed NIXL KV Cache transfers.",
        [(labels, counters.nixl_failed_transfers)],
    )
    series(
        "counter",
        "vllm:nixl_num_kv_expired_reqs",
        "Number of requests that had their KV expire.",
        [(labels, counters.nixl_expired_requests)],
    )
    lines += [
        "# HELP process_start_time_seconds Start time of the process since unix epoch.",
        "# TYPE process_start_time_seconds gauge",
        f"process_start_time_seconds {start_time}",
    ]
    return "\n".join(lines) + "\n"
