"""One request inside the engine: its tokens, how many have KV in the cache,
its blocks, its sampling state and its metrics record."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from workers.engines.api import RequestMetrics, SamplingParams

if TYPE_CHECKING:
    import torch

    from workers.engines.reference.tokenizer import IncrementalDetokenizer


class SequenceStatus(enum.IntEnum):
    """Ordered so that "finished" is one comparison (as vLLM's RequestStatus)."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # waiting again, to be recomputed
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self > SequenceStatus.PREEMPTED


FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}


class OutputKind(enum.IntEnum):
    """What ``LLMEngine.step`` returns for a request (vLLM's RequestOutputKind)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class Sequence:
    __slots__ = (
        "request_id",
        "prompt",
        "token_ids",
        "num_prompt_tokens",
        "params",
        "status",
        "num_computed_tokens",
        "block_table",
        "block_hashes",
        "num_registered_blocks",
        "metrics",
        "detokenizer",
        "output_text",
        "logprobs",
        "generator",
        "stop_reason",
        "last_scheduled_step",
        "ready_time",
        "output_kind",
        "num_emitted_tokens",
        "num_emitted_chars",
        "max_total_tokens",
        "ever_scheduled",
    )

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        max_total_tokens: int,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # content hashes of full blocks, computed lazily
        self.num_registered_blocks = 0  # leading blocks already offered to the prefix cache
        self.metrics = RequestMetrics(
            arrival_time=arrival_time, num_prompt_tokens=len(prompt_token_ids), prefill_chunks=[]
        )
        self.detokenizer: IncrementalDetokenizer | None = None
        self.output_text = ""
        self.logprobs: list[float] | None = [] if params.logprobs is not None else None
        self.generator: torch.Generator | None = None
        self.stop_reason: int | str | None = None
        self.last_scheduled_step = -1
        self.ready_time = arrival_time  # since when it could run its next prefill chunk
        self.output_kind = output_kind
        self.num_emitted_tokens = 0
        self.num_emitted_chars = 0
        # prompt + output may not grow past this (max_tokens and the model's length)
        self.max_total_tokens = max_total_tokens
        self.ever_scheduled = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """Only the last sampled token lacks KV: the next step is one decode token."""
        return self.num_computed_tokens == len(self.token_ids) - 1 and len(self.token_ids) > self.num_prompt_tokens

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )
