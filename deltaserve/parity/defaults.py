"""The parity commands' choices and defaults, in a module without torch: the CLI builds its parser from them."""

REFERENCES = ("transformers", "deltaserve")
DEFAULT_TOPK = 256  # reference log-probabilities kept per output token: the whole vocabulary of small test models
# Per regime, 3x the 99th percentile of its per-position max |logit error| against the float32 reference, measured
# on small random models (BENCHMARKS.md, "Parity"; reproduce with benchmarks/parity_tie_margin.py).
DEFAULT_TIE_MARGINS = {"float32": 4.4e-5, "bfloat16": 6.2}
