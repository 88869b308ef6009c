import sys

from spotlight.actors.node.service import main

sys.exit(main())
