"""With STUB_FORWARD=1 and this folder first on PYTHONPATH, every engine's model forward and logits are zeros in
every Python process (an engine process too: Python imports sitecustomize at start-up), so a benchmark times the
host's work alone: scheduler, runner, engine, pipe, server. Greedy decoding then always picks token 0.

    STUB_FORWARD=1 PYTHONPATH=benchmarks/stub_forward python3 benchmarks/serve_bench.py --concurrency 64,256 ...

Without STUB_FORWARD=1 it does nothing."""

import os

if os.environ.get("STUB_FORWARD") == "1":
    import torch

    from deltaserve.runner import model_runner

    _runner_init = model_runner.ModelRunner.__init__

    def _stubbed_init(self, model, model_config, *args, **kwargs):
        _runner_init(self, model, model_config, *args, **kwargs)
        self._forward = lambda ids, batch: torch.zeros(ids.shape[0], 4)
        self.model.compute_logits = lambda hidden: torch.zeros(hidden.shape[0], model_config.vocab_size)

    model_runner.ModelRunner.__init__ = _stubbed_init
