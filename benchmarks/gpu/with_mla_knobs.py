"""Run a deltaserve command with other launch knobs for the paged MLA decode kernel, to time a candidate end to end
before it becomes the default (issue 24: the long-context TPOT is the MLA decode kernel's).

    python3 benchmarks/gpu/with_mla_knobs.py '{"max_head_block": 32}' \\
        bench --config ... --long-prompt-len 262144

The knobs (a JSON object of triton_mla_decode's keyword arguments) replace its defaults for every call in this
process, CUDA graph captures included; a call's own keywords still win. `{}` runs the defaults (the baseline).
"""

import functools
import json
import sys

from deltaserve.entrypoints import cli
from deltaserve.kernels.mla import triton_decode


def main() -> int:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    knobs = json.loads(sys.argv[1])
    if not isinstance(knobs, dict):
        sys.exit(f"the knobs must be a JSON object, got {sys.argv[1]!r}")
    default = triton_decode.triton_mla_decode
    # attention.mla_decode imports the kernel's launcher at call time, so the module attribute is what it finds
    triton_decode.triton_mla_decode = functools.wraps(default)(lambda *a, **kw: default(*a, **{**knobs, **kw}))
    print(f"MLA decode knobs: {knobs or 'defaults'}", flush=True)
    return cli.main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
