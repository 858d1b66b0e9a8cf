from vitgraph.cli import main

raise SystemExit(main())
