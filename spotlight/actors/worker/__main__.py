import sys

from spotlight.actors.worker.service import main

sys.exit(main())
