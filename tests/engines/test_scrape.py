"""Reading an engine's own `/metrics`: its load and its prompt tokens by source."""

from __future__ import annotations

from narwhal.engines.scrape import EXTERNAL, LOCAL_COMPUTE, EngineReport, moved, parse_report

# The shape vLLM 0.32 serves: HELP/TYPE lines, labels per engine rank, `_total` and
# `_created` samples for counters, other series around them.
VLLM_TEXT = b"""\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 4.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
# TYPE vllm:prompt_tokens_by_source counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="local_compute"} 12.0
vllm:prompt_tokens_by_source_created{engine="0",model_name="tiny",source="local_compute"} 1.7e9
vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="external_kv_transfer"} 300.0
vllm:prompt_tokens_by_source_total{engine="1",model_name="tiny",source="external_kv_transfer"} 20.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="local_cache_hit"} 0.0
vllm:cache_config_info{block_size="128",engine="0"} 1.0
process_start_time_seconds 1.7e9
"""


def test_a_vllm_report_reads_load_and_prompt_tokens_summed_over_ranks() -> None:
    report = parse_report(VLLM_TEXT)
    assert report.running == 3.0 and report.waiting == 4.0 and report.kv_cache_usage == 0.25
    assert dict(report.prompt_tokens) == {
        LOCAL_COMPUTE: 12.0,
        EXTERNAL: 320.0,
        "local_cache_hit": 0.0,
    }
    assert report.counts_sources


def test_an_engine_without_the_series_reports_none_of_them() -> None:
    report = parse_report(b"# nothing here\nprocess_start_time_seconds 1.0\n")
    assert report == EngineReport()
    assert not report.counts_sources


def test_malformed_and_non_finite_samples_are_skipped() -> None:
    text = (
        b"vllm:num_requests_running{} nope\n"
        b"vllm:num_requests_waiting NaN\n"
        b"vllm:kv_cache_usage_perc\n"
        b'vllm:prompt_tokens_by_source_total{model_name="m"} 5\n'
        b"vllm:num_requests_running 7\n"
    )
    report = parse_report(text)
    assert report.running == 7.0 and report.waiting is None and report.kv_cache_usage is None
    assert not report.prompt_tokens


def test_moved_counts_the_difference_and_starts_again_after_a_restart() -> None:
    before = parse_report(VLLM_TEXT)
    after = parse_report(VLLM_TEXT.replace(b"300.0", b"350.0"))
    assert moved(before, after, EXTERNAL) == 50.0
    assert moved(after, before, EXTERNAL) == 300.0 + 20.0  # counters went down: a new process
    assert moved(before, after, "unknown") == 0.0


def test_the_queue_time_histogram_reads_as_its_sum_and_count_over_ranks() -> None:
    text = b"""\
# HELP vllm:request_queue_time_seconds Histogram of time spent in WAITING phase for request.
# TYPE vllm:request_queue_time_seconds histogram
vllm:request_queue_time_seconds_bucket{engine="0",le="0.3",model_name="tiny"} 2.0
vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 3.0
vllm:request_queue_time_seconds_count{engine="0",model_name="tiny"} 3.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="tiny"} 4.5
vllm:request_queue_time_seconds_count{engine="1",model_name="tiny"} 1.0
vllm:request_queue_time_seconds_sum{engine="1",model_name="tiny"} 0.5
vllm:request_queue_time_seconds_created{engine="0",model_name="tiny"} 1.7e9
"""
    report = parse_report(text)
    assert (report.queue_time_sum, report.queue_time_count) == (5.0, 4.0)
    assert parse_report(VLLM_TEXT).queue_time_count is None
