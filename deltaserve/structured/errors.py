"""The two ways a constrained request is refused; both are ValueErrors, so every caller reports them as bad input."""

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
