from rlhf.bench.cli import main

raise SystemExit(main())
