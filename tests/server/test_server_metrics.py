"""ServerMetrics observes StepStats into Prometheus text that the official parser reads."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from ftrs.engine.protocol import StepStats
from ftrs.server.metrics import ServerMetrics


def _stats(step: int, **experts: float) -> StepStats:
    return StepStats(step=step, time=0.0, duration_s=0.01, kind="mixed", num_running=3,
                     num_waiting=2, prefill_tokens=100, decode_tokens=3, kv_usage_ratio=0.25,
                     prefix_hit_tokens=16, experts=dict(experts))


def _samples(m: ServerMetrics) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_cumulative_engine_counters_become_prometheus_counters() -> None:
    m = ServerMetrics()
    m.observe_step(_stats(1, h2d_bytes=1000, hits=5, misses=1, slots=32))
    m.observe_step(_stats(2, h2d_bytes=2500, hits=9, misses=1, slots=32))
    s = _samples(m)
    assert s["ftrs_pcie_bytes_total{direction=h2d}"] == 2500
    assert s["ftrs_expert_lookups_total{result=hit}"] == 9
    assert s["ftrs_expert_lookups_total{result=miss}"] == 1
    assert s["ftrs_expert_cache_slots"] == 32
    assert s["ftrs_requests_running"] == 3 and s["ftrs_requests_waiting"] == 2
    assert s["ftrs_kv_cache_usage_ratio"] == 0.25
    assert s["ftrs_prefix_cache_hit_tokens_total"] == 32
    assert s["ftrs_prefill_chunk_tokens_count"] == 2


def test_a_counter_that_goes_down_means_an_engine_restart_and_is_added_whole() -> None:
    m = ServerMetrics()
    m.observe_experts({"h2d_bytes": 1000})
    m.observe_experts({"h2d_bytes": 300})
    assert _samples(m)["ftrs_pcie_bytes_total{direction=h2d}"] == 1300


def test_device_state_is_one_hot_and_build_info_is_labelled() -> None:
    m = ServerMetrics()
    m.set_device_state("lost", up=False)
    s = _samples(m)
    assert s["ftrs_device_state{state=lost}"] == 1
    assert s["ftrs_device_state{state=ok}"] == 0
    assert s["ftrs_device_up"] == 0
    assert [k for k in s if k.startswith("ftrs_build_info{version=")]


def test_request_outcomes_and_tokens_are_counted() -> None:
    m = ServerMetrics()
    m.request_done("success", prompt_tokens=10, generation_tokens=5, latency_s=0.5)
    m.request_done("aborted", prompt_tokens=7, generation_tokens=2, latency_s=None)
    s = _samples(m)
    assert s["ftrs_requests_total{status=success}"] == 1
    assert s["ftrs_requests_total{status=aborted}"] == 1
    assert s["ftrs_prompt_tokens_total"] == 17
    assert s["ftrs_generation_tokens_total"] == 7
    assert s["ftrs_request_latency_seconds_count"] == 1


def test_pcie_bytes_are_derived_from_fetch_counts_when_the_core_does_not_report_them() -> None:
    m = ServerMetrics()
    m.observe_experts({"demand_fetches": 3, "prefetch_issued": 2, "prefetch_cancelled": 1,
                       "expert_bytes": 1000, "queue_depth": 4, "inflight_bytes": 2000})
    s = _samples(m)
    assert s["ftrs_pcie_bytes_total{direction=h2d}"] == 4000
    assert s["ftrs_transfer_queue_depth"] == 4 and s["ftrs_transfer_inflight_bytes"] == 2000
    # hybrid's fills are copies too: those started and not dropped
    m.observe_experts({"demand_fetches": 3, "prefetch_issued": 2, "prefetch_cancelled": 1,
                       "fill_issued": 5, "fill_dropped": 2, "expert_bytes": 1000})
    assert _samples(m)["ftrs_pcie_bytes_total{direction=h2d}"] == 7000


def test_fill_outcomes_are_counted_from_the_cores_cumulative_counters() -> None:
    m = ServerMetrics()
    assert _samples(m)["ftrs_expert_fill_total{outcome=issued}"] == 0  # declared before use
    m.observe_experts({"fill_issued": 4, "fill_used": 1, "fill_wasted": 0})
    m.observe_experts({"fill_issued": 9, "fill_used": 6, "fill_wasted": 2})
    s = _samples(m)
    assert s["ftrs_expert_fill_total{outcome=issued}"] == 9
    assert s["ftrs_expert_fill_total{outcome=used}"] == 6
    assert s["ftrs_expert_fill_total{outcome=wasted}"] == 2


def test_hybrid_cpu_compute_counter_and_split_estimates() -> None:
    m = ServerMetrics()
    rates = {"float32/1": 2e-3, "Q4_K/Q4_K/Q6_K/64": 1e-4}
    m.observe_experts({"cpu_computed": 7, "split_link_bytes_per_s": 0.5e9,
                       "split_link_latency_s": 1e-5, "split_cpu_s_per_token": rates})
    m.observe_experts({"cpu_computed": 12, "split_link_bytes_per_s": 0.4e9})
    s = _samples(m)
    assert s["ftrs_expert_cpu_compute_total"] == 12
    assert s["ftrs_hybrid_link_bytes_per_second"] == 0.4e9
    assert s["ftrs_hybrid_link_latency_seconds"] == 1e-5
    assert s["ftrs_hybrid_cpu_seconds_per_token{format=float32,tokens=1}"] == 2e-3
    assert s["ftrs_hybrid_cpu_seconds_per_token{format=Q4_K/Q4_K/Q6_K,tokens=64}"] == 1e-4


def test_speculative_draft_and_accepted_tokens_are_counted() -> None:
    m = ServerMetrics()
    for drafted, accepted in ((8, 5), (0, 0), (3, 0)):
        st = _stats(1)
        st.draft_tokens, st.accepted_tokens = drafted, accepted
        m.observe_step(st)
    s = _samples(m)
    assert s["ftrs_spec_draft_tokens_total"] == 11
    assert s["ftrs_spec_accepted_tokens_total"] == 5


def test_preemptions_are_counted_from_the_schedulers_cumulative_count() -> None:
    m = ServerMetrics()
    assert _samples(m)["ftrs_preemptions_total"] == 0  # declared before the first preemption
    for total in (0, 2, 2, 5):
        st = _stats(1)
        st.preemptions = total
        m.observe_step(st)
    assert _samples(m)["ftrs_preemptions_total"] == 5
    m.engine_gone()  # a new engine counts from 0 again: its count is added whole
    st = _stats(1)
    st.preemptions = 1
    m.observe_step(st)
    assert _samples(m)["ftrs_preemptions_total"] == 6


def test_device_readings_have_no_sample_until_read() -> None:
    """A host without a GPU reads no power, temperature, replays or link: no sample, not 0."""
    m = ServerMetrics()
    readings = ("ftrs_gpu_power_watts", "ftrs_gpu_temperature_celsius", "ftrs_pcie_replay_total")
    s = _samples(m)
    assert not [k for k in s if k.startswith((*readings, "ftrs_pcie_link_"))]
    families = {f.name for f in text_string_to_metric_families(m.render().decode())}
    assert {"ftrs_gpu_power_watts", "ftrs_gpu_temperature_celsius"} <= families  # HELP, TYPE
    m.observe_device({"power_watts": 210.5, "temperature_celsius": 71, "replay_total": 3,
                      "link_gen_current": 4, "link_gen_max": 4})
    s = _samples(m)
    assert s["ftrs_gpu_power_watts"] == 210.5 and s["ftrs_gpu_temperature_celsius"] == 71
    assert s["ftrs_pcie_replay_total"] == 3 and s["ftrs_pcie_link_gen{kind=current}"] == 4
    # a later sample that could not read power or the link's generation: those go absent,
    # what it does not mention stays
    m.observe_device({"power_watts": None, "link_gen_current": None, "temperature_celsius": 70})
    s = _samples(m)
    assert "ftrs_gpu_power_watts" not in s and "ftrs_pcie_link_gen{kind=current}" not in s
    assert s["ftrs_gpu_temperature_celsius"] == 70 and s["ftrs_pcie_link_gen{kind=max}"] == 4
    assert s["ftrs_pcie_replay_total"] == 3


def test_prefill_fetch_bytes_are_observed_for_steps_with_prompt_tokens_only() -> None:
    m = ServerMetrics()
    m.observe_step(_stats(1, prefill_fetch_bytes=3 << 20))
    decode = _stats(2, prefill_fetch_bytes=1 << 20)
    decode.prefill_tokens = 0
    m.observe_step(decode)
    s = _samples(m)
    assert s["ftrs_prefill_chunk_fetch_bytes_count"] == 1
    assert s["ftrs_prefill_chunk_fetch_bytes_sum"] == 3 << 20


def test_a_request_whose_client_left_before_it_ran_counts_as_aborted() -> None:
    """`ClientDisconnected` (499: refused before tokenizing because its client had gone) is an
    abort, as a client leaving while its request runs is; other 4xx are rejections."""
    from ftrs.server.errors import ClientDisconnected, InvalidRequest

    m = ServerMetrics()
    m.request_failed(ClientDisconnected("gone").http_status)
    m.request_failed(InvalidRequest("bad").http_status)
    m.request_failed(500)
    s = _samples(m)
    assert s["ftrs_requests_total{status=aborted}"] == 1
    assert s["ftrs_requests_total{status=rejected}"] == 1
    assert s["ftrs_requests_total{status=failed}"] == 1
