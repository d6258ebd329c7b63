import sys

from edge0_eval.cli import main

sys.exit(main())
