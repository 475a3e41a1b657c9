"""The ways a constrained request is refused; all are ValueErrors, so every caller reports them as bad input."""

from __future__ import annotations

EXTRA = "deltaserve[structured]"


class StructuredOutputsUnavailable(ValueError):
    """xgrammar is not installed: the message names the extra to install."""

    def __init__(self, cause: str):
        super().__init__(f"structured outputs need xgrammar, which is not installed ({cause}); install the "
                         f"optional extra: pip install '{EXTRA}'")


class GrammarError(ValueError):
    """A schema, regex, choice or grammar that cannot be used; param names the request field (e.g. 'regex')."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


COMPILE_TIMEOUT_S = 60.0  # a constraint that takes longer to compile is refused (its compile is killed: compile_worker)
COMPILE_MEMORY_BYTES = 2 << 30  # a compile's memory beyond its worker's start-up (compile_worker); past it, refused
# a constraint whose first token mask takes longer to fill is refused: every step of its batch would wait for its
# masks (the engine ends a request whose masks are slow at several steps in a row: structured.manager.FILL_LIMIT_S)
MAX_FIRST_MASK_S = 0.5


class CompileTimeout(ValueError):
    """A constraint whose grammar did not compile within seconds (COMPILE_TIMEOUT_S)."""

    def __init__(self, seconds: float | None = None):
        seconds = COMPILE_TIMEOUT_S if seconds is None else seconds
        super().__init__(f"the constraint did not compile within {seconds:g} s; simplify it (a smaller "
                         "schema, fewer or shorter bounded repetitions)")


MAX_COMPILES_IN_FLIGHT = 32  # constraints compiling or queued for the pool at once; past it, a new one is refused


class CompilesBusy(ValueError):
    """MAX_COMPILES_IN_FLIGHT constraints are compiling: a new one is refused at once, so that a burst of distinct
    schemas cannot queue compiles that every later request waits behind (the server answers 429)."""

    def __init__(self):
        super().__init__(f"{MAX_COMPILES_IN_FLIGHT} constraints are compiling already, the most at once; retry "
                         "shortly (a constraint compiled before is cached and never waits)")
