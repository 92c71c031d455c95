from sokuji.cli import main

raise SystemExit(main())
