"""Structured outputs: constraining a request's tokens to a JSON schema, a regex, a choice or an EBNF grammar.

xgrammar (the optional extra `deltaserve[structured]`) compiles the constraint and tracks each request's place in
it; it is imported only when the first constrained request arrives (it loads transformers), never at start-up.
schema_check refuses what xgrammar would silently ignore; backend turns a StructuredOutputsParams into a compiled
grammar, in a worker process that is killed past a time or memory bound (compile_worker); manager compiles off the
engine's step, keeps one matcher per running request and fills the token bitmask that kernels.token_bitmask applies
to the logits before sampling."""

from deltaserve.structured.errors import CompilesBusy, CompileTimeout, GrammarError, StructuredOutputsUnavailable

__all__ = ["CompilesBusy", "CompileTimeout", "GrammarError", "StructuredOutputsUnavailable"]
