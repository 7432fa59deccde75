"""Next-token choice per request: greedy, or temperature with top-k and
top-p, drawn from the request's own generator (seeded per request, so a
seed gives the same tokens whatever else shares the batch). Before that a
request's ``logit_bias`` is added to its row, and until it has
``min_tokens`` output tokens its stop tokens (EOS unless ``ignore_eos``,
and ``stop_token_ids``) are masked out, as vLLM's logits processors do. The
logprob reported is the chosen token's under the model's raw distribution,
as vLLM reports by default.

One request's bad row (non-finite logits, a distribution with nothing left
to draw) fails that request alone: its index comes back in ``failures`` and
the rest of the batch gets its tokens."""

from __future__ import annotations

import torch

from workers.engines.reference.sequence import Sequence

# vLLM's floor (sampling_params.py _MAX_TEMP): below it logits / temperature
# overflow to inf and the softmax turns to NaN. The server raises smaller
# temperatures to it already; this keeps direct engine callers safe too.
MIN_TEMPERATURE = 1e-2


class SamplingFailed(RuntimeError):
    """One row could not be sampled; the message says why."""


class Sampler:
    def __init__(self, eos_token_ids: frozenset[int] = frozenset()):
        self.eos_token_ids = eos_token_ids

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[list[int], list[float] | None, dict[int, SamplingFailed]]:
        """logits: [len(seqs), vocab] float32. Returns (tokens, logprobs, failures by row)."""
        if not seqs:
            return [], None, {}
        raw = logits
        logits = self._processed(logits, seqs)
        greedy = [s.params.temperature == 0 or s.params.top_k == 1 for s in seqs]
        chosen = logits.argmax(dim=-1)
        failures: dict[int, SamplingFailed] = {}
        # NaN or +inf anywhere, or nothing finite at all: no distribution to draw from.
        unusable = (torch.isnan(logits) | torch.isposinf(logits)).any(dim=-1) | ~torch.isfinite(logits).any(dim=-1)
        if bool(unusable.any()):
            for i in torch.nonzero(unusable).flatten().tolist():
                failures[i] = SamplingFailed(
                    "the model's logits for this request are not finite (NaN, or no finite value)."
                )
        if not all(greedy):
            for i, seq in enumerate(seqs):
                if not greedy[i] and i not in failures:
                    try:
                        chosen[i] = _sample_row(logits[i], seq)
                    except (RuntimeError, ValueError) as exc:
                        failures[i] = SamplingFailed(f"sampling failed: {exc}")
        logprobs = None
        if any(s.logprobs is not None for s in seqs):
            logprobs = torch.log_softmax(raw, dim=-1).gather(1, chosen[:, None])[:, 0].tolist()
        return chosen.tolist(), logprobs, failures

    def _processed(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The rows with their biases added and, below min_tokens, their stop tokens masked;
        ``logits`` itself when no request asks for either (a copy otherwise: logprobs read the raw rows)."""
        out: torch.Tensor | None = None
        for i, seq in enumerate(seqs):
            p = seq.params
            banned: set[int] = set()
            if seq.num_output_tokens < p.min_tokens:
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
                banned = {t for t in stops if t < logits.shape[1]}  # a stop id past the vocabulary never comes
            if not p.logit_bias and not banned:
                continue
            if out is None:
                out = logits.clone()
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), device=out.device)
                out[i].index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=out.dtype, device=out.device))
            if banned:
                out[i, torch.tensor(sorted(banned), device=out.device)] = float("-inf")
        return logits if out is None else out


def _sample_row(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
    p = seq.params
    x = row / max(p.temperature, MIN_TEMPERATURE)
    vocab = x.shape[0]
    if 0 < p.top_k < vocab:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Drop a token when the more likely ones already reach top_p (the first always stays).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(0, order, sorted_x)
    probs = torch.softmax(x, dim=-1)
    return torch.multinomial(probs, 1, generator=seq.generator)[0]
