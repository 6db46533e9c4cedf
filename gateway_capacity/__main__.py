import sys

from gateway_capacity.cli import main

sys.exit(main())
