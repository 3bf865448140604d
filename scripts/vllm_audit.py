#!/usr/bin/env python
"""The vLLM compatibility audit (docs/vllm-compatibility.md): vLLM's public names, and ours against them.

The page promises every public name of vLLM's offline API one verdict (same / differs /
ignored / refused). Keeping that promise by hand over hundreds of names drifts, so:

    # 1. vLLM's names, read from its source with `ast` (vLLM is never imported: it needs CUDA
    #    wheels), written to a snapshot that CI reads instead of vLLM
    python scripts/vllm_audit.py --vllm-src DIR/vllm   # DIR: the unpacked wheel
    # 2. a first guess for each name by probing our code (this checkout, or another one)
    python scripts/vllm_audit.py --classify [--package-root CHECKOUT] [--diff]
    # 3. missing verdicts seeded from the guesses (then reviewed by hand), and the page written
    python scripts/vllm_audit.py --init-verdicts
    python scripts/vllm_audit.py --write-doc

The reviewed verdicts live in docs/vllm-compatibility-verdicts.json (name -> verdict, note,
probe): the page is generated from the snapshot plus that file, so it can be rewritten after
the code changes, and tests/unit/test_vllm_compatibility.py checks it against the code.

The parts live in the package scripts/audit_vllm/ (a package named like this file could not
be imported beside it); this file stays the command, so the lines above keep working.
"""

import sys

from audit_vllm.cli import main

if __name__ == "__main__":
    sys.exit(main())
