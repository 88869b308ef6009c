import sys

from spotlight.actors.queue.service import main

sys.exit(main())
