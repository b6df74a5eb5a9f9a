import sys

from graphmem.cli.main import main

sys.exit(main())
