"""The offline API:  LLM(model=DIR).generate(prompts, SamplingParams(...)) -> [RequestOutput], in prompt order."""

from __future__ import annotations

import concurrent.futures
import operator
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from deltaserve.config import EngineConfig
from deltaserve.core.engine import Engine
from deltaserve.core.outputs import CompletionOutput, RequestOutput
from deltaserve.entrypoints.chat_tools import chat_completion_output, render_chat_prompt
from deltaserve.sampling_params import SamplingParams, StructuredOutputsParams, generation_defaults
from deltaserve.structured import errors

Prompt = str | dict  # text, or {"prompt_token_ids": [...]}
BUNDLED_MODEL = Path(__file__).resolve().parent.parent / "assets" / "demo-model"


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def engine_arguments(model: str | Path | None = None, dtype: str | None = None, device: str | None = None,
                     **engine_options) -> tuple[str, EngineConfig]:
    """The model folder and EngineConfig that LLM(model, dtype=..., device=..., **engine_options) runs: the demo model
    when model is None, the machine's device, its dtype (float32 on the CPU, else bfloat16)."""
    if model is not None and not str(model):
        raise ValueError("model '' is empty: pass a model folder, or leave it out for the bundled demo model")
    device = device if device is not None else default_device()  # a falsy value given is refused, not replaced
    dtype = dtype if dtype is not None else ("float32" if device == "cpu" else "bfloat16")
    if model is None and engine_options.get("threads") is None:
        # the demo model's ops are too small to gain from a second thread, and on a busy machine every op
        # waits for that thread to be scheduled: a hundred times slower
        engine_options["threads"] = 1
    return str(model if model is not None else BUNDLED_MODEL), EngineConfig(dtype=dtype, device=device,
                                                                             **engine_options)


class LLM:
    def __init__(self, model: str | Path | None = None, *, dtype: str | None = None, device: str | None = None,
                 progress: Callable[[int, int], None] | None = None, **engine_options):
        """model: a Kimi-Linear folder (default: the bundled demo model); dtype defaults to float32 on the CPU
        and bfloat16 on a GPU; progress(step, total) is called as the weights load; engine_options are
        EngineConfig's fields (max_model_len, max_num_seqs, ...). With tensor_parallel_size N > 1 this process is
        rank 0 and starts N - 1 worker processes (or joins torchrun's ranks); call shutdown() when done."""
        model, config = engine_arguments(model, dtype, device, **engine_options)
        self.generation_defaults = generation_defaults(model)  # before the load: a bad file fails fast
        if config.tensor_parallel_size == 1:
            self.engine, self._workers = Engine(model, config, progress), None
        else:
            from deltaserve.core.tensor_parallel import start_engine

            self.engine, self._workers = start_engine(model, config, progress)
        self.tokenizer = self.engine.tokenizer
        # each unfinished request's call's outputs not yet taken (one deque a call: generate, or a stream), so that
        # a step's outputs reach the call that added them, whichever call ran the step
        self._inboxes: dict[str, deque[RequestOutput]] = {}
        # a prompt of SamplingParams.n > 1 runs as n requests: the first one's id (its outputs' request_id) -> the
        # other n - 1 ids, so that abort(id) stops them all
        self._siblings: dict[str, list[str]] = {}
        self._lock = threading.RLock()  # one engine step, add or abort at a time, from whichever thread
        self._closed = False

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model folder's generation_config.json defaults (temperature, top_p, ...; the
        class's own where it has none): what generate, stream and chat use when given no sampling_params."""
        return SamplingParams(**self.generation_defaults)

    def shutdown(self) -> None:
        """Stop the worker processes of tensor parallel; on one process, save the kernels' new autotuning decisions
        (a GPU's) and stop the grammar pool (Engine.shutdown). The LLM refuses work after; a second call does
        nothing."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            if self._workers is not None:
                from deltaserve.core.tensor_parallel import stop_engine

                stop_engine(self.engine, self._workers)
                self._workers = None
            else:
                self.engine.shutdown()

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion together (continuous batching); outputs in prompt order, each with
        SamplingParams.n completions. Requests of other calls (a stream, or another thread's generate) run in the
        same steps."""
        families, inbox = self._add(prompts, sampling_params)
        req_ids = [r for family in families for r in family]
        final: dict[str, RequestOutput] = {}
        try:
            with tqdm(total=len(req_ids), desc="generating", disable=not use_tqdm, unit="req") as bar:
                for output in self._outputs(req_ids, inbox):
                    if output.finished:
                        final[output.request_id] = output
                        bar.update(1)
        except BaseException:
            self._abort_all(req_ids)  # an error or Ctrl-C leaves none of this call's requests in the engine
            raise
        finally:
            self._forget_families(families)
        return [merge_family(family, final) for family in families]

    def stream(self, prompts: Prompt | Sequence[Prompt],
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> OutputStream:
        """An iterator of this call's prompts' cumulative RequestOutputs, one each time a prompt's request gains
        tokens (with SamplingParams.n > 1: all n completions so far, each time one gains), until all finish. Invalid
        prompts raise here, at the call, with nothing queued. Closing the stream, or dropping it, aborts the
        requests it has not finished."""
        return OutputStream(self, *self._add(prompts, sampling_params))

    def abort(self, request_id: str) -> None:
        """Stop a request started with stream() (a RequestOutput's request_id: with n > 1, all n completions); its
        cache is freed at once, and its stream yields no more of it."""
        with self._lock:
            req_ids = [request_id, *self._siblings.pop(request_id, ())]
            for req_id in req_ids:
                box = self._inboxes.pop(req_id, None)
                if box:  # outputs a step brought that its call has not taken yet
                    kept = [o for o in box if o.request_id not in req_ids]
                    box.clear()
                    box.extend(kept)
                self.engine.abort(req_id)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = False, *,
             tools: list[dict] | None = None, tool_choice: str | dict | None = None,
             parallel_tool_calls: bool = True) -> RequestOutput | list[RequestOutput]:
        """One chat (a list of {role, content}) through the model's chat template, or a list of chats run together
        (a list of RequestOutput back, in order; sampling_params one for all or one per chat). Each outputs[i] is a
        ChatCompletionOutput: .content and .tool_calls hold the assistant message read from .text. tools are
        OpenAI's, declared to the model; tool_choice "auto" (the default with tools) parses tool calls, "none"
        leaves the whole output as content, "required" or {"type": "function", "function": {"name": ...}} force a
        call: the output is constrained to the tools' parameter schemas (structured outputs) and returned as
        tool_calls (one call only with parallel_tool_calls false)."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template; this model folder has no tokenizer")
        batch = isinstance(messages, (list, tuple)) and bool(messages) and all(
            isinstance(m, (list, tuple)) for m in messages)
        chats = list(messages) if batch else [messages]
        params = self._params_per_prompt(sampling_params, len(chats))
        prompts = [render_chat_prompt(self.tokenizer, chat, tools, tool_choice, parallel_tool_calls=parallel_tool_calls)
                   for chat in chats]
        for i, prompt in enumerate(prompts):
            if prompt.forced is not None:
                if params[i].structured_outputs is not None:
                    raise ValueError("tool_choice forces a tool call, which constrains the output, and sampling_params "
                                     "carries structured_outputs too; send only one of them")
                params[i] = replace(params[i], structured_outputs=StructuredOutputsParams(json=prompt.forced.schema))
        outputs = self.generate([p.text for p in prompts], params, use_tqdm=use_tqdm)
        for output, prompt in zip(outputs, prompts):
            output.outputs = [chat_completion_output(c, prompt.parse_tool_calls, prompt.forced) for c in output.outputs]
        return outputs if batch else outputs[0]

    def _add(self, prompts, sampling_params) -> tuple[list[list[str]], deque[RequestOutput]]:
        """Queue prompts, all or none; each prompt's request ids (n of them: the first is the prompt's id, see
        merge_family) and the inbox their outputs go to."""
        if self._closed:
            raise RuntimeError("this LLM was shut down; make a new one")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Iterable):
            raise TypeError(f"prompts of type {type(prompts).__name__}: pass a string, a {{'prompt_token_ids': "
                            "[...]}} dict, or a list of them")
        prompts = list(prompts)
        params = self._params_per_prompt(sampling_params, len(prompts))
        encoded = [self._encode(p) for p in prompts]
        self._compile_grammars(params)
        families, inbox = [], deque()
        with self._lock:
            try:
                for (text, ids), sp in zip(encoded, params):
                    families.append(family := [])
                    for i, child in enumerate(fan_out(sp)):  # the first id names the family: later ids derive from it
                        family.append(self.engine.add_request(ids, child, prompt=text,
                                                              request_id=f"{i}_{family[0]}" if i else None))
                        self._inboxes[family[-1]] = inbox
                    if len(family) > 1:
                        self._siblings[family[0]] = family[1:]
            except BaseException:
                self._abort_all([r for f in families for r in f])  # all or nothing: one rejected prompt leaves
                self._forget_families(families)                    # none of its batch queued
                raise
        return families, inbox

    def _params_per_prompt(self, sampling_params, num_prompts: int) -> list[SamplingParams]:
        params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
        if isinstance(params, SamplingParams):
            return [params] * num_prompts
        if not isinstance(params, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in params):
            raise TypeError(f"sampling_params of type {type(params).__name__}: pass a SamplingParams, or a list of "
                            "them (one per prompt)")
        if len(params) != num_prompts:
            raise ValueError(f"{num_prompts} prompts but {len(params)} SamplingParams; pass one, or one per prompt")
        return list(params)

    def _outputs(self, req_ids: list[str], inbox: deque[RequestOutput]) -> Iterator[RequestOutput]:
        """req_ids' outputs as the engine steps, until each has finished or was aborted. A step's outputs of other
        calls' requests wait in those calls' inboxes."""
        while True:
            while inbox:
                yield inbox.popleft()
            with self._lock:
                if inbox:  # another thread's step brought some
                    continue
                if not any(r in self._inboxes for r in req_ids):
                    while not self._inboxes and self.engine.has_unfinished_requests():
                        self.engine.step()  # no other call waits: end the step in flight (asynchronous scheduling)
                    return
                if not self.engine.has_unfinished_requests():  # aborted in the engine itself: nothing more comes
                    self._forget(req_ids)
                    return
                for output in self.engine.step():
                    box = self._inboxes.get(output.request_id)
                    if output.finished:
                        self._inboxes.pop(output.request_id, None)
                    if box is not None:
                        box.append(output)

    def _forget(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self._inboxes.pop(req_id, None)

    def _forget_families(self, families: list[list[str]]) -> None:
        with self._lock:
            for family in families:
                if family:  # empty: its prompt's first request was refused
                    self._siblings.pop(family[0], None)

    def _compile_grammars(self, params: list[SamplingParams]) -> None:
        """Compile every constraint first (in parallel, cached by the engine), so that a bad schema, regex or grammar
        raises ValueError here, at the call, with nothing queued."""
        specs = {p.structured_outputs.key: p.structured_outputs for p in params if p.structured_outputs is not None}
        if not specs:
            return
        deadline = time.monotonic() + errors.COMPILE_TIMEOUT_S
        manager = self.engine.structured_outputs()
        futures = [manager.submit(spec, wait_for_room=True, deadline=deadline) for spec in specs.values()]
        for future in futures:
            try:
                future.result(timeout=max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                raise errors.CompileTimeout() from None

    def _abort_all(self, req_ids: list[str]) -> None:
        """Abort those of req_ids that have not finished."""
        with self._lock:
            for req_id in req_ids:
                if self._inboxes.pop(req_id, None) is not None:
                    self.engine.abort(req_id)

    def _encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            ids = prompt.get("prompt_token_ids")
            if set(prompt) != {"prompt_token_ids"} or not isinstance(ids, (list, tuple)) or not ids:
                raise ValueError(f"prompt {prompt!r:.80}: a dict prompt needs a non-empty 'prompt_token_ids' list "
                                 "(and no other key)")
            try:  # numpy's integers too; not bools, nor floats
                if any(isinstance(t, bool) for t in ids):
                    raise TypeError
                return None, [operator.index(t) for t in ids]
            except TypeError:
                raise ValueError(f"prompt {prompt!r:.80}: token ids must be integers") from None
        if not isinstance(prompt, str):
            raise ValueError(f"prompt {prompt!r}: must be a string or {{'prompt_token_ids': [...]}}")
        if self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer, so text prompts cannot be encoded; "
                             "pass {'prompt_token_ids': [...]} instead")
        ids = self.tokenizer.encode_prompt(prompt)  # a rendered chat (LLM.chat, the chat command) gets no BOS added
        if not ids:
            raise ValueError(f"prompt {prompt!r} encodes to no tokens; pass a non-empty prompt")
        return prompt, ids


class OutputStream:
    """What LLM.stream returns: an iterator of its own prompts' outputs (a prompt of SamplingParams.n > 1: its n
    completions merged, merge_family). close(), or dropping it before the end, aborts the requests it has not
    finished (they would otherwise run on, and a later generate would wait for them)."""

    def __init__(self, llm: LLM, families: list[list[str]], inbox: deque[RequestOutput]):
        self._llm, self._families = llm, families
        self.request_ids = [family[0] for family in families]  # one per prompt: its outputs' request_id
        self._req_ids = [r for family in families for r in family]
        self._outputs = self._merged(llm._outputs(self._req_ids, inbox))

    def _merged(self, outputs: Iterator[RequestOutput]) -> Iterator[RequestOutput]:
        family_of = {r: family for family in self._families if len(family) > 1 for r in family}
        latest: dict[str, RequestOutput] = {}
        try:
            for output in outputs:
                family = family_of.get(output.request_id)
                if family is None:
                    yield output
                else:
                    latest[output.request_id] = output
                    yield merge_family(family, latest)
        finally:
            self._llm._forget_families(self._families)

    def __iter__(self) -> OutputStream:
        return self

    def __next__(self) -> RequestOutput:
        return next(self._outputs)

    def close(self) -> None:
        self._outputs.close()
        self._llm._abort_all(self._req_ids)

    def __del__(self):
        try:
            self.close()
        except Exception:  # the interpreter is exiting, or the engine already failed: nothing to free
            pass


def fan_out(params: SamplingParams) -> list[SamplingParams]:
    """The n requests of a prompt whose params ask for n completions: n = 1 each; with a seed, request i uses
    seed + i (as the server's choices do), so that they differ; prompt logprobs only on the first, whose output
    carries them."""
    if params.n == 1:
        return [params]
    first = replace(params, n=1)
    rest = replace(first, prompt_logprobs=None)
    return [first] + [replace(rest, seed=None if params.seed is None else params.seed + i) for i in range(1, params.n)]


def merge_family(family: list[str], outputs: dict[str, RequestOutput]) -> RequestOutput:
    """One prompt's RequestOutput from its requests' latest outputs (family: their ids, the first naming it):
    completion i is request i's (empty until it has one), finished once all are; prompt, prompt logprobs and cached
    tokens are the first request's (or, before it has an output, the first that has one)."""
    if len(family) == 1:
        return outputs[family[0]]
    present = [outputs[r] for r in family if r in outputs]
    head = outputs.get(family[0], present[0])
    completions = [replace(outputs[r].outputs[0], index=i) if r in outputs else CompletionOutput(i, "", [])
                   for i, r in enumerate(family)]
    finished = len(present) == len(family) and all(o.finished for o in present)
    metrics = {"arrival_time": min(o.metrics["arrival_time"] for o in present)}
    first_tokens = [o.metrics["first_token_time"] for o in present if "first_token_time" in o.metrics]
    if first_tokens:
        metrics["first_token_time"] = min(first_tokens)
    if finished:
        metrics["finish_time"] = max(o.metrics["finish_time"] for o in present)
    return RequestOutput(family[0], head.prompt, head.prompt_token_ids, completions, finished, head.prompt_logprobs,
                         metrics, head.num_cached_tokens)
