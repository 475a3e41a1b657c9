"""Errors of the tokenizer package; each message names the bad value, what was expected and the fix."""


class TokenizerError(ValueError):
    """A tokenizer file or argument that deltaserve cannot use."""


class ChatTemplateError(TokenizerError):
    """A chat template that does not compile or render, or messages it cannot take."""
