"""The parity commands' choices and defaults, in a module without torch: the CLI builds its parser from them."""

REFERENCES = ("transformers", "deltaserve")
DEFAULT_TOPK = 256  # reference log-probabilities kept per output token (all 128 of the tests' small models)
# Per regime, 3x the 99th percentile of its per-position max |logit error| against the float32 reference, measured
# on small random models (BENCHMARKS.md, "Parity"; reproduce with benchmarks/parity_tie_margin.py). fp8 (FP8
# weights or a float8 latent cache): 3x FP8 weights' p99 on make-tiny seeds 0 and 1 (2.85, 2.59; teacher-forced path).
# Ordered finest to coarsest: a check takes the coarser of the golden's regime and its own.
DEFAULT_TIE_MARGINS = {"float32": 4.4e-5, "bfloat16": 6.2, "fp8": 8.5}
# Whatever the margin, a run fails when the teacher-forced top-1 agreement is under DEFAULT_MIN_TOP1 or the mean
# KL(golden || ours) over DEFAULT_MAX_KL: at a coarse regime's margin every divergence of a small model can be a
# near-tie, and these catch a different model. Measured on make-tiny models against a float32 golden: the same
# model in bfloat16 84-85% and KL 0.008-0.012, with FP8 weights 45-50% and 0.053-0.059; the demo model in
# bfloat16 or FP8 97-98% and under 1e-3; another seed's model 0-0.4% and 0.55 (README.md, "Parity").
DEFAULT_MIN_TOP1 = 0.25
DEFAULT_MAX_KL = 0.2
