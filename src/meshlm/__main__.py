from meshlm.cli import main

raise SystemExit(main())
