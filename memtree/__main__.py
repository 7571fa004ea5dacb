"""`python -m memtree` is the same as the `memtree` console script."""

from memtree.cli import main

raise SystemExit(main())
