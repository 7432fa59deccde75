"""``python -m workers gpu-check --out DIR``: the reference engine on a real GPU, in one short run.

Design note. The reference engine's CUDA paths (SDPA with an offset-causal
mask for chunks, padded decode groups, the allocator's memory figures) had
only ever run on CPU. This check proves them inside one short device lease:
it needs torch (with CUDA) and this package's own dependencies, no vLLM and
no download. It writes two checkpoints (a Llama-3-1B-shaped one with random
weights from a fixed seed, and the project's tiny model, built if missing),
then runs five sections, each under a time cap of its own so the whole run
fits its lease (8 minutes on one H200); a section that reaches its cap stops
between two runs and says what it skipped.

1. parity — greedy outputs, chunked (caps 64, 512, 2048) against
   monolithic, prompts of 100 to 16K tokens, both models, float32 and
   bfloat16: float32 must be token-identical; bfloat16 reports the first
   differing position, and transformers' greedy output (when importable) as
   the tie-breaker.
2. memory — the allocator's peak and time-weighted mean during a mixed
   workload, monolithic and chunked, beside the accounting formula's
   (``memory.py``) for the same steps.
3. stalls — long prompts (32K–64K) arriving while 64 streams decode: stall
   P99 and output throughput, monolithic and chunked at budgets 512, 1024,
   2048.
4. roofline — decode tokens/s at batch 1 and 64 against the HBM roofline
   (weight bytes plus KV bytes read per step over the measured copy
   bandwidth), prefill against the measured bfloat16 matmul rate.
5. overhead — per step at budget 512, the time spent outside the model's
   kernels (scheduling, packing, sampling), and on CUDA what CUDA graphs and
   pinned buffers would save.

``--device cpu --quick`` runs the same code on tiny shapes (a test runs it),
so the script cannot rot between leases; the device run only supplies the
figures. Output: ``DIR/gpu_check.json`` and ``DIR/gpu_check.txt``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import platform
import random
import statistics
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from torch.profiler import ProfilerActivity, profile

from workers import figures
from workers.bench.harness import ReferenceAdapter, Request, mixed_workload, replay
from workers.engines.api import RequestMetrics, SamplingParams
from workers.engines.reference import LLMEngine
from workers.engines.reference.config import ModelConfig
from workers.engines.reference.model import LlamaForCausalLM
from workers.engines.reference.sequence import OutputKind
from workers.engines.reference.tiny import ensure_tiny_model

SECTIONS = ("parity", "memory", "stalls", "roofline", "overhead", "sim")
PARITY_CAPS = (64, 512, 2048)
STALL_BUDGETS = (512, 1024, 2048)
OVERHEAD_BUDGET = 512
SEED = 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, help="directory for gpu_check.json and gpu_check.txt")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and short caps (the CPU test)")
    parser.add_argument(
        "--tiny-model", type=Path, default=Path("var/tiny-model"), help="the tiny checkpoint (built if missing)"
    )
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"which to run (default {','.join(SECTIONS)})")
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiply every section's time cap (default 1)")


# ---- sizes ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    """Every size of one run: the GPU's full plan or the CPU's quick one."""

    big_config: dict[str, Any]  # the random checkpoint's config.json
    max_model_len: int
    kv_cache_bytes: int
    parity_prompts: tuple[int, ...]
    parity_output_tokens: int
    memory_duration_seconds: float  # arrivals of the mixed workload
    memory_rate: float
    memory_long_tokens: tuple[int, int]
    memory_max_output: int  # outputs of the mixed workload capped here
    stall_streams: int
    stall_stream_prompt: int
    stall_stream_output: int
    stall_long_prompts: tuple[int, ...]
    stall_long_gap_seconds: float
    roofline_batches: tuple[int, ...]
    roofline_prompt: int
    roofline_output: int
    roofline_prefill: int
    copy_bytes: int
    matmul_size: int
    overhead_streams: int
    overhead_long_prompt: int
    overhead_steps: int
    # Seconds each section may start new work in; the whole run's lease is their sum plus set-up.
    section_seconds: dict[str, float] = field(default_factory=dict)
    # sim: (prefill tokens, decodes, their KV length) of the steps timed against the simulated engine
    sim_shapes: tuple[tuple[int, int, int], ...] = (
        (0, 1, 512),
        (0, 64, 2048),
        (512, 32, 2048),
        (2048, 32, 2048),
        (8192, 0, 0),
    )


LLAMA_1B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,  # tied random weights make greedy decoding repeat the last token
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "dtype": "bfloat16",
    "torch_dtype": "bfloat16",
    "initializer_range": 0.02,
}

FULL = Plan(
    big_config=LLAMA_1B,
    max_model_len=65536 + 256,
    kv_cache_bytes=16 << 30,
    parity_prompts=(100, 1000, 4000, 16000),
    parity_output_tokens=32,
    memory_duration_seconds=4.0,
    memory_rate=12.0,
    memory_long_tokens=(8000, 16000),
    memory_max_output=400,
    stall_streams=64,
    stall_stream_prompt=256,
    stall_stream_output=768,
    stall_long_prompts=(32768, 49152, 65536),
    stall_long_gap_seconds=0.5,
    roofline_batches=(1, 64),
    roofline_prompt=512,
    roofline_output=64,
    roofline_prefill=8192,
    copy_bytes=1 << 30,
    matmul_size=8192,
    overhead_streams=32,
    overhead_long_prompt=16384,
    overhead_steps=40,
    section_seconds={
        "setup": 60,
        "parity": 120,
        "memory": 50,
        "stalls": 120,
        "roofline": 40,
        "overhead": 40,
        "sim": 30,
    },
)

QUICK = Plan(
    big_config=dict(
        LLAMA_1B,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=8192,
    ),
    max_model_len=4096,
    kv_cache_bytes=64 << 20,
    parity_prompts=(60, 300, 2100),
    parity_output_tokens=6,
    memory_duration_seconds=1.0,
    memory_rate=5.0,
    memory_long_tokens=(1500, 2500),
    memory_max_output=12,
    stall_streams=8,
    stall_stream_prompt=64,
    stall_stream_output=32,
    stall_long_prompts=(1500, 3000),
    stall_long_gap_seconds=0.05,
    roofline_batches=(1, 8),
    roofline_prompt=64,
    roofline_output=8,
    roofline_prefill=1024,
    copy_bytes=16 << 20,
    matmul_size=256,
    overhead_streams=4,
    overhead_long_prompt=2048,
    overhead_steps=8,
    section_seconds={
        "setup": 120,
        "parity": 120,
        "memory": 60,
        "stalls": 60,
        "roofline": 30,
        "overhead": 30,
        "sim": 30,
    },
    sim_shapes=((0, 1, 64), (0, 8, 256), (128, 4, 256), (512, 0, 0)),
)


class Clock:
    """A section's time cap: work starts only while its deadline is ahead."""

    def __init__(self, seconds: float):
        self.start = time.monotonic()
        self.deadline = self.start + seconds
        self.skipped: list[str] = []

    def allows(self, what: str) -> bool:
        if time.monotonic() < self.deadline:
            return True
        self.skipped.append(what)
        return False

    def elapsed(self) -> float:
        return time.monotonic() - self.start


# ---- checkpoints ----------------------------------------------------------------------
def write_random_checkpoint(out: Path, config: dict[str, Any], device: torch.device, seed: int = SEED) -> Path:
    """A Llama checkpoint with Hugging Face's initialisation (normal, std
    ``initializer_range``; norms one) from ``seed``, and a word-level
    tokenizer covering its vocabulary. Instant when already written."""
    stamp = out / "chunkpilot_random_model.json"
    recipe = {"config": config, "seed": seed}
    if stamp.is_file() and json.loads(stamp.read_text()) == recipe:
        return out
    out.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_dict(config)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device):
        net = LlamaForCausalLM(cfg)
    std = float(config["initializer_range"])
    dtype = getattr(torch, config["torch_dtype"])
    with torch.no_grad():
        for name, param in net.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, std, generator=generator)
            elif "bias" in name:
                param.zero_()
    state = {k: v.to(dtype).cpu() for k, v in net.to(dtype).hf_state_dict().items()}
    del net
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    _write_word_tokenizer(out, int(config["vocab_size"]))
    stamp.write_text(json.dumps(recipe))
    return out


def _write_word_tokenizer(out: Path, vocab_size: int) -> None:
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


# ---- engines ------------------------------------------------------------------------------
class Engines:
    """One engine per (model, dtype), reused across sections: the profile
    changes between runs (``update_profile``), the weights load once."""

    def __init__(self, models: dict[str, Path], device: torch.device, plan: Plan):
        self.models = models
        self.device = device
        self.plan = plan
        self._engines: dict[tuple[str, str], LLMEngine] = {}

    def get(self, model: str, dtype: str) -> LLMEngine:
        key = (model, dtype)
        if key not in self._engines:
            for other in list(self._engines):
                self.drop(*other)  # one engine (and one KV pool) in memory at a time
            path = self.models[model]
            native = ModelConfig.from_pretrained(path).max_position_embeddings
            self._engines[key] = LLMEngine(
                path,
                device=self.device.type,
                dtype=dtype,
                max_model_len=min(self.plan.max_model_len, native),
                prefill_mode="monolithic",
                max_num_seqs=64,
                block_size=16,
                enable_prefix_caching=False,
                kv_cache_bytes=self.plan.kv_cache_bytes,
                seed=SEED,
            )
        return self._engines[key]

    def drop(self, model: str, dtype: str) -> None:
        self._engines.pop((model, dtype), None)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def set_mode(engine: LLMEngine, budget: int | None, max_num_seqs: int = 64) -> None:
    """Monolithic (budget None: the longest prompt fits) or chunked at ``budget``."""
    if budget is None:
        profile = dataclasses.replace(
            engine.profile,
            prefill_mode="monolithic",
            max_num_batched_tokens=engine.max_model_len,
            max_num_seqs=max_num_seqs,
        )
    else:
        profile = dataclasses.replace(
            engine.profile,
            prefill_mode="chunked",
            max_num_batched_tokens=max(budget, max_num_seqs),
            max_num_seqs=max_num_seqs,
        )
    engine.update_profile(profile)


def mode_label(budget: int | None) -> str:
    return "monolithic" if budget is None else f"chunked-{budget}"


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [0] + [rng.randrange(3, vocab) for _ in range(length - 1)]


def generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy outputs of every prompt, all in the engine at once (prefills and decodes share steps)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"gen-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params, output_kind=OutputKind.FINAL_ONLY)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[i] for i in ids]


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run_workload(
    engine: LLMEngine, label: str, workload: list[Request]
) -> tuple[ReferenceAdapter, list[RequestMetrics], float]:
    adapter = ReferenceAdapter(label, engine, account_memory=True)
    try:
        requests, duration = replay(adapter, workload)
    finally:
        adapter.close()
    return adapter, requests, duration


def progress(what: str, since: float) -> None:
    print(f"    {what} ({time.monotonic() - since:.1f}s)", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- 1. parity ------------------------------------------------------------------------------
def check_parity(engines: Engines, plan: Plan, clock: Clock) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # The big model in the later sections' dtype last, so its engine stays for them.
    dtypes = ("float32", "bfloat16") if engines.device.type == "cuda" else ("bfloat16", "float32")
    for model in ("tiny", "big"):
        for dtype in dtypes:
            key = f"{model} {dtype}"
            if not clock.allows(key):
                continue
            engine = engines.get(model, dtype)
            rng = random.Random(SEED)
            lengths = [n for n in plan.parity_prompts if n + plan.parity_output_tokens <= engine.max_model_len]
            prompts = [random_prompt(rng, n, engine.config.vocab_size) for n in lengths]
            set_mode(engine, None)
            started = time.monotonic()
            reference = generate(engine, prompts, plan.parity_output_tokens)
            result: dict[str, Any] = {"prompt_tokens": lengths, "output_tokens": plan.parity_output_tokens, "caps": {}}
            chunked: dict[str, list[list[int]]] = {}
            for cap in PARITY_CAPS:
                if not clock.allows(f"{key} cap {cap}"):
                    continue
                set_mode(engine, cap)
                outputs = chunked[str(cap)] = generate(engine, prompts, plan.parity_output_tokens)
                diffs = [first_difference(a, b) for a, b in zip(reference, outputs, strict=True)]
                result["caps"][str(cap)] = {"identical": all(d is None for d in diffs), "first_difference": diffs}
                progress(f"parity {key} cap {cap}: first differences {diffs}", started)
            result["identical"] = bool(result["caps"]) and all(c["identical"] for c in result["caps"].values())
            result["seconds"] = time.monotonic() - started
            if dtype == "bfloat16" and not result["identical"] and clock.allows(f"{key} tie-breaker"):
                try:
                    result["tie_breaker"] = tie_breaker(
                        engines, model, prompts, reference, chunked, result["caps"], plan
                    )
                except Exception:  # noqa: BLE001 (transformers' API moves between versions: keep the parity figures)
                    result["tie_breaker"] = {"available": False, "error": traceback.format_exc()}
            out[key] = result
    fp32 = [r for k, r in out.items() if k.endswith("float32")]
    out["float32_identical"] = bool(fp32) and all(r["identical"] for r in fp32)
    return out


def tie_breaker(
    engines: Engines,
    model: str,
    prompts: list[list[int]],
    reference: list[list[int]],
    chunked: dict[str, list[list[int]]],
    caps: dict[str, Any],
    plan: Plan,
) -> dict[str, Any]:
    """For the first prompt where a chunked run left monolithic's output in
    bfloat16: how long transformers' own greedy output agrees with each."""
    if importlib.util.find_spec("transformers") is None:
        return {"available": False}
    import transformers  # optional on the device machine, and seconds to import: only a tie needs it

    cap, index = next(
        (c, r["first_difference"].index(d)) for c, r in caps.items() for d in r["first_difference"] if d is not None
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(engines.models[model], dtype=torch.bfloat16).to(
        engines.device
    )
    with torch.inference_mode():
        ids = torch.tensor([prompts[index]], device=engines.device)
        gen = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=plan.parity_output_tokens,
            do_sample=False,
            num_beams=1,
            pad_token_id=0,
        )
    theirs = gen[0, ids.shape[1] :].tolist()
    del hf
    gc.collect()
    return {
        "available": True,
        "cap": int(cap),
        "prompt_tokens": len(prompts[index]),
        "monolithic_first_difference_from_transformers": first_difference(reference[index], theirs),
        "chunked_first_difference_from_transformers": first_difference(chunked[cap][index], theirs),
    }


# ---- 2. memory ------------------------------------------------------------------------------
def check_memory(engines: Engines, plan: Plan, clock: Clock, dtype: str) -> dict[str, Any]:
    engine = engines.get("big", dtype)
    vocab = engine.config.vocab_size
    longest = engine.max_model_len - 512
    lo, hi = (min(n, longest) for n in plan.memory_long_tokens)
    workload = [
        dataclasses.replace(r, max_tokens=min(r.max_tokens, plan.memory_max_output))
        for r in mixed_workload(SEED, plan.memory_duration_seconds, plan.memory_rate, 0.1, (lo, hi), vocab, 0)
    ]
    out: dict[str, Any] = {"requests": len(workload), "on_allocator": engines.device.type == "cuda", "runs": {}}
    for budget in (None, OVERHEAD_BUDGET):
        label = mode_label(budget)
        if not clock.allows(label):
            continue
        set_mode(engine, budget)
        adapter, _, duration = run_workload(engine, label, workload)
        progress(f"memory {label}: {len(adapter.steps)} steps", time.monotonic() - duration)
        accounted = figures.memory_figures(adapter.accounted)
        measured = figures.memory_figures(adapter.steps) if engines.device.type == "cuda" else None
        run: dict[str, Any] = {"seconds": duration, "steps": len(adapter.steps)}
        for source, f in (("accounted", accounted), ("allocator", measured)):
            run[f"{source}_peak_bytes"] = f["memory_peak_bytes"] if f else None
            run[f"{source}_mean_bytes"] = f["memory_mean_bytes"] if f else None
            run[f"{source}_peak_over_mean"] = f["memory_peak_over_mean"] if f else None
        for kind in ("peak", "mean"):
            run[f"accounted_over_allocator_{kind}"] = _ratio(
                run[f"accounted_{kind}_bytes"], run[f"allocator_{kind}_bytes"]
            )
        out["runs"][label] = run
    mono, chunked = out["runs"].get("monolithic"), out["runs"].get(mode_label(OVERHEAD_BUDGET))
    if mono and chunked:
        # The allocator's figures where there is one (CUDA), else the formula's.
        source = "allocator" if out["on_allocator"] else "accounted"
        for kind in ("peak_bytes", "mean_bytes", "peak_over_mean"):
            out[f"chunked_over_monolithic_{kind}"] = _ratio(chunked[f"{source}_{kind}"], mono[f"{source}_{kind}"])
        # What the CPU accounting says chunking does: a lower peak, so a lower peak/mean.
        out["falls_with_chunking"] = (out["chunked_over_monolithic_peak_over_mean"] or 2.0) < 1.0
    return out


# ---- 3. stalls ------------------------------------------------------------------------------
def stall_workload(plan: Plan, vocab: int, max_model_len: int) -> list[Request]:
    rng = random.Random(SEED + 1)
    work = [
        Request(f"s{i}", 0.0, random_prompt(rng, plan.stall_stream_prompt, vocab), plan.stall_stream_output)
        for i in range(plan.stall_streams)
    ]
    for i, n in enumerate(plan.stall_long_prompts):
        n = min(n, max_model_len - 16)
        work.append(Request(f"long{i}", (i + 1) * plan.stall_long_gap_seconds, random_prompt(rng, n, vocab), 16))
    return work


def check_stalls(engines: Engines, plan: Plan, clock: Clock, dtype: str) -> dict[str, Any]:
    engine = engines.get("big", dtype)
    workload = stall_workload(plan, engine.config.vocab_size, engine.max_model_len)
    seats = plan.stall_streams + len(plan.stall_long_prompts)
    out: dict[str, Any] = {
        "streams": plan.stall_streams,
        "long_prompt_tokens": [len(r.prompt_token_ids) for r in workload if r.request_id.startswith("long")],
        "runs": {},
    }
    for budget in (None, *STALL_BUDGETS):
        label = mode_label(budget)
        if not clock.allows(label):
            continue
        set_mode(engine, budget, max_num_seqs=seats)
        run_workload(engine, "warm", [Request("warm", 0.0, [0, 5, 6, 7], 4)])
        _, requests, duration = run_workload(engine, label, workload)
        progress(f"stalls {label}", time.monotonic() - duration)
        short = [m for m in requests if m.num_prompt_tokens <= plan.stall_stream_prompt]
        tokens = sum(m.num_output_tokens for m in requests)
        out["runs"][label] = {
            "seconds": duration,
            "stall_p99_seconds": figures.stalls_seconds(short, 99),
            "output_throughput_tps": tokens / duration if duration > 0 else None,
            "long_ttft_seconds": [
                figures.ttft_seconds(m) for m in requests if m.num_prompt_tokens > plan.stall_stream_prompt
            ],
        }
    mono = out["runs"].get("monolithic")
    out["ratios"] = {}
    for label, run in out["runs"].items():
        if mono and label != "monolithic":
            out["ratios"][label] = {
                "stall_reduction": _ratio(mono["stall_p99_seconds"], run["stall_p99_seconds"]),
                "throughput_vs_monolithic": _ratio(run["output_throughput_tps"], mono["output_throughput_tps"]),
            }
    return out


# ---- 4. roofline -----------------------------------------------------------------------------
def timed(device: torch.device, fn: Callable[[], object], repeats: int) -> float:
    """Best seconds of ``repeats`` calls after one warm-up."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth(device: torch.device, num_bytes: int) -> float:
    """Bytes/s of a device-to-device copy (each byte read once and written once)."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).uniform_()
    dst = torch.empty_like(src)
    seconds = timed(device, lambda: dst.copy_(src), 5)
    return 2 * num_bytes / seconds


def matmul_rate(device: torch.device, n: int, dtype: torch.dtype) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    seconds = timed(device, lambda: a @ b, 5)
    return 2 * n**3 / seconds


def check_roofline(engines: Engines, plan: Plan, clock: Clock, dtype: str) -> dict[str, Any]:
    device = engines.device
    torch_dtype = getattr(torch, dtype)
    bandwidth = copy_bandwidth(device, plan.copy_bytes)
    rate = matmul_rate(device, plan.matmul_size, torch_dtype)
    engine = engines.get("big", dtype)
    c = engine.config
    weight_bytes = engine.model.num_weight_bytes()
    kv_bytes_per_token = engine.block_bytes // engine.profile.block_size
    out: dict[str, Any] = {
        "copy_bandwidth_bytes_per_second": bandwidth,
        "matmul_flops_per_second": rate,
        "matmul_dtype": dtype,
        "weight_bytes": weight_bytes,
        "decode": {},
    }
    rng = random.Random(SEED + 2)
    for batch in plan.roofline_batches:
        if not clock.allows(f"decode batch {batch}"):
            continue
        set_mode(engine, OVERHEAD_BUDGET, max_num_seqs=max(64, batch))
        adapter = ReferenceAdapter(f"decode-{batch}", engine)
        work = [
            Request(f"d{i}", 0.0, random_prompt(rng, plan.roofline_prompt, c.vocab_size), plan.roofline_output)
            for i in range(batch)
        ]
        replay(adapter, work)
        adapter.close()
        decode_steps = [s for s in adapter.steps if s.num_prefill_tokens == 0 and s.num_decode_tokens == batch]
        if not decode_steps:
            continue
        step_seconds = statistics.median(s.duration_seconds for s in decode_steps)
        context = plan.roofline_prompt + plan.roofline_output / 2  # mean context over the decode steps
        bytes_per_step = weight_bytes + batch * context * kv_bytes_per_token
        roofline_tps = batch * bandwidth / bytes_per_step
        measured_tps = batch / step_seconds
        out["decode"][str(batch)] = {
            "step_seconds_median": step_seconds,
            "tokens_per_second": measured_tps,
            "bytes_read_per_step": bytes_per_step,
            "roofline_tokens_per_second": roofline_tps,
            "fraction_of_roofline": measured_tps / roofline_tps,
        }
    if clock.allows("prefill"):
        set_mode(engine, None)
        n = min(plan.roofline_prefill, engine.max_model_len - 2)
        prompt = random_prompt(rng, n, c.vocab_size)
        generate(engine, [prompt[:64]], 1)  # warm-up
        recorder = ReferenceAdapter("prefill", engine)
        generate(engine, [prompt], 1)
        recorder.close()
        seconds = max(s.duration_seconds for s in recorder.steps)
        # Matmul work: 2 FLOPs per weight per token (less the embedding table,
        # a lookup), the lm_head for the one sampled row, and causal attention
        # (QKᵀ and PV over half the square).
        layer_params = (
            weight_bytes // torch.empty((), dtype=torch_dtype).element_size() - 2 * c.vocab_size * c.hidden_size
        )
        flops = (
            2 * layer_params * n
            + 2 * c.vocab_size * c.hidden_size
            + 2 * n * n * c.num_attention_heads * c.head_dim * c.num_hidden_layers
        )
        out["prefill"] = {
            "prompt_tokens": n,
            "seconds": seconds,
            "tokens_per_second": n / seconds,
            "flops": flops,
            "fraction_of_matmul_rate": flops / seconds / rate,
        }
    return out


# ---- 5. overhead -----------------------------------------------------------------------------
class PhaseTimer:
    """Seconds spent per phase of the steps run inside ``wrap``: each phase is
    one of the engine's own methods, timed from the outside."""

    def __init__(self, device: torch.device):
        self.device = device
        self.totals: dict[str, float] = {}

    def _timed(self, name: str, fn: Callable[..., Any], synced: bool) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if synced:
                sync(self.device)
            t0 = time.perf_counter()
            result = fn(*args, **kwargs)
            if synced:
                sync(self.device)
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - t0
            return result

        return call

    @contextmanager
    def wrap(self, engine: LLMEngine) -> Iterator[None]:
        """Time the engine's phases: an instance attribute shadows each method
        (or replaces the sampler) for the block's steps, then goes."""
        targets = [
            (engine.scheduler, "schedule", False),
            (engine.runner, "run", False),
            (engine.model, "forward", True),
            (engine.model, "compute_logits", True),
            (engine, "sampler", True),
        ]
        saved = [(obj, name, vars(obj).get(name)) for obj, name, _ in targets]
        for obj, name, synced in targets:
            label = "Sampler" if name == "sampler" else f"{type(obj).__name__}.{name}"
            object.__setattr__(obj, name, self._timed(label, getattr(obj, name), synced))
        try:
            yield
        finally:
            for obj, name, original in saved:
                if original is None:
                    object.__delattr__(obj, name)
                else:
                    object.__setattr__(obj, name, original)


def check_overhead(engines: Engines, plan: Plan, clock: Clock, dtype: str) -> dict[str, Any]:
    device = engines.device
    engine = engines.get("big", dtype)
    vocab = engine.config.vocab_size
    rng = random.Random(SEED + 3)
    set_mode(engine, OVERHEAD_BUDGET, max_num_seqs=64)
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    for i in range(plan.overhead_streams):
        engine.add_request(f"o{i}", random_prompt(rng, 128, vocab), params, output_kind=OutputKind.DELTA)
    while any(not s.is_decoding for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # the streams' prefills: not the steady state measured
    long_prompt = random_prompt(rng, min(plan.overhead_long_prompt, engine.max_model_len - 64), vocab)
    engine.add_request("long", long_prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    for _ in range(2):
        engine.step()
    timer = PhaseTimer(device)
    walls: list[float] = []
    with timer.wrap(engine):
        for _ in range(plan.overhead_steps):
            if not clock.allows("steps"):
                break
            sync(device)
            t0 = time.perf_counter()
            engine.step()
            sync(device)
            walls.append(time.perf_counter() - t0)
    num = len(walls)
    per_step = {name: seconds / num for name, seconds in timer.totals.items()} if num else {}
    wall = sum(walls) / num if num else None
    model_seconds = per_step.get("LlamaForCausalLM.forward", 0.0) + per_step.get("LlamaForCausalLM.compute_logits", 0.0)
    out: dict[str, Any] = {
        "budget": OVERHEAD_BUDGET,
        "steps": num,
        "decode_streams": plan.overhead_streams,
        "step_seconds": wall,
        "phase_seconds_per_step": per_step,
        "schedule_seconds": per_step.get("Scheduler.schedule"),
        "pack_seconds": per_step.get("ModelRunner.run", 0.0) - model_seconds if num else None,
        "model_seconds": model_seconds if num else None,
        "outside_model_seconds": wall - model_seconds if wall is not None else None,
        "outside_model_share": (wall - model_seconds) / wall if wall else None,
    }
    if device.type == "cuda" and num:
        try:
            out.update(cuda_savings(engine, plan, model_seconds))
        except Exception:  # noqa: BLE001 (the profiler's event names vary by torch version: keep the timings above)
            out["cuda_savings_error"] = traceback.format_exc()
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    return out


def sim_system_for(device: torch.device) -> tuple[str, bool]:
    """The database's system for this GPU (``NVIDIA H200`` → ``h200_sxm``), and
    whether it is this machine's; off a GPU (``--quick``), the H200's, so the
    code runs, with ratios that mean nothing."""
    from workers.engines.sim.steptime import supported_databases  # the kernel database: only this section

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).lower().replace("nvidia", "").strip()
        head = name.split()[0] if name else ""
        for system in sorted(supported_databases()):
            if system.split("_")[0] == head:
                return system, True
    return "h200_sxm", False


def check_sim(engines: Engines, plan: Plan, clock: Clock, dtype: str) -> dict[str, Any]:
    """The reference engine's step on this GPU beside the simulated engine's
    estimate (AIConfigurator's database for this GPU, the same model config)
    for the same batch: a ratio per shape, measured / simulated."""
    from workers.engines.sim.steptime import AicDevice, StepBatch  # the kernel database: only this section

    device = engines.device
    system, on_it = sim_system_for(device)
    model_dir = engines.models["big"]
    if not on_it:  # --quick's toy shapes are not in any database: price the 1B shape the GPU run uses
        model_dir = engines.models["big"].parent / "llama-1b-config"
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(LLAMA_1B))
    sim = AicDevice(system, "vllm", str(model_dir))
    engine = engines.get("big", dtype)
    vocab = engine.config.vocab_size
    rng = random.Random(SEED + 4)
    captured: list[StepBatch] = []
    execute = engine._execute

    def capturing(chunks: Any) -> Any:
        captured.append(StepBatch.of(chunks))
        return execute(chunks)

    rows = []
    engine._execute = capturing  # type: ignore[method-assign]
    try:
        for prefill, decodes, kv in plan.sim_shapes:
            if not clock.allows(f"shape {prefill}+{decodes}x{kv}"):
                break
            set_mode(engine, max(prefill, 1) + decodes if prefill else None, max_num_seqs=max(decodes + 1, 2))
            params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
            for i in range(decodes):
                engine.add_request(f"d{i}", random_prompt(rng, kv, vocab), params, output_kind=OutputKind.DELTA)
            while any(not s.is_decoding for s in engine.scheduler.running) or engine.scheduler.waiting:
                engine.step()  # the streams' prefills: not timed
            if prefill:
                one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
                engine.add_request("p", random_prompt(rng, prefill, vocab), one)
            times = []
            for _ in range(3):
                captured.clear()
                sync(device)
                t0 = time.perf_counter()
                engine.step()
                sync(device)
                times.append(time.perf_counter() - t0)
                if prefill:
                    break  # the prompt is done after one step
            batch = captured[-1]
            measured = statistics.median(times)
            estimate = sim.step_seconds(batch)
            rows.append(
                {
                    "prefill_tokens": batch.prefill_tokens,
                    "decodes": batch.num_decodes,
                    "decode_kv_mean": sum(batch.decode_kv_lens) / batch.num_decodes if batch.num_decodes else 0,
                    "measured_seconds": measured,
                    "sim_seconds": estimate,
                    "ratio": _ratio(measured, estimate),
                }
            )
            for request_id in list(engine.requests):
                engine.abort_request(request_id)
    finally:
        engine._execute = execute  # type: ignore[method-assign]
    return {"system": system, "on_that_gpu": on_it, "database_version": sim.version, "shapes": rows}


def cuda_savings(engine: LLMEngine, plan: Plan, model_seconds: float) -> dict[str, Any]:
    """The model's kernel time per step (profiler), so the forward's host-side
    gaps (what CUDA graphs remove), and the step's host-to-device copies
    timed pageable vs pinned (what pinned staging buffers save)."""
    steps = 5
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    kernel_us = 0.0
    num_h2d = 0
    for evt in prof.key_averages():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            kernel_us += (
                evt.self_device_time_total if hasattr(evt, "self_device_time_total") else evt.self_cuda_time_total
            )
        if "HtoD" in evt.key or "Memcpy HtoD" in evt.key:
            num_h2d += evt.count
    kernel_seconds = kernel_us / 1e6 / steps
    small = torch.arange(256, dtype=torch.int64)
    pinned = small.pin_memory()
    pageable_s = timed(engine.device, lambda: small.to(engine.device), 20)
    pinned_s = timed(engine.device, lambda: pinned.to(engine.device, non_blocking=True), 20)
    copies = num_h2d / steps
    return {
        "kernel_seconds_per_step": kernel_seconds,
        "cuda_graph_saving_seconds_per_step": max(0.0, model_seconds - kernel_seconds),
        "h2d_copies_per_step": copies,
        "pageable_copy_seconds": pageable_s,
        "pinned_copy_seconds": pinned_s,
        "pinned_saving_seconds_per_step": max(0.0, copies * (pageable_s - pinned_s)),
    }


# ---- the run -----------------------------------------------------------------------------------
def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "device": device.type,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_bytes=props.total_memory, cuda=torch.version.cuda)
    else:
        env["cpu"] = platform.processor() or platform.machine()
    return env


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    plan = QUICK if args.quick else FULL
    wanted = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(wanted) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"--sections: unknown {', '.join(unknown)} (choose from {', '.join(SECTIONS)})")
    caps = {name: seconds * args.time_scale for name, seconds in plan.section_seconds.items()}
    report: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "quick": args.quick,
        "environment": environment(device),
        "section_caps_seconds": caps,
        "sections": {},
        "total_seconds": 0.0,
    }
    started = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    ensure_tiny_model(args.tiny_model)
    big = write_random_checkpoint(args.out / "llama-1b-random", plan.big_config, device)
    report["setup_seconds"] = time.monotonic() - started
    engines = Engines({"big": big, "tiny": args.tiny_model}, device, plan)
    dtype = "bfloat16" if device.type == "cuda" else "float32"  # CPU: float32 (numba's decode kernel has no bfloat16)
    checks: dict[str, Callable[[Clock], dict[str, Any]]] = {
        "parity": lambda clock: check_parity(engines, plan, clock),
        "memory": lambda clock: check_memory(engines, plan, clock, dtype),
        "stalls": lambda clock: check_stalls(engines, plan, clock, dtype),
        "roofline": lambda clock: check_roofline(engines, plan, clock, dtype),
        "overhead": lambda clock: check_overhead(engines, plan, clock, dtype),
        "sim": lambda clock: check_sim(engines, plan, clock, dtype),
    }
    for name in SECTIONS:
        if name not in wanted:
            continue
        clock = Clock(caps[name])
        try:
            result = checks[name](clock)
        except Exception:  # noqa: BLE001 (one lease, one run: a failing section must not lose the others' figures)
            result = {"error": traceback.format_exc()}
            print(result["error"], flush=True)
        result["section_seconds"] = clock.elapsed()
        result["skipped"] = clock.skipped
        report["sections"][name] = result
        report["total_seconds"] = time.monotonic() - started
        write_json(args.out, report)  # after every section: a run cut short keeps what it measured
        print(
            f"  {name}: {clock.elapsed():.1f}s" + (f" (skipped: {', '.join(clock.skipped)})" if clock.skipped else ""),
            flush=True,
        )
    report["total_seconds"] = time.monotonic() - started
    return report


def write_json(out: Path, report: dict[str, Any]) -> None:
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")


def summary_lines(report: dict[str, Any]) -> list[str]:
    env = report["environment"]
    lines = [
        f"gpu-check {report['started']} on {env.get('gpu', env.get('cpu'))} ({env['device']}, torch {env['torch']})"
        + (" --quick" if report["quick"] else ""),
        f"total {report['total_seconds']:.0f}s",
        "",
    ]
    s = {name: r for name, r in report["sections"].items() if "error" not in r}
    if "parity" in s:
        lines.append("parity (first differing output position per prompt; '=' identical)")
        for key, r in s["parity"].items():
            if not isinstance(r, dict):
                continue
            for cap, c in r["caps"].items():
                marks = " ".join("=" if d is None else str(d) for d in c["first_difference"])
                lines.append(f"  {key:<20} cap {cap:>5}: {marks}")
            if "tie_breaker" in r and r["tie_breaker"].get("available"):
                t = r["tie_breaker"]
                lines.append(
                    f"  {key:<20} transformers vs monolithic: "
                    f"{_pos(t['monolithic_first_difference_from_transformers'])}, "
                    f"vs chunked-{t['cap']}: {_pos(t['chunked_first_difference_from_transformers'])}"
                )
        lines.append(f"  float32 token-identical: {s['parity']['float32_identical']}")
    if "memory" in s:
        lines.append("memory (allocator / accounting formula)")
        for label, r in s["memory"]["runs"].items():
            lines.append(
                f"  {label:<14} peak {_gib(r['allocator_peak_bytes'])} / {_gib(r['accounted_peak_bytes'])}"
                f"   mean {_gib(r['allocator_mean_bytes'])} / {_gib(r['accounted_mean_bytes'])}"
            )
        if "falls_with_chunking" in s["memory"]:
            m = s["memory"]
            lines.append(
                f"  chunked/monolithic: peak {_x(m['chunked_over_monolithic_peak_bytes'])}, mean "
                f"{_x(m['chunked_over_monolithic_mean_bytes'])}, peak/mean "
                f"{_x(m['chunked_over_monolithic_peak_over_mean'])}"
            )
    if "stalls" in s:
        lines.append(
            f"stalls ({s['stalls']['streams']} decode streams, long prompts {s['stalls']['long_prompt_tokens']})"
        )
        for label, r in s["stalls"]["runs"].items():
            ratio = s["stalls"]["ratios"].get(label, {})
            lines.append(
                f"  {label:<14} stall p99 {_ms(r['stall_p99_seconds'])}  {_num(r['output_throughput_tps'])} tok/s"
                + (
                    f"  stall cut {_x(ratio['stall_reduction'])}, throughput {_x(ratio['throughput_vs_monolithic'])}"
                    if ratio
                    else ""
                )
            )
    if "roofline" in s:
        r = s["roofline"]
        lines.append(
            f"roofline (copy {r['copy_bandwidth_bytes_per_second'] / 1e9:.0f} GB/s, {r['matmul_dtype']} matmul "
            f"{r['matmul_flops_per_second'] / 1e9:.0f} GFLOP/s)"
        )
        for batch, d in r["decode"].items():
            lines.append(
                f"  decode batch {batch:>3}: {_num(d['tokens_per_second'])} tok/s, "
                f"{d['fraction_of_roofline']:.1%} of roofline"
            )
        if "prefill" in r:
            p = r["prefill"]
            lines.append(
                f"  prefill {p['prompt_tokens']}: {_num(p['tokens_per_second'])} tok/s, "
                f"{p['fraction_of_matmul_rate']:.1%} of matmul rate"
            )
    if "overhead" in s and s["overhead"]["steps"]:
        o = s["overhead"]
        lines.append(f"per-step overhead at budget {o['budget']} ({o['decode_streams']} streams + a chunked prompt)")
        lines.append(
            f"  step {_ms(o['step_seconds'])}, model {_ms(o['model_seconds'])}, outside it "
            f"{_ms(o['outside_model_seconds'])} "
            f"({o['outside_model_share']:.0%}): schedule {_ms(o['schedule_seconds'])}, pack {_ms(o['pack_seconds'])}"
        )
        if "kernel_seconds_per_step" in o:
            lines.append(
                f"  kernels {_ms(o['kernel_seconds_per_step'])}; CUDA graphs would save "
                f"~{_ms(o['cuda_graph_saving_seconds_per_step'])}, "
                f"pinned buffers ~{_ms(o['pinned_saving_seconds_per_step'])} ({o['h2d_copies_per_step']:.0f} copies)"
            )
    if "sim" in s and s["sim"]["shapes"]:
        sim = s["sim"]
        where = (
            "this GPU" if sim["on_that_gpu"] else f"{sim['system']} (not this device: the ratios check only the code)"
        )
        lines.append(f"step time, measured / simulated ({where}, database {sim['database_version']})")
        for r in sim["shapes"]:
            lines.append(
                f"  {r['prefill_tokens']:>5} prefill + {r['decodes']:>3} decodes @ {r['decode_kv_mean']:.0f}: "
                f"{_ms(r['measured_seconds'])} / {_ms(r['sim_seconds'])} = {_x(r['ratio'])}"
            )
    for name, r in report["sections"].items():
        if "error" in r:
            lines.append(f"{name}: FAILED, {r['error'].strip().splitlines()[-1]} (traceback in gpu_check.json)")
        if r.get("skipped"):
            lines.append(f"{name}: time cap reached, skipped {', '.join(r['skipped'])}")
    return lines


def _pos(v: int | None) -> str:
    return "identical" if v is None else f"differs at {v}"


def _gib(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v / (1 << 30):.2f} GiB" if v >= 1 << 30 else f"{v / (1 << 20):.1f} MiB"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}ms"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def main(args: argparse.Namespace) -> int:
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            "gpu-check: no CUDA device here (torch.cuda.is_available() is False); --device cpu --quick runs the "
            "CPU check"
        )
        return 2
    report = run(args)
    write_json(args.out, report)
    text = "\n".join(summary_lines(report)) + "\n"
    (args.out / "gpu_check.txt").write_text(text)
    print(text)
    return 0
