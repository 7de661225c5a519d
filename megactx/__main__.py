import sys

from megactx.cli import main

sys.exit(main())
