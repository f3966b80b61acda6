"""python -m bench: the offline engine benchmark (bench/offline.py)."""
from bench.offline import main

raise SystemExit(main())
