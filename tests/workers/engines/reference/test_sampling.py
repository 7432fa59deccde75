"""Sampling: greedy, temperature with top-k/top-p, per-request seeds, stops,
lengths, logprobs."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch

from workers.engines.api import RequestError, SamplingParams
from workers.engines.reference import LLM

PROMPT = "The for statement"


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> LLM:
    return LLM(tiny_model, max_model_len=512, max_num_batched_tokens=64)


def greedy(llm: LLM, n: int = 30, **kw: object) -> object:
    return llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw))[0].outputs[0]


def test_greedy_output_is_varied_text_not_one_token_repeated(llm: LLM) -> None:
    prompts = ["The list", "In Python, a class", "An exception is raised when", PROMPT]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    seen: set[int] = set()
    for out in outs:
        ids = out.outputs[0].token_ids
        longest_run = max(sum(1 for _ in group) for _, group in itertools.groupby(ids))
        assert longest_run <= 6, out.outputs[0].text
        assert len(set(ids)) >= 5, out.outputs[0].text
        assert len(out.outputs[0].text.split()) >= 10
        seen |= set(ids)
    assert len(seen) >= 15


def test_same_seed_gives_the_same_tokens_whatever_else_is_in_the_batch(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=25, ignore_eos=True)
    alone = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    crowded = llm.generate(["Some other prompt", PROMPT, "and another"], [other, params, other])[1].outputs[0].token_ids
    assert alone == crowded
    different = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=99, max_tokens=25, ignore_eos=True))
    assert different[0].outputs[0].token_ids != alone


def test_top_k_one_and_tiny_top_p_are_greedy(llm: LLM) -> None:
    expected = greedy(llm).token_ids
    for params in (
        SamplingParams(temperature=1.5, top_k=1, seed=1),
        SamplingParams(temperature=1.5, top_p=1e-6, seed=2),
    ):
        params.max_tokens, params.ignore_eos = 30, True
        assert llm.generate([PROMPT], params)[0].outputs[0].token_ids == expected


def _ranks(llm: LLM, prompt_ids: list[int], out_ids: list[int]) -> tuple[list[int], torch.Tensor]:
    logits = llm.llm_engine.score(prompt_ids + out_ids)[len(prompt_ids) - 1 : -1]
    order = logits.argsort(dim=-1, descending=True)
    ranks = [int((order[i] == t).nonzero()) for i, t in enumerate(out_ids)]
    return ranks, logits


def test_top_k_samples_only_among_the_k_most_likely(llm: LLM) -> None:
    outs = llm.generate(
        [PROMPT] * 4,
        [SamplingParams(temperature=2.0, top_k=3, seed=s, max_tokens=30, ignore_eos=True) for s in range(4)],
    )
    ranks = [r for o in outs for r in _ranks(llm, o.prompt_token_ids, o.outputs[0].token_ids)[0]]
    assert max(ranks) <= 2
    assert len(set(ranks)) > 1  # it did sample


def test_top_p_samples_only_inside_the_nucleus(llm: LLM) -> None:
    outs = llm.generate(
        [PROMPT] * 4,
        [SamplingParams(temperature=1.0, top_p=0.5, seed=s, max_tokens=30, ignore_eos=True) for s in range(4)],
    )
    for o in outs:
        ids = o.outputs[0].token_ids
        _, logits = _ranks(llm, o.prompt_token_ids, ids)
        probs = torch.softmax(logits, dim=-1)
        for i, t in enumerate(ids):
            mass_before = probs[i][probs[i] > probs[i][t]].sum().item()
            assert mass_before < 0.5 + 1e-6


def test_max_tokens_ends_with_length(llm: LLM) -> None:
    out = greedy(llm, 7)
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_stop_string_ends_the_output_before_it(llm: LLM) -> None:
    full = greedy(llm, 40).text
    stop = full[len(full) // 2 : len(full) // 2 + 4]
    cut = full.index(stop)
    out = greedy(llm, 40, stop=[stop])
    assert out.text == full[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = greedy(llm, 40, stop=[stop], include_stop_str_in_output=True)
    assert kept.text == full[: cut + len(stop)]


def test_stop_token_id_ends_the_output_and_is_kept_in_token_ids(llm: LLM) -> None:
    full = greedy(llm, 30).token_ids
    stop_id = full[5]
    first = full.index(stop_id)
    out = greedy(llm, 30, stop_token_ids=[stop_id])
    assert out.token_ids == full[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_eos_ends_the_output_unless_ignore_eos(tmp_path: Path, tiny_model: Path, llm: LLM) -> None:
    first_token = greedy(llm, 3).token_ids[1]
    model = tmp_path / "eos"
    shutil.copytree(tiny_model, model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, first_token]}))
    eos_llm = LLM(model, max_model_len=512)
    stopped = eos_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    assert len(stopped.token_ids) == 2 and stopped.finish_reason == "stop" and stopped.stop_reason is None
    ignored = eos_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    assert len(ignored.token_ids) == 10 and ignored.finish_reason == "length"


def test_min_tokens_holds_off_eos_stop_tokens_and_stop_strings(tmp_path: Path, tiny_model: Path, llm: LLM) -> None:
    full = greedy(llm, 12)
    first_token = full.token_ids[1]
    model = tmp_path / "eos"
    shutil.copytree(tiny_model, model)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, first_token]}))
    eos_llm = LLM(model, max_model_len=512)
    held = eos_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10, min_tokens=6))[0].outputs[0]
    # The EOS token was greedy's choice at position 2; masked, it is never drawn before 6 tokens.
    assert len(held.token_ids) >= 6 and first_token not in held.token_ids[:6]
    stop_id = full.token_ids[2]
    out = greedy(llm, 12, stop_token_ids=[stop_id], min_tokens=5)
    assert len(out.token_ids) >= 5 and stop_id not in out.token_ids[:5]
    stop = full.text[:4]  # at the output's start: plainly it stops at once
    assert stop.strip() and greedy(llm, 12, stop=[stop]).finish_reason == "stop"
    late = greedy(llm, 12, stop=[stop], min_tokens=12)
    assert late.finish_reason == "length" and len(late.token_ids) == 12


def test_logit_bias_moves_the_choice_and_leaves_logprobs_raw(llm: LLM) -> None:
    plain = greedy(llm, 4, logprobs=0)
    favourite = 42 if 42 not in plain.token_ids else 43
    biased = greedy(llm, 4, logprobs=0, logit_bias={favourite: 100.0})
    assert biased.token_ids == [favourite] * 4
    assert all(lp < -0.01 for lp in biased.logprobs)  # the raw distribution does not favour it
    banned = greedy(llm, 4, logit_bias={plain.token_ids[0]: -100.0})
    assert banned.token_ids[0] != plain.token_ids[0]


def test_a_logit_bias_outside_the_vocabulary_names_the_field(llm: LLM) -> None:
    vocab = llm.llm_engine.config.vocab_size
    with pytest.raises(RequestError) as raised:
        llm.generate([PROMPT], SamplingParams(max_tokens=3, logit_bias={vocab: 1.0}))
    assert raised.value.field == "logit_bias"
    with pytest.raises(RequestError) as raised:
        llm.generate([PROMPT], SamplingParams(max_tokens=3, min_tokens=4))
    assert raised.value.field == "min_tokens"


def test_logprobs_are_the_chosen_tokens_under_the_raw_distribution(llm: LLM) -> None:
    for params in (
        SamplingParams(temperature=0, max_tokens=12, logprobs=0, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=20, seed=5, max_tokens=12, logprobs=1, ignore_eos=True),
    ):
        o = llm.generate([PROMPT], params)[0]
        ids, lps = o.outputs[0].token_ids, o.outputs[0].logprobs
        assert lps is not None and len(lps) == len(ids)
        _, logits = _ranks(llm, o.prompt_token_ids, ids)
        expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(lps), expected, atol=1e-4, rtol=0)
    assert llm.generate([PROMPT], SamplingParams(max_tokens=3))[0].outputs[0].logprobs is None


def test_token_id_prompts_and_text_prompts_agree(llm: LLM) -> None:
    ids = llm.get_tokenizer().encode(PROMPT)
    a = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10))[0]
    b = llm.generate([ids], SamplingParams(temperature=0, max_tokens=10))[0]
    c = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=10))[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    assert a.prompt == PROMPT and b.prompt is None
    assert a.outputs[0].text == llm.get_tokenizer().decode(a.outputs[0].token_ids)
