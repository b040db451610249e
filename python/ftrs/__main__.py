from ftrs.cli import main

raise SystemExit(main())
