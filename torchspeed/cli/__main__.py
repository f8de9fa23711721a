import sys

from torchspeed.cli import main

sys.exit(main())
