import sys

from spmd_engine.plan.main import main

sys.exit(main())
