"""`python -m bench`: the benchmark harness is not written yet."""

import sys

print("no benchmarks yet: see issue 'Benchmarks' and bench/README.md", file=sys.stderr)
sys.exit(0)
