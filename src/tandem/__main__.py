from tandem.cli.main import main

raise SystemExit(main())
