import sys

from dilaserve.cli import main

sys.exit(main())
