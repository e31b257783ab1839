import sys

from mqd.cli import main

sys.exit(main())
