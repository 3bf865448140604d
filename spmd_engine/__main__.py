from spmd_engine.run import main

raise SystemExit(main())
