import sys

from vigil_worker.trainer.rank import main

sys.exit(main())
