import sys

from spotlight.actors.store.service import main

sys.exit(main())
