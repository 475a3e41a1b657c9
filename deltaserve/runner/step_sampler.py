"""The runner's side of a step's sampling: RequestState (its copy of a request), StepSampler (the tokens of a step
and of its lookahead steps, for the requests that sample) and PendingOutput (a step's output, waited for once)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from deltaserve.kernels import sampling
from deltaserve.kernels.sampling import SampledLogprobs, build_sampling_metadata, plain_greedy, row_generators
from deltaserve.kernels.varlen import to_device
from deltaserve.runner.logprobs import sampled_logprobs
from deltaserve.runner_output import RunnerOutput
from deltaserve.sampling_params import LOGIT_BIAS_LIMIT, SamplingParams


@dataclass
class RequestState:
    """The runner's copy of a request: its tokens (prompt, then outputs) and where its cache lives."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    state_slot: int
    num_computed_tokens: int
    min_tokens_stop_ids: tuple[int, ...] = ()  # masked while it has fewer than min_tokens outputs

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def __post_init__(self):
        self._pages = torch.tensor(self.block_ids, dtype=torch.int64)  # block_ids as a tensor, grown in place
        self._allowed_ids = self._bias = None  # on the device from its first step that samples

    def allowed_ids(self, device: torch.device) -> torch.Tensor:
        """allowed_token_ids as int64 [A] on device; sent once, read by every step after (a step of 256 rows of long
        lists would otherwise send them all again)."""
        if self._allowed_ids is None:
            self._allowed_ids = to_device(self.sampling_params.allowed_token_ids, torch.int64, device)
        return self._allowed_ids

    def logit_bias(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """logit_bias as (token ids int64 [B], values float32 [B], clamped to +-LOGIT_BIAS_LIMIT) on device; sent
        once, as allowed_ids."""
        if self._bias is None:
            bias = self.sampling_params.logit_bias
            # clamped before float(): an int past float's range clamps too
            values = [float(min(max(v, -LOGIT_BIAS_LIMIT), LOGIT_BIAS_LIMIT)) for v in bias.values()]
            self._bias = to_device(list(bias), torch.int64, device), to_device(values, torch.float32, device)
        return self._bias

    def add_pages(self, block_ids: list[int]) -> None:
        """Append pages to the block table (block_ids and its tensor, page_row)."""
        if not block_ids:  # most decode steps: no new page
            return
        start, end = len(self.block_ids), len(self.block_ids) + len(block_ids)
        self.block_ids.extend(block_ids)
        if end > self._pages.numel():  # doubling: appends cost O(1) pages copied each
            grown = torch.empty(max(end, 2 * self._pages.numel()), dtype=torch.int64)
            grown[:start] = self._pages[:start]
            self._pages = grown
        self._pages[start:end] = torch.tensor(block_ids, dtype=torch.int64)

    @property
    def page_row(self) -> torch.Tensor:
        """The block table as an int64 tensor [pages]: a view, which later add_pages leave as it is."""
        return self._pages[:len(self.block_ids)]


class StepSampler:
    """Samples one step's tokens for the requests whose chunk reaches their end (`states`), step after step of a
    lookahead: penalties and a grammar's mask read the outputs the host has, which the scheduler guarantees are all
    of them for a request that has either (SamplingParams.samples_from_outputs); seeded rows draw from generators
    seeded by their token's output number, counted from positions, so a step whose previous tokens are still in
    flight draws what single synchronous steps would. Each step's logits are adjusted before sampling (_adjust:
    allowed_token_ids, logit_bias, a request short of min_tokens outputs having its stop ids masked), after a
    grammar's mask: logprobs are those of the adjusted distribution."""

    def __init__(self, states: list[RequestState], rows: list[int], vocab_size: int, generator: torch.Generator,
                 logits_processor=None):
        """states: the requests that sample, their computed tokens advanced by the step's chunk; rows: the step's
        token row of each one's last token; generator: on the device, for the rows that sample without a seed."""
        self.states, self.rows, self.device = states, rows, generator.device
        self.logits_processor = logits_processor
        self.params = params = [s.sampling_params for s in states]
        # outputs each request has before this step's token: its position past the prompt
        self.num_outputs = [s.num_computed_tokens - s.num_prompt_tokens for s in states]
        self.meta = None
        if not plain_greedy(params):  # the prompts and outputs only where a penalty reads them (O(context) a row)
            penalised = any(p.penalized for p in params)
            prompts = [s.token_ids[: s.num_prompt_tokens] if penalised else [] for s in states]
            outputs = [s.output_token_ids if penalised else [] for s in states]
            self.meta = build_sampling_metadata(params, prompts, outputs, vocab_size, self.device, generator,
                                                self.num_outputs)
        self.all_rows = list(range(len(states)))
        # (row, steps it is masked for, ids): the rows short of min_tokens outputs, from this step on (a stop id past
        # the vocabulary is never sampled: nothing to mask)
        self.min_tokens_rows = [(row, p.min_tokens - n, [t for t in s.min_tokens_stop_ids if t < vocab_size])
                                for row, (s, p, n) in enumerate(zip(states, params, self.num_outputs))
                                if n < p.min_tokens and s.min_tokens_stop_ids]
        # the same at every lookahead step (they do not read outputs): their indices go to the device once
        allowed = [row for row, p in enumerate(params) if p.allowed_token_ids is not None]
        self.allowed = None if not allowed else (  # (rows [R], (row, id) pairs [P] and [P])
            to_device(allowed, torch.int64, self.device),
            *_pairs(allowed, [states[row].allowed_ids(self.device) for row in allowed], self.device))
        biased = [row for row, p in enumerate(params) if p.logit_bias]
        biases = [states[row].logit_bias(self.device) for row in biased]
        self.bias = None if not biased else (  # ((row, id) pairs [P] and [P], values [P])
            *_pairs(biased, [ids for ids, _ in biases], self.device), torch.cat([values for _, values in biases]))
        self.result = None  # the first step's SamplerOutput, for its logprobs

    def sample(self, logits_at, step: int) -> torch.Tensor:
        """The tokens of lookahead step `step` (0: the step itself), [S] int64 on the device. Step 0 reads the
        sampling rows; every later step's rows are all of them (a lookahead step is all decodes)."""
        logits = logits_at(self.rows if step == 0 else self.all_rows)
        if step == 0 and self.logits_processor is not None:
            logits = self.logits_processor([s.req_id for s in self.states], logits)
        logits = self._adjust(logits, step)
        if self.meta is None:
            return logits.argmax(dim=-1)
        if step == 0:
            self.result = result = sampling.sample(logits, self.meta)
        else:  # seeded rows: generators for this step's output numbers
            generators = row_generators(self.params, [n + step for n in self.num_outputs], self.device)
            result = sampling.sample(logits, replace(self.meta, generators=generators))
        return result.token_ids

    def _adjust(self, logits: torch.Tensor, step: int) -> torch.Tensor:
        """logits [S, V] of lookahead step `step` as the requests' parameters adjust them, in vLLM's order:
        allowed_token_ids (every other id -inf), logit_bias (added), then min_tokens (the stop ids of a row whose
        token here is one of its first min_tokens outputs -inf, whatever their bias). A copy (logits may be a CUDA
        graph's output buffer), or logits itself when no row is adjusted."""
        min_tokens = self._min_tokens_pairs(step)
        if self.allowed is None and self.bias is None and min_tokens is None:
            return logits
        adjusted = logits.clone()
        if self.allowed is not None:  # -inf rows, then their allowed ids' logits put back
            rows, pair_rows, ids = self.allowed
            kept = adjusted[pair_rows, ids]
            adjusted.index_fill_(0, rows, float("-inf"))
            adjusted.index_put_((pair_rows, ids), kept)
        if self.bias is not None:  # a row's ids are distinct (a dict's keys): one addition each
            pair_rows, ids, values = self.bias
            adjusted.index_put_((pair_rows, ids), values, accumulate=True)
        if min_tokens is not None:
            adjusted[min_tokens] = float("-inf")
        return adjusted

    def _min_tokens_pairs(self, step: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows [P], stop ids [P]) that min_tokens masks at lookahead step `step`, or None for none."""
        pairs = [(row, token) for row, steps, ids in self.min_tokens_rows if step < steps for token in ids]
        if not pairs:
            return None
        index = to_device([row for row, _ in pairs] + [token for _, token in pairs], torch.int64, self.device)
        return index[:len(pairs)], index[len(pairs):]

    def pending(self, tokens: list[torch.Tensor], out: RunnerOutput, to_host) -> PendingOutput:
        """The step's output once its tokens (per step, [S] on the device) reach the host; the requests' computed
        tokens advance now by the lookahead steps, their tokens join them in result()."""
        num_steps = len(tokens)
        for state in self.states:
            state.num_computed_tokens += num_steps - 1
        logprobs = None
        if self.result is not None and self.result.logprobs is not None:  # to the host with the tokens, no wait
            found = self.result.logprobs  # field by field: dataclasses.astuple would deep-copy the tensors
            logprobs = SampledLogprobs(*(to_host(getattr(found, f.name))[0] for f in fields(found)))
        sampled, copied = to_host(tokens[0] if num_steps == 1 else torch.stack(tokens, dim=1))

        def finish() -> RunnerOutput:
            rows = [[t] for t in sampled.tolist()] if num_steps == 1 else sampled.tolist()
            for state, row in zip(self.states, rows):
                state.token_ids.extend(row)
                out.sampled_token_ids[state.req_id] = row
            if logprobs is not None:
                entries = sampled_logprobs(logprobs, [row[0] for row in rows], [p.logprobs for p in self.params])
                out.logprobs.update((s.req_id, [e]) for s, e in zip(self.states, entries) if e is not None)
            return out

        return PendingOutput(finish=finish, copied=copied)


def _pairs(rows: list[int], ids: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row of each id [P], the ids [P]) on device, for rows[i]'s ids[i] [n_i] on device; no host sync (the
    repeats' total is known here)."""
    counts = [t.numel() for t in ids]
    index = to_device(rows + counts, torch.int64, device)
    pair_rows = torch.repeat_interleave(index[:len(rows)], index[len(rows):], output_size=sum(counts))
    return pair_rows, torch.cat(ids)


class PendingOutput:
    """A step's RunnerOutput, ready or still being computed on the device: result() waits once for `copied` (an
    event after the step's work, its sampled tokens' copy to the host last; None on the CPU), then builds the
    output with finish() where one is given. launch: for a step whose sampling waits until the step before it is
    applied, the closure that queues it then and returns the PendingOutput it becomes."""

    def __init__(self, output: RunnerOutput | None = None, finish=None, copied: torch.cuda.Event | None = None,
                 launch=None):
        self._output, self._finish, self._copied, self._launch = output, finish, copied, launch

    def launch(self) -> None:
        """Queue the step's sampling if it waited (the step before it is applied now); a no-op otherwise."""
        if self._launch is not None:
            launched, self._launch = self._launch(), None
            self._output, self._finish, self._copied = launched._output, launched._finish, launched._copied

    def result(self) -> RunnerOutput:
        self.launch()
        if self._copied is not None:
            self._copied.synchronize()  # the step's one sync: for its work, not for work queued after it
            self._copied = None
        if self._output is None:
            self._output, self._finish = self._finish(), None
        return self._output
