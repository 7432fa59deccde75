"""The advisor's PD estimate from AIConfigurator's database (``advisor/pd.py``):
both numbers against direct calls to the package made here, a GPU or model
the database lacks said so without failing the report, and the estimate in
the kept report's JSON, reused (not swept again) by a request."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from aiconfigurator_core.sdk.backends.factory import get_backend
from aiconfigurator_core.sdk.config import RuntimeConfig
from aiconfigurator_core.sdk.config_builders import build_model_config
from aiconfigurator_core.sdk.memory import estimate_kv_cache
from aiconfigurator_core.sdk.models import get_model
from aiconfigurator_core.sdk.perf_database import get_database
from django.test import Client
from django.utils import timezone

from controlplane.accounts.roles import Role
from controlplane.advisor import pd, tasks, verdicts
from controlplane.advisor.models import AdvisorReport
from controlplane.fleet.models import Pool, Worker
from controlplane.gateway.models import RequestLog
from controlplane.metrics.models import ServiceObjectives
from tests.controlplane.factories import api_client, make_pool, make_user

LLAMA_8B = "meta-llama/Meta-Llama-3.1-8B"
ISL, OSL = 4096, 256
TTFT_SECONDS, TPOT_SECONDS = 1.0, 0.03
VERSION = "0.24.0"
SIM_DEVICE: dict[str, Any] = {
    "kind": "aiconfigurator",
    "system": "h200_sxm",
    "backend": "vllm",
    "database_version": VERSION,
    "model": LLAMA_8B,
}
SIM_HARDWARE: dict[str, Any] = {
    "device": "sim",
    "name": "H200 SXM (simulated)",
    "num_devices": 1,
    "memory_bytes": 141 * 10**9,
    "simulated": True,
    "sim": SIM_DEVICE,
}


def model_at(tp: int) -> Any:
    return get_model(
        LLAMA_8B, build_model_config(tp_size=tp, pp_size=1, attention_dp_size=1, moe_tp_size=1, moe_ep_size=1), "vllm"
    )


def runtime(batch_size: int) -> RuntimeConfig:
    return RuntimeConfig(batch_size=batch_size, isl=ISL, osl=OSL, ttft=TTFT_SECONDS * 1000, tpot=TPOT_SECONDS * 1000)


@pytest.fixture(scope="module")
def target() -> pd.Target:
    return pd.Target("h200_sxm", "vllm", VERSION, LLAMA_8B, ISL, OSL, TTFT_SECONDS, TPOT_SECONDS, 25.0)


def test_llama_8b_on_h200_both_sides_are_the_packages_own_figures(target: pd.Target) -> None:
    est = pd.estimate(target)
    assert est.unavailable == ""
    database = get_database("h200_sxm", "vllm", VERSION)
    assert database is not None

    # Aggregated: the package's own chunked sweep, best over the TP sizes.
    agg_rows = []
    for tp in pd.TP_SIZES:
        frame = (
            get_backend("vllm")
            .find_best_agg_result_under_constraints(
                model_at(tp),
                database,
                runtime(1),
                top_k=1,
                max_batch_size=512,
                ctx_stride=512,
                enable_chunked_prefill=True,
            )
            .get_summary_df()
        )
        if not frame.empty:
            agg_rows.append(frame.iloc[0])
    best_agg = max(agg_rows, key=lambda row: row["tokens/s/gpu"])
    assert est.agg_tokens_per_second_per_gpu == float(best_agg["tokens/s/gpu"])
    assert est.agg_best["ttft_seconds"] <= TTFT_SECONDS and est.agg_best["tpot_seconds"] <= TPOT_SECONDS

    # Disaggregated: the chosen prefill and decode workers' rates, straight from
    # run_static, rate-matched with the chosen worker counts.
    best = est.disagg_best
    prefill = get_backend("vllm").run_static(
        model_at(best["prefill_tp"]), database, runtime(best["prefill_batch_size"]), "static_ctx"
    )
    decode = get_backend("vllm").run_static(
        model_at(best["decode_tp"]), database, runtime(best["decode_batch_size"]), "static_gen"
    )
    prefill_rate = float(prefill.get_summary_df().iloc[0]["seq/s"])
    decode_rate = float(decode.get_summary_df().iloc[0]["seq/s"])
    matched = min(
        prefill_rate * best["prefill_workers"] * pd.PREFILL_DEGRADATION,
        decode_rate * best["decode_workers"] * pd.DECODE_DEGRADATION,
    )
    gpus = best["prefill_tp"] * best["prefill_workers"] + best["decode_tp"] * best["decode_workers"]
    assert est.disagg_tokens_per_second_per_gpu == pytest.approx(matched * OSL / gpus, rel=1e-12)
    assert best["num_gpus"] == gpus

    # The KV transfer: the prompt's KV, at the database's bytes per token, over the link.
    kv = estimate_kv_cache(
        LLAMA_8B,
        "h200_sxm",
        "vllm",
        VERSION,
        max_num_tokens=pd.PREFILL_MAX_NUM_TOKENS,
        max_batch_size=256,
        memory_fraction_kind="of_total",
        memory_fraction_value=pd.KV_MEMORY_FRACTION,
    )["kv_size_per_token_bytes"]
    assert best["transfer_seconds"] == pytest.approx(ISL * kv / 25e9)
    prefill_ttft = float(prefill.get_summary_df().iloc[0]["ttft"]) / 1000
    assert best["ttft_seconds"] == pytest.approx(prefill_ttft * pd.TTFT_QUEUEING_FACTOR + best["transfer_seconds"])
    assert best["ttft_seconds"] < TTFT_SECONDS and best["tpot_seconds"] < TPOT_SECONDS
    assert est.inputs["kv_bytes_per_token"] == kv
    assert pd.estimate(target) is est  # cached: the round does not sweep twice


def test_the_finding_compares_the_two_and_keeps_the_formula_beside(target: pd.Target) -> None:
    est = pd.estimate(target)
    t = verdicts.Thresholds()
    formula = verdicts.pd_estimate(131072, 1e-4, verdicts.Question("head_of_line", "", t, ()).no(1, {}, ""), t)
    found = verdicts.pd_database(est, formula, t)
    assert est.disagg_tokens_per_second_per_gpu is not None and est.agg_tokens_per_second_per_gpu
    gain = est.disagg_tokens_per_second_per_gpu / est.agg_tokens_per_second_per_gpu
    assert found.figures["disagg_over_agg"] == pytest.approx(gain)
    assert found.answer == (verdicts.Answer.YES if gain >= t.pd_min_gain else verdicts.Answer.NO)
    assert "estimate from the database" in found.reasons[0]
    assert found.reasons[-1] == "The formula's cross-check above says no."
    assert found.chart["estimate"]["inputs"]["system"] == "h200_sxm"


@pytest.mark.parametrize(
    ("name", "system"),
    [
        ("NVIDIA H200", "h200_sxm"),
        ("NVIDIA GB200", "gb200"),
        ("NVIDIA B200", "b200_sxm"),
        ("NVIDIA H100 80GB HBM3", "h100_sxm"),
        ("NVIDIA H100 PCIe", "h100_pcie"),
        ("NVIDIA A100 80GB PCIe", "a100_pcie"),
        ("NVIDIA L40S", "l40s"),
        ("Tesla T4", None),
    ],
)
def test_a_torch_device_name_maps_to_the_databases_system(name: str, system: str | None) -> None:
    assert pd.system_for_gpu(name) == system


@pytest.mark.parametrize(("mean", "rounded"), [(4096, 4096), (4000, 3968), (4150.5, 4096), (256, 256), (7.4, 7)])
def test_lengths_round_to_five_significant_bits(mean: float, rounded: int) -> None:
    assert pd.round_tokens(mean) == rounded


def test_a_served_model_maps_to_the_packaged_one_only_when_it_matches() -> None:
    assert pd.packaged_model("meta-llama/Llama-3.1-8B-Instruct") == LLAMA_8B
    assert pd.packaged_model(LLAMA_8B) == LLAMA_8B
    assert pd.packaged_model("tiny") is None


# ---- in the report -----------------------------------------------------------------------


def traffic(pool: Pool, worker: Worker, n: int = 30) -> None:
    now = timezone.now()
    for i in range(n):
        RequestLog.objects.create(
            request_id=f"pd{i}",
            created_at=now - timedelta(seconds=60 - i),
            model=worker.model or "m",
            cohort="stable",
            pool=pool,
            worker=worker,
            prompt_tokens=ISL,
            cached_tokens=0,
            output_tokens=OSL,
            ttft_seconds=0.3,
            max_gap_seconds=0.03,
            tpot_seconds=0.02,
            e2e_seconds=6.0,
            status=200,
            stream=True,
        )


def worker(pool: Pool, hardware: dict[str, Any], engine_kind: str, model: str) -> Worker:
    return Worker.objects.create(
        name=f"{pool.name}-w",
        url=f"http://{pool.name}.invalid:8000",
        pool=pool,
        engine_kind=engine_kind,
        model=model,
        max_model_len=32768,
        hardware=hardware,
    )


@pytest.mark.django_db
def test_an_unknown_gpu_says_so_without_failing_the_report() -> None:
    pool = make_pool("t4s")
    w = worker(
        pool,
        {"device": "cuda", "name": "Tesla T4", "memory_bytes": 16 * 2**30},
        "vllm",
        "meta-llama/Llama-3.1-8B-Instruct",
    )
    traffic(pool, w)
    body = AdvisorReport.refresh(pool, database_estimate=True).body
    found = body["pd_database"]
    assert found["answer"] == verdicts.Answer.NOT_ENOUGH_DATA.value
    assert "no database for this GPU (Tesla T4)" in found["reasons"][0]
    assert body["pd"]["key"] == "pd" and body["overall"]  # the rest of the report stands

    # a simulated worker on a system the package lacks: named, with what it has
    w.hardware = {**SIM_HARDWARE, "sim": {**SIM_DEVICE, "system": "z100"}}
    w.engine_kind = "sim"
    w.save()
    found = AdvisorReport.refresh(pool, database_estimate=True).body["pd_database"]
    assert found["answer"] == verdicts.Answer.NOT_ENOUGH_DATA.value
    assert "no database for this GPU (z100)" in found["reasons"][0] and "h200_sxm" in found["reasons"][0]


@pytest.mark.django_db
def test_the_report_json_carries_the_estimate_and_a_request_reuses_it(target: pd.Target) -> None:
    objectives = ServiceObjectives.current()
    objectives.ttft_seconds, objectives.tpot_seconds = TTFT_SECONDS, TPOT_SECONDS
    objectives.save()
    pool = make_pool("h200s")
    traffic(pool, worker(pool, SIM_HARDWARE, "sim", "llama-8b-shaped"))

    assert tasks.refresh()["reports"] == 2  # beat's round sweeps the database
    want = pd.estimate(target)
    client = api_client(make_user(Role.VIEWER))
    body = client.get("/api/v1/advisor/reports/h200s/").json()
    found = body["pd_database"]
    assert found["figures"]["agg_tokens_per_second_per_gpu"] == want.agg_tokens_per_second_per_gpu
    assert found["figures"]["disagg_tokens_per_second_per_gpu"] == want.disagg_tokens_per_second_per_gpu
    assert found["chart"]["estimate"]["inputs"] == {
        **target.to_json(),
        "kv_bytes_per_token": want.inputs["kv_bytes_per_token"],
    }
    assert found["chart"]["estimate"]["disagg_best"] == want.disagg_best
    assert body["pd"]["key"] == "pd"  # the formula stays beside it

    # A report on demand does not sweep: it takes the kept report's estimate for the same inputs.
    swept = pd.estimate.cache_info()
    live = client.get("/api/v1/advisor/reports/h200s/", {"window": "15m"}).json()
    assert pd.estimate.cache_info() == swept
    assert live["pd_database"]["figures"] == found["figures"]


@pytest.mark.django_db
def test_the_advisor_page_shows_the_estimate_and_its_inputs(target: pd.Target) -> None:
    pool = make_pool("h200p")
    traffic(pool, worker(pool, SIM_HARDWARE, "sim", "llama-8b-shaped"))
    objectives = ServiceObjectives.current()
    objectives.ttft_seconds, objectives.tpot_seconds = TTFT_SECONDS, TPOT_SECONDS
    objectives.save()
    AdvisorReport.refresh(pool, database_estimate=True)
    client = Client()
    client.force_login(make_user(Role.VIEWER))
    html = client.get("/advisor/h200p/").content.decode()
    assert 'id="finding-pd_database"' in html and 'id="pd-database"' in html
    assert "Database inputs" in html and "h200_sxm" in html and "Best disaggregated configuration" in html
    assert VERSION in html
