"""``python -m tailguard`` is ``tailguard`` (benchmarks start it with the running interpreter)."""

from tailguard.cli import main

raise SystemExit(main())
