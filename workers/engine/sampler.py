"""Next-token choice per request: greedy, or temperature with top-k and
top-p, drawn from the request's own generator (seeded per request, so a
seed gives the same tokens whatever else shares the batch). The logprob
reported is the chosen token's under the model's raw distribution, as vLLM
reports by default."""

from __future__ import annotations

import torch

from workers.engine.sequence import Sequence


class Sampler:
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float] | None]:
        """logits: [len(seqs), vocab] float32."""
        if not seqs:
            return [], None
        greedy = [s.params.temperature == 0 or s.params.top_k == 1 for s in seqs]
        if all(greedy):
            chosen = logits.argmax(dim=-1)
        else:
            chosen = logits.argmax(dim=-1)
            for i, seq in enumerate(seqs):
                if not greedy[i]:
                    chosen[i] = _sample_row(logits[i], seq)
        logprobs = None
        if any(s.logprobs is not None for s in seqs):
            logprobs = torch.log_softmax(logits, dim=-1).gather(1, chosen[:, None])[:, 0].tolist()
        return chosen.tolist(), logprobs


def _sample_row(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
    p = seq.params
    x = row / p.temperature
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
