"""Offline, vLLM-shaped: ``LLM().generate(prompts, params)`` runs everything to completion."""
from __future__ import annotations

from .config import EngineConfig
from .engine import LLMEngine
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams


def merge(into: dict[int, CompletionOutput], delta: list[CompletionOutput]) -> None:
    """Fold increments into cumulative choices, keyed by choice index."""
    for d in delta:
        cur = into.setdefault(d.index, CompletionOutput(d.index, "", [], logprobs=[] if d.logprobs else None))
        cur.text += d.text
        cur.token_ids.extend(d.token_ids)
        if d.logprobs:
            cur.logprobs = (cur.logprobs or []) + d.logprobs
        cur.finish_reason, cur.stop_reason = d.finish_reason, d.stop_reason


class LLM:
    """Run prompts to completion.

    ``LLM()`` loads the built-in model; keyword arguments are :class:`EngineConfig` fields
    (``model``, ``block_size``, ``max_num_seqs``, ``max_num_batched_tokens``,
    ``kv_cache_memory_bytes``, ``max_model_len``, ``enable_prefix_caching``, …).
    """

    def __init__(self, model: str = "builtin", loaded=None, **kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs), loaded)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for each prompt (a string or a list of token ids); one params or one per prompt.

        Returns one cumulative :class:`RequestOutput` per prompt, in order, each with
        ``outputs[i].token_ids``, ``.text`` and ``.finish_reason`` per choice, and
        ``prompt_logprobs`` where the params asked for them.

        Raises:
            RequestRejected, ValueError: a prompt that cannot run; nothing is queued then.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        engine = self.engine
        batch = [engine.make_requests(p, sp) for p, sp in zip(prompts, params)]
        ids = [reqs[0].group_id for reqs in batch]
        for reqs in batch:
            engine.add(reqs)
        choices: dict[str, dict[int, CompletionOutput]] = {i: {} for i in ids}
        last: dict[str, RequestOutput] = {}
        while engine.has_unfinished():
            for out in engine.step():
                merge(choices[out.request_id], out.outputs)
                if out.prompt_logprobs is None and out.request_id in last:  # only the first output has them
                    out.prompt_logprobs = last[out.request_id].prompt_logprobs
                last[out.request_id] = out
        results = []
        for rid in ids:
            out = last[rid]
            out.outputs = [choices[rid][i] for i in sorted(choices[rid])]
            results.append(out)
        return results

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | list[SamplingParams] | None = None,
             **template_kwargs) -> list[RequestOutput]:
        """Apply the model's chat template (transformers) to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, **template_kwargs) for c in conversations]
        return self.generate(prompts, params)

    def apply_chat_template(self, messages: list[dict], **kwargs) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False)
