"""deltaserve chat: an interactive conversation with a model, streamed token by token through its chat template.

/reset forgets the conversation, /exit (or Ctrl-D) leaves. Ctrl-C during an answer stops that answer (its request
is aborted) and returns to the prompt; the answer so far stays in the conversation. The answers go to stdout;
the loading bar, the banner and each answer's speed go to stderr."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

from deltaserve.entrypoints.sampling_options import add_sampling_options, sampling_defaults
from deltaserve.sampling_params import SamplingParams

PROMPT = ">>> "
HELP = "/reset forgets the conversation, /exit or Ctrl-D leaves, Ctrl-C stops an answer"


CHAT_SAMPLING = {"temperature": 0.7, "top_p": 0.9, "top_k": 0}  # where the model folder sets nothing


def add_chat_options(parser: argparse.ArgumentParser) -> None:
    add_sampling_options(parser, CHAT_SAMPLING)
    g = parser.add_argument_group("chat")
    g.add_argument("--max-tokens", type=int, default=256, help="the longest answer, in tokens (default 256)")
    g.add_argument("--system", default=None, help="a system message to start every conversation with")


def cmd_chat(args, make_llm: Callable) -> int:
    """Load the model (with a progress bar), then read, answer, repeat until /exit or end of input."""
    params = SamplingParams(max_tokens=args.max_tokens, seed=args.seed, **sampling_defaults(args, CHAT_SAMPLING))
    llm = make_llm(args)  # the engine draws the loading bar (closed before its next log line)
    try:
        if llm.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template and this model folder has none; "
                             "use `deltaserve generate --prompt-token-ids ...` instead")
        ChatSession(llm, params, args.system).run()
    finally:
        llm.shutdown()
    return 0


class ChatSession:
    """One conversation: the messages so far, and how to read a line and stream an answer to it."""

    def __init__(self, llm, params: SamplingParams, system: str | None = None):
        self.llm, self.params, self.system = llm, params, system
        self.reset()

    def reset(self) -> None:
        self.messages: list[dict] = [{"role": "system", "content": self.system}] if self.system else []

    def run(self) -> None:
        print(f"chat: {HELP}", file=sys.stderr, flush=True)
        while (line := _read_line()) is not None:
            command = line.strip()
            if command == "/exit":
                return
            if command == "/reset":
                self.reset()
                print("(conversation reset)", file=sys.stderr, flush=True)
            elif command:
                try:
                    self.answer(command)
                except KeyboardInterrupt:  # in the instant between an answer and the next prompt
                    print(file=sys.stderr)

    def answer(self, text: str) -> str:
        """Stream the model's answer to text; it joins the conversation, cut short if Ctrl-C stopped it."""
        self.messages.append({"role": "user", "content": text})
        with _interrupt_flag() as interrupted:  # from here on Ctrl-C stops this answer, not the program
            try:
                prompt = self.llm.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True)
                stream = self.llm.stream(prompt, self.params)
            except ValueError as e:  # the template refused the chat, or it is too long: nothing was queued
                self.messages.pop()
                print(f"error: {e}; /reset starts a new conversation", file=sys.stderr, flush=True)
                return ""
            reply, num_tokens, seconds, stopped = self._stream(stream, interrupted)
        self.messages.append({"role": "assistant", "content": reply})
        rate = num_tokens / seconds if seconds > 0 else 0.0
        print(flush=True)  # the answer's own line ends
        print(f"[{num_tokens} tokens, {rate:.1f} tok/s{', stopped' if stopped else ''}]", file=sys.stderr, flush=True)
        return reply

    def _stream(self, stream, interrupted: threading.Event) -> tuple[str, int, float, bool]:
        """Print each output's new text; after Ctrl-C, abort the request between two engine steps.
        Returns the text, its number of tokens, the seconds taken and whether it was stopped."""
        start, printed, num_tokens = time.perf_counter(), "", 0
        for output in stream:
            if interrupted.is_set() and not output.finished:  # before printing: nothing appears after Ctrl-C
                self.llm.abort(output.request_id)
                stream.close()
                return printed, num_tokens, time.perf_counter() - start, True
            completion = output.outputs[0]
            _write(completion.text[len(printed):])
            printed, num_tokens = completion.text, len(completion.token_ids)
        return printed, num_tokens, time.perf_counter() - start, False


def _read_line() -> str | None:
    """A line from the user; None at end of input. Ctrl-C at the prompt gives a fresh prompt, as Python's does."""
    while True:
        try:
            return input(PROMPT)
        except EOFError:
            print(file=sys.stderr)
            return None
        except KeyboardInterrupt:
            print(f"\n({HELP})", file=sys.stderr, flush=True)


def _write(text: str) -> None:
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


@contextmanager
def _interrupt_flag():
    """While inside, Ctrl-C sets an event instead of raising, so that no engine step is cut in half."""
    flag = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda signum, frame: flag.set())
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)
