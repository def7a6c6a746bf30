"""Turn the step's last-position logits into one token per sampling request.

Order: logit bias (OpenAI), penalties, the ``min_tokens`` stop mask, the structured-output
grammar mask, then greedy or a sampled draw. Vectorized over the batch: penalties, temperature,
top-k, top-p (nucleus, Holtzman et al. 2020, §3.1), min-p (Nguyen et al. 2024) are tensor ops
over ``[num_requests, vocab]``; the grammar masks of all constrained rows are computed in parallel
into one bitmask (llguidance). The draw uses the exponential race (argmax of ``p / E`` with
``E ~ Exp(1)``, which picks index i with probability p_i) with each request's own generator, so a
seeded request samples the same tokens whatever else shares its batch.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from llguidance import LLExecutor
from llguidance.numpy import fill_next_token_bitmask_par  # llguidance.torch's apply would torch.compile

from .outputs import Logprob
from .request import Request


NON_FINITE = -1  # the token id of a row whose logits hold a NaN or an infinity


@dataclass
class SamplerOutput:
    """``token_ids[i]`` is request i's next token, or :data:`NON_FINITE` where its logits were not
    all finite (a damaged checkpoint or overflowing numerics): no token can be trusted from them."""
    token_ids: list[int]
    logprobs: list[Logprob | None]


def apply_logit_bias(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """OpenAI's ``logit_bias``: each request's ``{token_id: bias}`` added to its row (ids already
    checked against the vocabulary). ``logits``: ``[R, V]`` fp32, modified in place and returned."""
    rows, ids, bias = [], [], []
    for row, req in enumerate(requests):
        for tok, value in (req.params.logit_bias or {}).items():
            rows.append(row)
            ids.append(tok)
            bias.append(value)
    if rows:
        dev = logits.device
        logits.index_put_((torch.tensor(rows, device=dev), torch.tensor(ids, device=dev)),
                          torch.tensor(bias, dtype=logits.dtype, device=dev), accumulate=True)
    return logits


@functools.lru_cache(maxsize=8)
def _byte_bias(device: torch.device) -> torch.Tensor:
    """``[256, 8]`` fp32: for each byte value, 0 where bit k is set, -inf where it is clear."""
    bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
    return torch.where(bits == 1, 0.0, float("-inf")).to(device)


def bitmask_bias(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """llguidance's token bitmask as an additive bias.

    Args:
        bitmask: ``[R, W]`` int32, contiguous; bit j of word w set = token ``32w + j`` allowed.
        vocab_size: columns wanted (≤ 32·W).

    Returns:
        ``[R, vocab_size]`` fp32 on the bitmask's device: 0 where allowed, -inf elsewhere. Adding
        it (x + 0 == x) is several times faster on a CPU than ``masked_fill`` with a bool mask.
    """
    byte_values = bitmask.view(torch.uint8).long()  # little-endian: byte b of word w holds tokens 32w+8b..+7
    bias = torch.nn.functional.embedding(byte_values, _byte_bias(bitmask.device))
    return bias.reshape(bitmask.shape[0], -1)[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Repetition (CTRL, Keskar et al. 2019: over prompt and output), presence and frequency
    (OpenAI: over the output) penalties. ``logits``: ``[R, V]`` fp32, modified in place and returned."""
    vocab = logits.shape[1]
    for row, req in enumerate(requests):
        p = req.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(req.token_ids)), dtype=torch.long, device=logits.device)
            seen = seen[seen < vocab]
            vals = logits[row, seen]
            logits[row, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and req.num_output_tokens:
            out = torch.tensor(req.output_token_ids, dtype=torch.long, device=logits.device)
            counts = torch.bincount(out[out < vocab], minlength=vocab).to(logits.dtype)
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            min_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf every token outside each row's top-k, nucleus and min-p sets.

    Args:
        logits: ``[R, V]`` fp32 (already divided by temperature).
        top_k: ``[R]`` int64, 0 = off. Keeps the k largest (ties at the k-th value kept).
        top_p: ``[R]`` fp32 in (0, 1]: keeps the smallest set of most likely tokens whose
            probability reaches ``top_p`` (the token that crosses it is kept).
        min_p: ``[R]`` fp32 in [0, 1]: keeps tokens with probability ≥ ``min_p`` × the largest.

    Returns:
        A new ``[R, V]`` tensor.
    """
    vocab = logits.shape[1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    sorted_logits, _ = logits.sort(dim=-1, descending=True)
    kth = sorted_logits.gather(1, (k - 1)[:, None])
    logits = logits.masked_fill(logits < kth, float("-inf"))

    probs_sorted = torch.softmax(sorted_logits.masked_fill(sorted_logits < kth, float("-inf")), dim=-1)
    before = probs_sorted.cumsum(dim=-1) - probs_sorted  # mass of strictly more likely tokens
    keep_sorted = before < top_p[:, None]
    keep_sorted[:, 0] = True
    # The smallest kept logit in sorted order is the nucleus threshold.
    last_kept = keep_sorted.sum(dim=-1) - 1
    threshold = sorted_logits.gather(1, last_kept[:, None])
    logits = logits.masked_fill(logits < threshold, float("-inf"))

    probs = torch.softmax(logits, dim=-1)
    floor = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < floor, float("-inf"))


class Sampler:
    """Args:
        eos_token_ids: the model's end-of-sequence ids (masked while ``min_tokens`` is unmet).
    """

    def __init__(self, eos_token_ids: list[int]):
        self.eos_token_ids = eos_token_ids
        self._bitmask: torch.Tensor | None = None  # grammar masks' CPU buffer, grown to the most rows seen
        self._executor = LLExecutor()  # llguidance's pool for computing many rows' masks in parallel

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """Sample one token per request.

        Args:
            logits: ``[R, V]`` fp32, row i the logits after request i's last scheduled token.
            requests: the R requests, with their params, history, generator and grammar matcher.

        A row with a grammar matcher samples only tokens its grammar allows; if the other masks
        leave it none (``stop_token_ids`` under ``min_tokens`` covering every allowed token), the
        token drawn fails the grammar and the engine fails that request alone.
        """
        raw = logits  # logprobs are the model's own distribution: before bias, penalties and masks
        want_logprobs = any(r.params.logprobs is not None for r in requests)
        logits = logits.clone()
        apply_logit_bias(logits, requests)
        apply_penalties(logits, requests)
        self._mask_early_stop(logits, requests)
        self._mask_grammar(logits, requests)

        tokens = logits.argmax(dim=-1)
        if not all(r.params.greedy for r in requests):  # decided on the host: no device sync
            greedy = torch.tensor([r.params.greedy for r in requests], device=logits.device)
            temps = torch.tensor([r.params.temperature or 1.0 for r in requests], device=logits.device)
            scaled = logits / temps[:, None]
            scaled = apply_top_k_top_p_min_p(
                scaled,
                torch.tensor([r.params.top_k for r in requests], device=logits.device),
                torch.tensor([r.params.top_p for r in requests], device=logits.device),
                torch.tensor([r.params.min_p for r in requests], device=logits.device),
            )
            probs = torch.softmax(scaled, dim=-1)
            noise = torch.empty_like(probs)
            for row, req in enumerate(requests):
                if not req.params.greedy:
                    noise[row].exponential_(generator=req.generator)
            sampled = (probs / noise).argmax(dim=-1)
            tokens = torch.where(greedy, tokens, sampled)
        # argmax treats NaN as the largest value: without this a broken model serves token ids as text
        tokens = tokens.masked_fill(~torch.isfinite(raw).all(dim=-1), NON_FINITE)
        token_list = tokens.tolist()  # the step's one device→host copy
        return SamplerOutput(token_list, self._logprobs(raw, requests, token_list) if want_logprobs
                             else [None] * len(requests))

    def _mask_early_stop(self, logits: torch.Tensor, requests: list[Request]) -> None:
        for row, req in enumerate(requests):
            if req.grammar is not None and req.grammar.done:
                continue  # a complete grammar allows only EOS: min_tokens cannot extend it
            if req.num_output_tokens < req.params.min_tokens:
                stop_ids = list(req.params.stop_token_ids)
                if not req.params.ignore_eos:
                    stop_ids += self.eos_token_ids
                if stop_ids:
                    logits[row, stop_ids] = float("-inf")

    def _mask_grammar(self, logits: torch.Tensor, requests: list[Request]) -> None:
        """Mask to -inf, in the rows of requests with a grammar matcher only, every token the
        grammar does not allow next. The masks are computed on the CPU by llguidance, all rows
        in parallel, into one int32 bitmask, then added to those rows as 0/-inf on the logits' device."""
        rows = [row for row, req in enumerate(requests) if req.grammar is not None]
        if not rows:
            return
        width = (requests[rows[0]].grammar.vocab_size + 31) // 32
        if self._bitmask is None or self._bitmask.shape[0] < len(rows) or self._bitmask.shape[1] != width:
            self._bitmask = torch.empty(max(len(rows), 8), width, dtype=torch.int32,
                                        pin_memory=logits.device.type == "cuda")
        bitmask = self._bitmask[:len(rows)]
        fill_next_token_bitmask_par(self._executor, [(requests[row].grammar.matcher, i) for i, row in enumerate(rows)],
                                    bitmask.numpy())
        bias = bitmask_bias(bitmask.to(logits.device, non_blocking=True), logits.shape[1])
        logits.index_add_(0, torch.tensor(rows, device=logits.device), bias)

    @staticmethod
    def _logprobs(raw: torch.Tensor, requests: list[Request], tokens: list[int]) -> list[Logprob | None]:
        logprobs = torch.log_softmax(raw, dim=-1)
        width = max(r.params.logprobs or 0 for r in requests)
        top_vals, top_ids = logprobs.topk(max(width, 1), dim=-1)
        out: list[Logprob | None] = []
        for row, (req, tok) in enumerate(zip(requests, tokens)):
            n = req.params.logprobs
            if n is None or tok == NON_FINITE:
                out.append(None)
                continue
            top = list(zip(top_ids[row, :n].tolist(), top_vals[row, :n].tolist()))
            out.append(Logprob(tok, float(logprobs[row, tok]), top))
        return out
