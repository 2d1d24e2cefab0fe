"""The GPU driver `benchmarks/vllm_h200/` (a package: its __init__ says what each module holds).

    python benchmarks/vllm_h200.py run PLAN --work DIR --out DIR [--base DIR] [--deadline-s 500]
    python benchmarks/vllm_h200.py argv [--plan main] [--check PYTHON]
    python benchmarks/vllm_h200.py record OUT [--into benchmarks/results/vllm_h200.json]

(scripts/gpu/vllm_call.sh runs it on the H200; `--help` lists the plans.)
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: the package beside this file
    from vllm_h200.cli import main

    main()
